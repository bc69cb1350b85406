"""A causal mask the model builds from constants, given back to attention as `is_causal`.

Run eagerly, a transformers model with no padding mask calls

    scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True)

and the CPU's flash kernel (and a GPU's) skips the blocks above the diagonal. Traced
(torch.export), the same model cannot take that shortcut: the library cannot tell
whether a traced mask is all-causal, so it builds the mask (arange, comparisons,
cumsum, index, where: batch x 1 x s x s) and passes it to every attention with
`is_causal=False`. The traced step then does more than eager does: it computes the
mask, runs attention over the masked half, and keeps the mask alive for the backward
(4 bytes an element of batch x s x s in fp32).

`recover_causal_masks` finds each attention whose mask depends on nothing but constants
(no input of the step, no parameter or buffer: it is the same tensor every step; a
tensor the forward makes from a literal, which export lifts to an input of its own, is
a constant),
evaluates that mask once at trace time, and where its value is exactly the causal
pattern (True / 0 on and below the diagonal, False / -inf or the dtype's lowest value
above it, broadcast over batch and heads) replaces it by `attn_mask=None,
is_causal=True`. That is the same function, computed as eager computes it. A mask that
depends on the batch (a padding mask), one that is not causal (a sliding window, a
prefix), or one too large to evaluate at trace time is left as it is, and the result
says which and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

SDPA = torch.ops.aten.scaled_dot_product_attention.default
# bytes of the largest value a mask's evaluation at trace time allocates (2^28: four
# batch rows of a bool mask of 8,192 tokens; alike rows are evaluated once, below); each
# value is freed after its last use
EVALUATION_BUDGET = 1 << 28
# ops that only check a value's traced metadata: they go with the value they check
_ASSERTS = frozenset({torch.ops.aten._assert_tensor_metadata.default})


@dataclass
class Recovered:
    """What `recover_causal_masks` did: attentions given `is_causal`, and for every other
    attention with a mask, (its node, why its mask stays)."""

    causal: int = 0
    left: list[tuple[str, str]] = field(default_factory=list)
    # attentions without a mask then given their grouped k and v (grouped_kv.py)
    grouped_kv: int = 0


def recover_causal_masks(gm: fx.GraphModule, constants: dict[str, torch.Tensor] | None = None,
                         ) -> tuple[fx.GraphModule, Recovered]:
    """`gm` (an exported forward graph) with each constant causal mask given back as
    `is_causal=True` (module docstring): a copy if anything changed, `gm` itself if not;
    `gm` is never changed. `constants`: the values of its placeholders that are lifted
    tensor constants, by placeholder name (`lifted_constants`)."""
    constants = constants or {}
    result = Recovered()
    causal = []
    evaluated: dict[fx.Node, Any] = {}  # a mask shared by every layer is evaluated once
    for node in gm.graph.nodes:
        if node.target is not SDPA:
            continue
        q, k, _, mask, _, is_causal, _, _ = bound(node)
        if not isinstance(mask, fx.Node) or is_causal:
            continue
        value = _evaluate(gm, mask, evaluated, constants)
        why = value if isinstance(value, str) else _not_causal(value, q, k)
        if why:
            result.left.append((node.name, why))
        else:
            causal.append(node)
    if not causal:
        return gm, result
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, remap))
    masks = set()
    for node in causal:
        new = remap[node]
        q, k, v, mask, dropout, _, scale, gqa = bound(new)
        new.args = (q, k, v)
        new.kwargs = {"attn_mask": None, "dropout_p": dropout, "is_causal": True,
                      "scale": scale, "enable_gqa": gqa}
        masks.add(mask)
        result.causal += 1
    for mask in masks:
        _erase_if_dead(graph, mask)
    graph.lint()
    return fx.GraphModule(gm, graph), result


def bound(node: fx.Node) -> list[Any]:
    """The node's arguments by its op's schema order, defaults filled in."""
    return bound_args(node.target, node.args, node.kwargs)


def bound_args(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    """An op's arguments by its schema's order, defaults filled in."""
    out = []
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args):
            out.append(args[i])
        elif arg.name in kwargs:
            out.append(kwargs[arg.name])
        else:
            out.append(arg.default_value)
    return out


def lifted_constants(ep: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """The tensors the forward makes from literals (export lifts each to a placeholder
    of its own), by placeholder name: the same every step."""
    kind = torch.export.graph_signature.InputKind.CONSTANT_TENSOR
    return {spec.arg.name: ep.constants[spec.target] for spec in ep.graph_signature.input_specs
            if spec.kind == kind and isinstance(ep.constants.get(spec.target), torch.Tensor)}


def _evaluate(gm: fx.GraphModule, mask: fx.Node, evaluated: dict,
              constants: dict[str, torch.Tensor]) -> Any:
    """The mask's value, computed from the graph's constants on the CPU, or why it
    cannot be (a str)."""
    if mask in evaluated:
        return evaluated[mask]
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> str | None:
        if node in seen:
            return None
        seen.add(node)
        if node.op == "placeholder" and node.name in constants:
            order.append(node)
            return None
        if node.op == "placeholder":
            return f"it depends on the step's input or state {node.name!r}"
        if node.op not in ("call_function", "get_attr"):
            return f"it is computed by {node.op} {node.name!r}"
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return f"it draws random numbers ({node.name!r})"
        for parent in node.all_input_nodes:
            why = visit(parent)
            if why:
                return why
        order.append(node)
        return None

    why = visit(mask)
    if why:
        evaluated[mask] = why
        return why
    values: dict[fx.Node, Any] = {}
    last = {parent: k for k, node in enumerate(order) for parent in node.all_input_nodes}
    for k, node in enumerate(order):
        if node.op == "get_attr":
            value = getattr(gm, node.target)
        elif node.op == "placeholder":
            value = constants[node.name]
        else:
            args = _on_cpu(fx.node.map_arg(node.args, values.__getitem__))
            kwargs = _on_cpu(fx.node.map_arg(node.kwargs, values.__getitem__))
            # an elementwise op's tensor: the dimensions it runs on one row of (None: not one)
            rows = _one_row_dims(args, kwargs) if _is_elementwise(node.target) and \
                isinstance(node.meta.get("val"), torch.Tensor) else None
            size = _allocates(node, rows)
            if size > EVALUATION_BUDGET:
                evaluated[mask] = why = (
                    f"evaluating it at trace time takes {node.name!r} of {size:,} bytes "
                    f"(more than {EVALUATION_BUDGET:,})")
                return why
            value = _run_elementwise(node.target, args, kwargs, rows) if rows else \
                _uniform_dims_expanded(node.target(*args, **kwargs))
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            evaluated[mask] = why = f"{node.name!r} has no value (a meta tensor)"
            return why
        values[node] = value
        for parent in node.all_input_nodes:  # no later node of the mask reads it
            if last.get(parent) == k and parent is not mask:
                del values[parent]
    evaluated[mask] = values[mask]
    return values[mask]


# Evaluating a mask of batch x 1 x s x s costs its batch rows only once: a constant mask's
# rows are alike (nothing of the step's input reaches it). A value whose rows are equal
# along a dimension is kept as one row expanded there (stride 0), and an elementwise op
# whose inputs are all expanded along a dimension runs on one row and is expanded back:
# the same values, computed on one row.
_ELEMENTWISE = frozenset({
    torch.ops.aten.__and__.Tensor, torch.ops.aten.__or__.Tensor,
    torch.ops.aten.__xor__.Tensor, torch.ops.aten.__and__.Scalar,
    torch.ops.aten.__or__.Scalar, torch.ops.aten.__xor__.Scalar,
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default})


def _is_elementwise(target: Any) -> bool:
    """Whether each output element of `target` is a function of the inputs' elements at
    the same (broadcast) place only: aten's pointwise ops, bitwise operators, casts."""
    if target in _ELEMENTWISE:
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def _one_row_dims(args: Any, kwargs: Any) -> list[int]:
    """The dimensions (of size > 1) of the broadcast shape of an elementwise op's tensor
    arguments along which every one of them is expanded (size 1 or stride 0 there, or
    of a lower rank)."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)]
    if not tensors:
        return []
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))

    def expanded(t: torch.Tensor, d: int) -> bool:
        k = d - (len(shape) - t.dim())
        return k < 0 or t.shape[k] == 1 or t.stride(k) == 0
    return [d for d, size in enumerate(shape) if size > 1
            and all(expanded(t, d) for t in tensors)]


def _allocates(node: fx.Node, rows: list[int] | None) -> int:
    """Bytes the evaluation of `node` allocates: none for a view, one row along each
    dimension in `rows` of an elementwise op, else its whole value."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    target = node.target
    if rows is None and isinstance(target, torch._ops.OpOverload) and any(
            r.alias_info is not None for r in target._schema.returns):
        return 0  # a view of its input
    numel = val.numel()
    for d in rows or ():
        numel //= val.shape[d]
    return numel * val.element_size()


def _run_elementwise(target: Any, args: Any, kwargs: Any, rows: list[int]) -> Any:
    """`target(*args, **kwargs)` run on one row along each dimension of `rows` (all its
    inputs are expanded there), and expanded back to the broadcast shape."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))

    def one_row(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        for d in rows:
            k = d - (len(shape) - x.dim())
            if k >= 0 and x.shape[k] > 1:
                x = x.narrow(k, 0, 1)
        return x

    args, kwargs = torch.utils._pytree.tree_map(one_row, (args, kwargs))
    return target(*args, **kwargs).expand(shape)


def _uniform_dims_expanded(value: Any) -> Any:
    """`value` with each dimension along which its rows are all equal kept as one row
    expanded (stride 0): the same values, one row of storage."""
    if not isinstance(value, torch.Tensor) or value.numel() <= 1:
        return value
    compact = _one_row(value)  # compared on its own storage, not the expanded view
    for d in range(compact.dim()):
        if compact.shape[d] > 1:
            row = compact.narrow(d, 0, 1)
            if torch.equal(row.expand(compact.shape), compact):
                compact = row
    return value if compact is value else compact.expand(value.shape)


def _one_row(value: torch.Tensor) -> torch.Tensor:
    """`value` narrowed to one row along each dimension it is expanded in (stride 0)."""
    for d in range(value.dim()):
        if value.shape[d] > 1 and value.stride(d) == 0:
            value = value.narrow(d, 0, 1)
    return value


def _on_cpu(value: Any) -> Any:
    """Device arguments (a model built on the meta device names it) as the CPU."""
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


def _not_causal(mask: torch.Tensor, q: fx.Node, k: fx.Node) -> str | None:
    """None if `mask` is the causal mask of attention from q to k, else why not."""
    lq, lk = q.meta["val"].shape[-2], k.meta["val"].shape[-2]
    if lq != lk:
        return f"queries ({lq}) and keys ({lk}) differ in length"
    if mask.dim() < 2 or mask.shape[-2:] != (lq, lk):
        return f"its shape {tuple(mask.shape)} is not broadcast over ... x {lq} x {lk}"
    mask = _one_row(mask)  # a batch or head dimension it is expanded in: checked once
    keep = torch.ones(lq, lk, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        causal = bool((mask == keep).all())
    elif mask.is_floating_point():
        # -inf, or the dtype's lowest value as transformers' additive masks fill: added to
        # a finite score either is a score whose exp() is exactly 0, as is_causal's
        masked = (mask == -math.inf) | (mask == torch.finfo(mask.dtype).min)
        causal = bool(torch.where(keep, mask == 0, masked).all())
    else:
        return f"it is of dtype {mask.dtype}"
    return None if causal else "its value is not the causal pattern"


def _erase_if_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` and then its inputs while nothing but metadata checks reads them."""
    if node.op != "call_function" or any(u.target not in _ASSERTS for u in node.users):
        return
    if node.target in _ASSERTS or node.is_impure():
        return
    for user in list(node.users):
        graph.erase_node(user)
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for parent in inputs:
        _erase_if_dead(graph, parent)
