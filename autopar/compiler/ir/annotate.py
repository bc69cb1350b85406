"""Fill the TrainGraph's node metadata: role, module path, layer, source, FLOPs, bytes.

Run once after tracing. Module paths use the user's own names ("transformer.h.3.attn").
Backward nodes inherit the module of the forward op they differentiate (same
autograd `seq_nr`).
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch.utils import flop_counter

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.causal_mask import bound
from autopar.compiler.ir.graph import TrainGraph
from autopar.costs import causal_share

_WRAPPER_PREFIX = "model"  # path of the user's model inside trace's loss wrapper


def annotate(tg: TrainGraph, blocks: tuple[str, int] | None) -> TrainGraph:
    """`blocks`: the model's repeated-block container (`repeated_block_container`)."""
    nodes = tg.call_nodes()
    _annotate_modules(nodes)
    _annotate_roles(tg)
    _annotate_layers(nodes, blocks)
    for node in nodes:
        node.meta.setdefault(M.VAL, None)  # e.g. getitem of an op's absent (None) output
        node.meta[M.FLOPS] = node_flops(node)
        node.meta[M.BYTES] = node_bytes(node)
    for param, grad in zip(tg.signature.params, tg.grad_nodes()):
        if grad.op == "call_function":
            grad.meta[M.GRAD_OF] = param.name
    return tg


def module_of(node: fx.Node) -> tuple[str | None, str | None]:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None, None
    path, cls = list(stack.values())[-1]
    path = _user_path(path)
    type_name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    if path is None:
        return None, None
    return path, type_name


def _user_path(path: str) -> str | None:
    """Export names modules from the wrapper ("model.h.0" or "L__self___model_h_0")."""
    if path in ("", _WRAPPER_PREFIX):
        return ""
    if path.startswith(_WRAPPER_PREFIX + "."):
        return path[len(_WRAPPER_PREFIX) + 1:]
    return None  # the loss wrapper itself: owned by no user module


def _annotate_modules(nodes: list[fx.Node]) -> None:
    by_seq: dict[int, fx.Node] = {}
    for node in nodes:
        path, type_name = module_of(node)
        node.meta[M.MODULE_PATH] = path
        node.meta[M.MODULE_TYPE] = type_name
        node.meta[M.SOURCE] = source_of(node)
        if path is not None and "seq_nr" in node.meta and not node.meta.get("autograd_backward"):
            by_seq.setdefault(node.meta["seq_nr"], node)
    for node in nodes:
        if node.meta.get("autograd_backward") and node.meta[M.MODULE_PATH] is None:
            fwd = by_seq.get(node.meta.get("seq_nr"))
            if fwd is not None:
                node.meta[M.MODULE_PATH] = fwd.meta[M.MODULE_PATH]
                node.meta[M.MODULE_TYPE] = fwd.meta[M.MODULE_TYPE]
                node.meta[M.SOURCE] = fwd.meta[M.SOURCE]


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def source_of(node: fx.Node) -> str | None:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    found = _FILE_LINE.findall(trace)
    return f"{found[-1][0]}:{found[-1][1]}" if found else None


def _annotate_roles(tg: TrainGraph) -> None:
    """forward / loss / backward.

    Backward: every node after the loss in execution order (the trace runs the whole
    forward, then autograd). Loss: forward nodes that lead to the loss but from
    which no forward op reading a parameter can be reached (log-softmax, nll, label
    shifting) - a definition that needs no knowledge of the model.
    """
    loss = tg.loss_node()
    params = set(tg.placeholders()[:len(tg.signature.params)])
    order = {n: i for i, n in enumerate(tg.graph.nodes)}
    forward = [n for n in tg.call_nodes() if order[n] <= order[loss]]
    for node in forward:  # a view of a parameter (w.t()) is still the parameter
        if _is_view(node) and node.all_input_nodes and node.all_input_nodes[0] in params:
            params.add(node)
    reads_param = {n for n in forward if n not in params
                   and any(a in params for a in n.all_input_nodes)}
    reaches_param_reader: set[fx.Node] = set()
    for node in reversed(forward):
        if node in reads_param or any(u in reaches_param_reader for u in node.users):
            reaches_param_reader.add(node)
    feeds_loss = _ancestors(loss) | {loss}
    for node in tg.call_nodes():
        if order[node] > order[loss]:
            role = M.Role.BACKWARD
        elif node in feeds_loss and node not in reaches_param_reader:
            role = M.Role.LOSS
        else:
            role = M.Role.FORWARD
        node.meta[M.ROLE] = role


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def repeated_block_container(model: torch.nn.Module) -> tuple[str, int] | None:
    """The model's main stack of repeated blocks: (container path, number of blocks).

    The ModuleList/Sequential with the most children of one class (ties: most
    parameters). No module names are assumed.
    """
    best = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) or len(mod) < 2:
            continue
        classes = {type(child) for child in mod}
        if len(classes) != 1:
            continue
        score = (len(mod), sum(p.numel() for p in mod.parameters()))
        if best is None or score > best[0]:
            best = (score, path, len(mod))
    return (best[1], best[2]) if best else None


def _annotate_layers(nodes: list[fx.Node], blocks: tuple[str, int] | None) -> None:
    prefix = blocks[0] + "." if blocks else None
    for node in nodes:
        path = node.meta[M.MODULE_PATH]
        layer = None
        if prefix is not None and path is not None and path.startswith(prefix):
            head = path[len(prefix):].split(".", 1)[0]
            layer = int(head) if head.isdigit() else None
        node.meta[M.LAYER] = layer


# -- FLOPs and bytes ----------------------------------------------------------------------

def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape)


# CPU flash attention is missing from torch.utils.flop_counter's registry (torch 2.13);
# its FLOPs are those of any other SDPA kernel on the same q/k/v shapes.
_EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        lambda q, k, v, *_, **__: flop_counter.sdpa_flop_count(_shape(q), _shape(k), _shape(v)),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda g, q, k, v, *_, **__: flop_counter.sdpa_backward_flop_count(
            _shape(g), _shape(q), _shape(k), _shape(v)),
}


def node_flops(node: fx.Node) -> int:
    """Matrix-multiply / convolution / attention FLOPs (torch.utils.flop_counter's
    formulas); elementwise ops count 0 FLOPs here and are costed by their bytes."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get(M.VAL))
    if target in _EXTRA_FLOPS:
        return int(_EXTRA_FLOPS[target](*args, **kwargs))
    if packet not in flop_counter.flop_registry:
        return 0
    return int(flop_counter.flop_registry[packet](*args, **kwargs, out_val=node.meta.get(M.VAL)))


def causal_fraction(node: fx.Node) -> float:
    """The share of its scores an attention kernel given `is_causal` computes (the fused
    kernels, flash, memory-efficient, cuDNN and the CPU's flash, skip the blocks above
    the diagonal: costs.causal_share); 1 for any other op."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or "is_causal" not in (a.name for a in schema.arguments):
        return 1.0
    named = dict(zip((a.name for a in schema.arguments), bound(node)))
    if not named["is_causal"] or "query" not in named or "key" not in named:
        return 1.0
    return causal_share(named["query"].meta[M.VAL].shape[-2],
                        named["key"].meta[M.VAL].shape[-2])


def executed_flops(node: fx.Node) -> int:
    """The FLOPs `node`'s kernel performs (its time), where M.FLOPS is the usual count
    (model FLOPs and MFU: a causal attention counted whole, as Megatron-LM and
    FlashAttention count it)."""
    flops = node.meta.get(M.FLOPS, 0)
    return int(flops * causal_fraction(node)) if flops else 0


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


# NOTE: not views by their schema, yet they move no data: `_unsafe_view` returns a view
# of its (fresh) input, `wait_tensor` the very tensor its collective wrote. Costing
# their read + write made a tp=4 GPT step 5% slower (docs/published_results.md).
_MOVES_NOTHING = frozenset({torch.ops.aten._unsafe_view.default,
                            torch.ops._c10d_functional.wait_tensor.default})


def node_bytes(node: fx.Node) -> int:
    """Bytes read and written by a non-view op (views and metadata ops move nothing)."""
    if (not isinstance(node.target, torch._ops.OpOverload) or node.target.is_view
            or node.target in _MOVES_NOTHING):
        return 0
    read = sum(tensor_bytes(a.meta.get(M.VAL)) for a in node.all_input_nodes)
    return read + tensor_bytes(node.meta.get(M.VAL))


def op_name(node: fx.Node) -> str:
    """The op a call node runs, without namespace and overload: "mm", "_log_softmax"
    (the key of DeviceSpec.op_time_factors)."""
    target = node.target
    return getattr(target, "_opname", None) or getattr(target, "__name__", str(target))


def tensor_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(tensor_bytes(v) for v in val)
    return 0
