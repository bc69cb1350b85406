"""Trace a model and its loss into one joint forward + loss + backward TrainGraph.

The route (see docs/concepts.md, "Why this tracing route"):

1. `torch.export.export` (non-strict) captures model + loss as an aten graph with
   parameters lifted to inputs. Export handles what the other tracers refuse on
   Hugging Face models: data-dependent mask code, `DynamicCache`-free outputs,
   tied weights (deduplicated to one input).
2. `make_fx` (fake tensors: nothing is allocated or computed) traces a function
   that runs the exported graph through an `fx.Interpreter` and takes
   `torch.autograd.grad(loss, params, allow_unused=True)`. The interpreter with
   `preserve_node_meta` carries each forward op's module stack and source line into
   the new graph; AOTAutograd's stack-trace hooks give every backward op the
   `seq_nr` of the forward op it differentiates, so backward ops get a module too.
   Parameters that get no gradient (an unused pooler) get zeros, not an error:
   `aot_export_module(trace_joint=True)` refuses such models and tied weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._functorch._aot_autograd.logging_utils import (
    setup_stacktrace_preservation_hooks,
)
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autopar.compiler.ir.annotate import annotate, repeated_block_container
from autopar.compiler.ir.batch import BatchError, LossFn, Objective, as_objective
from autopar.compiler.ir.causal_mask import Recovered, lifted_constants, recover_causal_masks
from autopar.compiler.ir.causal_mask import bound_args as _bound
from autopar.compiler.ir.eager_attention import Fused, fuse_eager_attention
from autopar.compiler.ir.graph import GraphSignature, TensorSpec, TrainGraph
from autopar.compiler.ir.grouped_kv import group_repeated_kv
from autopar.compiler.ir.program import LOSS_SCALE_INPUT
from autopar.layout import Layout

_WRAPPED = "model"  # attribute name of the user's model inside the loss wrapper


class TraceError(RuntimeError):
    """The model (or its loss) could not be traced; the message names where and why."""


class _ModelWithLoss(torch.nn.Module):
    """model + loss as one module taking the flat batch, so export captures the loss too."""

    def __init__(self, model: torch.nn.Module, objective: Objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, *flat):
        try:
            return self.objective.loss(self.model, flat)
        except BatchError as exc:  # no loss to differentiate: the trace cannot go on
            raise TraceError(str(exc)) from None


class ForwardHook(Protocol):
    """Changes how the forward graph runs while the joint graph is traced (e.g. AMP's
    casts); autograd then differentiates what the hook produced, so the backward
    pass follows by construction."""

    def call_function(self, node: fx.Node, args: tuple, kwargs: dict,
                      run: Callable[[tuple, dict], Any]) -> Any: ...


@dataclass(frozen=True)
class TraceSource:
    """What re-tracing needs: the exported forward, the facts about the model, and
    the forward hooks applied so far."""

    exported: torch.export.ExportedProgram
    example_inputs: tuple
    aliases: dict[str, tuple[str, ...]]
    blocks: tuple[str, int] | None  # the repeated-block container (annotate.py)
    hooks: tuple[ForwardHook, ...] = ()
    # fp16 loss scaling: the step takes a trailing fp32 0-dim input LOSS_SCALE_INPUT and
    # differentiates loss * scale (the returned loss stays unscaled)
    loss_scale: bool = False
    # tensor parallelism: parameter (exported name) -> (dim, parts, index, pieces): the
    # step takes only that block of the parameter (its gradient is that block's too);
    # pieces > 1 (or the pieces' sizes): the block of each of the dim's pieces
    # (tp_rules.Strided)
    param_shards: tuple[tuple[str, tuple[int, int, int, int | tuple[int, ...]]], ...] = ()
    # the device whose kernels the trace takes where a CPU's differ ("cpu" or "gpu",
    # DeviceSpec.kind): "gpu" runs every exported op through GPU_KERNELS, innermost
    kernels: str = "cpu"
    # with kernels "gpu", the attention kernels (DeviceSpec.attention): "fused" (sdpa, and
    # attention written out op by op taken as sdpa: gpu_forward) or "unfused" (matmul,
    # softmax, matmul in the model's dtype, sdpa too: GpuKernels)
    attention: str = "fused"
    # where the example is a shard of a larger batch: the same step exported at another
    # number of samples of that batch, at least 2 and none of `exclude` (memoised per
    # size); LookupError where the batch has no such size, TraceError where the model
    # does not export at it. The batch-split analysis (batch_split.py) reads a shard of
    # one sample on one (a batch dim of size 1 reads as a broadcast one), and tells the
    # numbers made from the shard's size (`loss.sum() / x.shape[0]`) by comparing two.
    resized: Callable[[frozenset[int]], TraceSource] | None = field(default=None, compare=False,
                                                                    repr=False)


def trace_train_step(model: torch.nn.Module, example_inputs: Sequence[Any],
                     loss_fn: LossFn | Objective | None = None,
                     kernels: str = "cpu", attention: str = "fused", *,
                     whole: Sequence[Any] | None = None) -> TrainGraph:
    """Trace one training step of `model` on `example_inputs` (a local batch, flat).

    `loss_fn` is an Objective (batch.py: which tensors go to the model, which to the
    loss), or a plain loss function taking the output and every input. Works on real,
    meta or fake tensors: nothing is computed. The model's own parameters are not
    modified. `kernels="gpu"` traces the dropouts as a GPU runs them (GpuKernels), and
    attention by `attention` (TraceSource.attention): for the planner costing a GPU
    cluster on a meta or CPU model. `whole`: the batch the example is a shard of
    (trace_source).
    """
    return _trace_from(trace_source(model, example_inputs, loss_fn, kernels, attention,
                                    whole=whole))


def trace_source(model: torch.nn.Module, example_inputs: Sequence[Any],
                 loss_fn: LossFn | Objective | None = None,
                 kernels: str = "cpu", attention: str = "fused", *,
                 whole: Sequence[Any] | None = None,
                 around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                 ) -> TraceSource:
    """The exported step `trace_train_step` traces the joint graph from (its arguments
    are trace_train_step's): what `pending_trace` takes. `whole`: the batch that
    `example_inputs` is one shard of: the source can then export the step at another
    number of its samples (TraceSource.resized), inside `around()` (the planner's
    reduced model)."""
    if kernels not in ("cpu", "gpu"):
        raise ValueError(f"kernels must be 'cpu' or 'gpu', got {kernels!r}")
    if attention not in ("fused", "unfused"):
        raise ValueError(f"attention must be 'fused' or 'unfused', got {attention!r}")
    example_inputs = tuple(example_inputs)
    bad = [type(a).__name__ for a in example_inputs if not isinstance(a, torch.Tensor)]
    if bad:
        raise TraceError(f"example_inputs must all be tensors (got {bad}); bind other "
                         "arguments inside loss_fn or a wrapper module")
    objective = as_objective(loss_fn, len(example_inputs))
    objective.check_signatures(model)
    wrapper = _ModelWithLoss(model, objective)
    ep = _export(wrapper, model, example_inputs)
    if any(_on_meta(t) for t in [*ep.state_dict.values(), *ep.constants.values(),
                                 *example_inputs]):
        # before anything reads the exported forward (its causal masks, kept per graph)
        _meta_devices_to_cpu(ep.graph_module)
    resized = None
    found = _whole_batch(example_inputs, whole) if whole is not None else None
    if found is not None:
        whole = tuple(whole)
        size, dims = found

        @functools.cache
        def export_at(n: int) -> TraceSource:
            with around():
                return trace_source(model, tuple(x.narrow(d, 0, n) if d is not None else x
                                                 for x, d in zip(whole, dims)),
                                    objective, kernels, attention)

        def resized(exclude: frozenset[int]) -> TraceSource:
            n = next((n for n in range(2, size + 1) if n not in exclude), None)
            if n is None:
                raise LookupError(f"the batch has {size} samples: no other size to export")
            return export_at(n)
    return TraceSource(ep, example_inputs, _alias_groups(model), repeated_block_container(model),
                       kernels=kernels, attention=attention, resized=resized)


def _whole_batch(shard: tuple, whole: Sequence[Any]) -> tuple[int, tuple] | None:
    """(the batch's size, its batch dims) where `shard` is a part of `whole` along the
    same batch dims and `whole` holds more samples; else None."""
    whole = tuple(whole)
    dims = batch_dims_of([x for x in shard if isinstance(x, torch.Tensor)])
    whole_dims = batch_dims_of([x for x in whole if isinstance(x, torch.Tensor)])
    size, whole_size = batch_size(shard), batch_size(whole)
    if whole_dims != dims or size is None or whole_size is None or whole_size <= size:
        return None
    return whole_size, whole_dims


def pending_trace(source: TraceSource) -> TrainGraph:
    """The TrainGraph of `source` with its joint graph not traced yet (`retrace_pending`
    set, `gm` an empty graph; the signature and attrs are the trace's): for a pass list
    whose first pass re-traces from the source anyway (AMP, tensor parallelism), so the
    step is traced once, with their hooks, instead of once without them and again with
    them. The PassManager traces it (`complete_pending_retrace`) before a first pass
    that does not re-trace from the source, or after the last if none does."""
    tg = TrainGraph(gm=fx.GraphModule(torch.nn.Module(), fx.Graph()), signature=_signature(source),
                    provides=frozenset({"traced", "retraceable"}), source=source,
                    retrace_pending=True)
    tg.attrs.update(_source_attrs(source))
    return tg


def retrace(tg: TrainGraph, hook: ForwardHook, *, loss_scale: bool | None = None,
            param_shards: dict[str, tuple[int, int, int, int]] | None = None,
            deferred: bool = False) -> TrainGraph:
    """The joint graph traced again from tg's source with one more forward hook
    (and, if `loss_scale` is given, with loss scaling switched on or off; with
    `param_shards`, taking those parameters as blocks, see TraceSource).

    `deferred`: only the source changes, the trace is left to the next pass, which
    re-traces from the source anyway (PassContext.may_defer_retrace says when): the
    result has `retrace_pending` set and its `gm` is still tg's. Only for a pass whose
    result does not depend on running its hook.

    Only valid on a graph no joint-graph pass has rewritten (property "retraceable"):
    their rewrites would be lost.
    """
    if tg.source is None or "retraceable" not in tg.provides:
        raise ValueError("retrace needs a graph straight from trace_train_step or retrace "
                         f"(this one went through {list(tg.history)})")
    source = dataclasses.replace(tg.source, hooks=tg.source.hooks + (hook,))
    if loss_scale is not None:
        source = dataclasses.replace(source, loss_scale=loss_scale)
    if param_shards is not None:
        source = dataclasses.replace(source, param_shards=tuple(sorted(param_shards.items())))
    if deferred:
        return dataclasses.replace(tg, source=source, attrs=dict(tg.attrs), retrace_pending=True)
    return dataclasses.replace(_trace_from(source), history=tg.history, attrs=dict(tg.attrs))


def complete_pending_retrace(tg: TrainGraph) -> TrainGraph:
    """tg with the re-trace a pass deferred (`retrace(..., deferred=True)`) done: traced
    from its source; tg itself when no re-trace is pending. The PassManager calls it
    before every pass that does not re-trace from the source, and after the last."""
    if not tg.retrace_pending:
        return tg
    return dataclasses.replace(_trace_from(tg.source), provides=tg.provides, history=tg.history,
                               attrs=dict(tg.attrs))


def _trace_from(source: TraceSource) -> TrainGraph:
    gm, sig = _trace_joint(source)
    tg = TrainGraph(gm=gm, signature=sig, provides=frozenset({"traced", "retraceable"}),
                    source=source)
    tg.attrs.update(_source_attrs(source))
    return annotate(tg, source.blocks)


def _source_attrs(source: TraceSource) -> dict[str, Any]:
    """The attrs a trace of `source` records of its exported forward: the attention it
    fused (a GPU trace's) and the causal masks it recovered."""
    attrs: dict[str, Any] = {}
    if _fuses_attention(source):
        fused = gpu_forward(source.exported.graph_module)[1]
        attrs["eager_attention"] = {"fused": fused.rewritten, "left": list(fused.left)}
    causal = causal_forward(source)[1]
    if causal.causal or causal.left:
        attrs["causal_masks"] = {"recovered": causal.causal, "left": list(causal.left)}
    if causal.grouped_kv:
        attrs["grouped_kv"] = causal.grouped_kv
    return attrs


def _fuses_attention(source: TraceSource) -> bool:
    return source.kernels == "gpu" and source.attention == "fused"


def forward_module(source: TraceSource) -> fx.GraphModule:
    """The exported forward a trace of `source` runs, node for node: what a pass that
    plans per exported node (tensor parallelism) must read. Constant causal masks are
    given back to attention as `is_causal` (causal_mask.py), as eager runs it."""
    return causal_forward(source)[0]


def causal_forward(source: TraceSource) -> tuple[fx.GraphModule, Recovered]:
    """`recover_causal_masks` of the exported forward (a GPU trace's: with its attention
    fused first), then `group_repeated_kv` (attention without a mask takes its grouped
    k and v, as eager does), kept per graph: every re-trace of a trace (AMP, tensor
    parallelism) runs the same one."""
    exported = source.exported.graph_module
    gm = gpu_forward(exported)[0] if _fuses_attention(source) else exported
    if gm not in _CAUSAL_FORWARDS:
        recovered_gm, recovered = recover_causal_masks(gm, lifted_constants(source.exported))
        recovered_gm, recovered.grouped_kv = group_repeated_kv(recovered_gm)
        _CAUSAL_FORWARDS[gm] = recovered_gm, recovered
    return _CAUSAL_FORWARDS[gm]


class GpuKernels:
    """The ForwardHook that traces dropout as a GPU runs it, on CPU (or meta) tensors.

    A CPU has no fused kernel for either dropout a transformer draws, so its trace keeps
    more than a GPU step does:

    - `dropout(x, p, train)` on a CPU is `x * (empty_like(x).bernoulli_(1 - p) / (1 - p))`:
      its backward keeps that scaled mask in x's dtype (4 bytes an element in fp32). A
      GPU (`is_fused_kernel_acceptable`) runs `native_dropout`, whose mask is bool: 1 byte.
      The trace draws a bool mask the same way, `x * empty_like(x, bool).bernoulli_(1 -
      p) / (1 - p)`: its backward keeps the bool mask, and the fusion pass joins the draw
      and the product to the kernels around them as it does the CPU's, where a GPU
      compiler (or Megatron's fused kernels) would. A `native_dropout` in the exported
      graph (how export records `dropout` in some models) is traced the same way, its
      mask the bool one drawn.
    - `scaled_dot_product_attention(..., dropout_p > 0)`: the CPU's fused kernel has no
      dropout, so attention takes its math path, keeping the probabilities, their mask
      and the dropped probabilities, batch x heads x s x s each, in fp32. A GPU's flash
      or memory-efficient kernel draws the dropout inside (Philox) and keeps the output
      and one log-sum-exp per row. The trace takes the CPU's fused kernel with the
      dropout probability instead (a boolean mask made additive first, as the composite
      does): what the planner already costs as the fused attention of a step without
      dropout (its FLOPs, its saved values).

    With `fused=False` (DeviceSpec.attention "unfused": a cluster without fused attention
    kernels, as Megatron-LM's of 2021) sdpa is traced as matmul, softmax, dropout (a bool
    mask) and matmul in q's dtype: the scores and probabilities are materialised.

    Innermost of the hooks: AMP and tensor parallelism see the exported ops and their
    rules; this hook only chooses the kernel. A graph traced with it is for costing;
    the CPU's flash attention kernel refuses dropout_p > 0 if it is run."""

    def __init__(self, fused: bool = True):
        self.fused = fused

    def call_function(self, node: fx.Node, args: tuple, kwargs: dict,
                      run: Callable[[tuple, dict], Any]) -> Any:
        if node.target is _DROPOUT:
            x, p, train = _bound(_DROPOUT, args, kwargs)
            if train and 0 < p < 1 and x.is_floating_point() and x.numel() > 0:
                return _bool_mask_dropout(x, p)
        elif node.target is _NATIVE_DROPOUT:
            x, p, train = _bound(_NATIVE_DROPOUT, args, kwargs)
            if train is not False and 0 < p < 1 and x.is_floating_point() and x.numel() > 0:
                return _bool_mask_dropout(x, p, with_mask=True)
        elif node.target is _SDPA:
            q, k, v, mask, p, causal, scale, gqa = _bound(_SDPA, args, kwargs)
            if self.fused and p == 0:  # the CPU's kernel: the fused one, in the trace
                return run(args, kwargs)
            if gqa and k.shape[-3] != q.shape[-3]:
                groups = q.shape[-3] // k.shape[-3]
                k, v = (t.repeat_interleave(groups, -3) for t in (k, v))
            if not self.fused:
                return _unfused_attention(q, k, v, mask, p, causal, scale)
            if mask is not None and mask.dtype == torch.bool:  # as the composite does
                mask = torch.where(mask, torch.zeros((), dtype=q.dtype, device=q.device),
                                   torch.full((), -math.inf, dtype=q.dtype, device=q.device))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
                q, k, v, p, causal, attn_mask=mask, scale=scale)[0]
        return run(args, kwargs)


def _bool_mask_dropout(x: torch.Tensor, p: float, with_mask: bool = False):
    """x dropped with a bool mask drawn as a GPU draws it; (x dropped, the mask) with
    `with_mask`, as native_dropout returns them."""
    keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p)
    return (x * keep / (1 - p), keep) if with_mask else x * keep / (1 - p)


def _unfused_attention(q, k, v, mask, p: float, causal: bool, scale) -> torch.Tensor:
    """sdpa as a GPU without fused attention runs it: the scores and probabilities
    materialised in q's dtype (Megatron-LM's scale-mask-softmax kernel takes and gives
    half values)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
    elif mask is not None:
        scores = scores + mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1)
    if p > 0:
        probs = _bool_mask_dropout(probs, p)
    return probs @ v


_DROPOUT = torch.ops.aten.dropout.default
_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
GPU_KERNELS = GpuKernels()
GPU_KERNELS_UNFUSED = GpuKernels(fused=False)
_GPU_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CAUSAL_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gpu_forward(gm: fx.GraphModule) -> tuple[fx.GraphModule, Fused]:
    """The exported forward `gm` as a GPU trace runs it: attention written out op by op
    taken as one scaled_dot_product_attention (eager_attention.py), which GpuKernels
    then traces as the fused kernel. Kept per exported graph: every re-trace of a trace
    (AMP, tensor parallelism) runs the same one."""
    if gm not in _GPU_FORWARDS:
        _GPU_FORWARDS[gm] = fuse_eager_attention(gm)
    return _GPU_FORWARDS[gm]


class _HookedInterpreter(fx.Interpreter):
    """Runs the exported forward graph, passing every op through the forward hooks."""

    def __init__(self, gm: fx.GraphModule, hooks: tuple[ForwardHook, ...]):
        super().__init__(gm)
        self.hooks = hooks
        self.node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs):
        if target in METADATA_ASSERTS and _changed_by_hooks(self.node, args, kwargs):
            # NOTE: the assertion checks the metadata the value had when exported; a hook
            # changed that on purpose (AMP's dtype, tensor parallelism's local shape), so
            # the assertion no longer describes the value and goes (as the shape asserts
            # of the joint graph do, _drop_shape_asserts)
            return None
        def run(a, k, hooks=self.hooks):
            if not hooks:  # innermost: the op itself
                return super(_HookedInterpreter, self).call_function(target, a, k)
            return hooks[-1].call_function(self.node, a, k,
                                           lambda a2, k2: run(a2, k2, hooks[:-1]))
        return run(args, kwargs)


# ops that only check a value's traced metadata (dtype, shape, device, a size's range)
METADATA_ASSERTS = frozenset({
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten._assert_async.msg,
})


def _changed_by_hooks(node: fx.Node, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor argument of `node` differs in dtype, shape or device from the value
    the exported graph recorded for it (arguments paired by position in the flattened
    (args, kwargs), which the interpreter fills from the node's own)."""
    traced = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
    running = torch.utils._pytree.tree_leaves((args, kwargs))
    for arg, new in zip(traced, running):
        old = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and (
                old.dtype, tuple(old.shape), old.device.type) != (
                new.dtype, tuple(new.shape), new.device.type):
            return True
    return False


def _export(wrapper: torch.nn.Module, model: torch.nn.Module,
            example_inputs: tuple) -> torch.export.ExportedProgram:
    try:
        ep = torch.export.export(wrapper, example_inputs, strict=False)
        # export's training IR keeps in-place ops (BatchNorm's running stats); an empty
        # decomposition table only functionalises them into buffer-mutation outputs
        return ep.run_decompositions({}) if _mutates(ep.graph) else ep
    except (TraceError, BatchError):
        raise
    except Exception as exc:  # noqa: BLE001 - every export failure is re-raised with context
        raise TraceError(_explain_trace_failure(exc, model)) from exc


def _mutates(graph: fx.Graph) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in graph.nodes)


class _State(NamedTuple):
    """The exported program's state as the joint graph takes it."""

    state: dict[str, torch.Tensor]
    canonical: dict[str, str]  # canonical_state_names
    trainable: list[str]  # the step's parameters, in input order
    buffers: list[str]  # buffers and frozen parameters (no gradient, not optimised)
    mutated: list[tuple[str, int]]  # (buffer, output index) of each buffer the step writes


def _state_of(source: TraceSource) -> _State:
    ep = source.exported
    state = {**ep.state_dict, **ep.constants}
    canonical = canonical_state_names(ep)
    unique = list(dict.fromkeys(canonical.values()))
    trainable = [n for n in unique if isinstance(state[n], torch.nn.Parameter) and state[n].requires_grad]
    # frozen parameters travel with the buffers: no gradient, not optimised
    buffers = [n for n in unique if n not in trainable]
    mutated = [(spec.target, i) for i, spec in enumerate(ep.graph_signature.output_specs)
               if spec.kind == OutputKind.BUFFER_MUTATION]
    return _State(state, canonical, trainable, buffers, mutated)


def _extra_inputs(source: TraceSource) -> list[TensorSpec]:
    """The step's inputs after the batch: the loss scale with fp16 loss scaling."""
    return [TensorSpec(LOSS_SCALE_INPUT, (), torch.float32)] if source.loss_scale else []


def _signature(source: TraceSource, st: _State | None = None) -> GraphSignature:
    """The joint graph's signature: known from the source, without tracing."""
    st = _state_of(source) if st is None else st
    shards = dict(source.param_shards)
    user_inputs, extra = list(source.example_inputs), _extra_inputs(source)
    return GraphSignature(
        params=_specs(st.trainable, st.state, source.aliases, shards),
        buffers=_specs(st.buffers, st.state, source.aliases),
        inputs=tuple(TensorSpec(f"input_{i}", tuple(t.shape), t.dtype)
                     for i, t in enumerate(user_inputs)) + tuple(extra),
        mutated_buffers=tuple(strip_wrapper(name) for name, _ in st.mutated),
        batch_dims=batch_dims_of(user_inputs) + tuple(None for _ in extra),
    )


def _trace_joint(source: TraceSource) -> tuple[fx.GraphModule, GraphSignature]:
    ep, example_inputs = source.exported, source.example_inputs
    sig = ep.graph_signature
    st = _state_of(source)
    state, canonical, trainable, buffers = st.state, st.canonical, st.trainable, st.buffers
    user_inputs = list(example_inputs)  # all tensors (trace_train_step checked)
    mutated = st.mutated
    loss_index = next(i for i, spec in enumerate(sig.output_specs)
                      if spec.kind == OutputKind.USER_OUTPUT)
    placeholder_of = {s.target: i for i, s in enumerate(sig.input_specs) if s.target is not None}
    user_slots = [i for i, s in enumerate(sig.input_specs) if s.kind == InputKind.USER_INPUT]
    n_params, n_buffers = len(trainable), len(buffers)
    n_user = len(user_inputs)
    forward = forward_module(source)

    def joint_step(*flat):
        params, bufs, inputs = (flat[:n_params], flat[n_params:n_params + n_buffers],
                                flat[n_params + n_buffers:n_params + n_buffers + n_user])
        scale = flat[-1] if source.loss_scale else None
        args: list[Any] = [None] * len(sig.input_specs)
        value_of = dict(zip(trainable + buffers, params + bufs))
        for name, first in canonical.items():
            args[placeholder_of[name]] = value_of[first]
        for spec_index, spec in enumerate(sig.input_specs):
            if spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
                args[spec_index] = state[spec.target]
                if _on_meta(args[spec_index]):
                    args[spec_index] = torch.empty_strided(
                        args[spec_index].shape, args[spec_index].stride(),
                        dtype=args[spec_index].dtype, device="cpu")
        for slot, value in zip(user_slots, inputs):
            args[slot] = value
        with fx_traceback.preserve_node_meta():
            gpu = GPU_KERNELS if source.attention == "fused" else GPU_KERNELS_UNFUSED
            hooks = ((gpu,) if source.kernels == "gpu" else ()) + source.hooks
            outs = _HookedInterpreter(forward, hooks).run(*args)
            loss = outs[loss_index]
            if loss.grad_fn is not None:
                setup_stacktrace_preservation_hooks([loss.grad_fn])
            target = loss if scale is None else loss * scale
            grads = torch.autograd.grad(target, params, allow_unused=True) if params else ()
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        return (loss, *grads, *[outs[i] for _, i in mutated])

    # Our own fake mode: it lets the exported graph's tensor constants (real tensors, e.g.
    # Falcon's) meet the fake inputs; make_fx then keeps them as constants of the graph.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    shards = dict(source.param_shards)
    flat = ([_param_input(state[n], shards.get(n), fake_mode) for n in trainable]
            + [_fake(state[n].detach(), fake_mode) for n in buffers]
            + [_fake(x, fake_mode) for x in user_inputs])
    extra = _extra_inputs(source)
    if extra:
        flat.append(fake_mode.from_tensor(torch.ones((), dtype=torch.float32)))
    with fake_mode:
        try:
            # lazy: the graph's Python code is generated when it first runs or is read,
            # not at each edit below (the planner costs joint graphs it never runs)
            with _use_lazy_graph_module(True):
                gm = make_fx(joint_step, tracing_mode="real")(*flat)
        except (DataDependentOutputException, GuardOnDataDependentSymNode) as exc:
            # the forward exported, so what reads a tensor's value is a backward the
            # model registered itself (an autograd.Function's or a custom op's)
            raise TraceError(_explain_trace_failure(exc, None, "the backward of")) from exc
    gm.graph._codegen = fx.graph.CodeGen()  # plain flat-args signature, no pytree wrapping
    _drop_shape_asserts(gm)
    _name_placeholders(gm, trainable, buffers, len(user_inputs), [s.name for s in extra])
    signature = _signature(source, st)
    return gm, signature


def canonical_state_names(ep: torch.export.ExportedProgram) -> dict[str, str]:
    """Parameter/buffer name -> the name the joint graph takes it under. Export gives a
    tied weight one placeholder per name; the joint graph takes it once, so autograd
    sums the gradients of all its uses."""
    state = {**ep.state_dict, **ep.constants}
    specs = [s for s in ep.graph_signature.input_specs
             if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)]
    first_name: dict[int, str] = {}
    for spec in specs:
        first_name.setdefault(id(state[spec.target]), spec.target)
    return {s.target: first_name[id(state[s.target])] for s in specs}


def _meta_devices_to_cpu(gm: fx.GraphModule) -> None:
    """Ops of a graph exported from a meta-device model name the meta device (`x.to(
    device)`, factories like arange): they name the CPU instead, where its fake values
    live (`_fake`)."""
    meta = torch.device("meta")

    def cpu(value):
        if isinstance(value, torch.device) and value == meta:
            return torch.device("cpu")
        if isinstance(value, (list, tuple)):
            return type(value)(cpu(v) for v in value)
        return value
    for module in gm.modules():  # higher-order ops (set_grad_enabled regions) hold graphs too
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                node.args = tuple(cpu(a) for a in node.args)
                node.kwargs = {k: cpu(v) for k, v in node.kwargs.items()}
            module.recompile()


def _on_meta(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _fake(t: torch.Tensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    """The fake value of a state tensor or input. A meta tensor (a model built on the
    meta device for planning) becomes a fake CPU tensor, so the step traces to the graph
    the same model on the CPU gives: ops choose their kernels by device (attention on
    meta falls back to its math decomposition, upcasting half inputs to fp32)."""
    if not _on_meta(t):
        return fake_mode.from_tensor(t)
    with fake_mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _param_input(t: torch.Tensor, shard: tuple[int, int, int, int] | None,
                 fake_mode: FakeTensorMode) -> torch.Tensor:
    """The fake value a parameter enters the joint graph as: whole, or one block."""
    if shard is None:
        return _fake(t.detach(), fake_mode).requires_grad_(True)
    dim, parts = shard[0], shard[1]
    shape = list(t.shape)
    shape[dim] //= parts
    device = "cpu" if _on_meta(t) else t.device
    with fake_mode:
        return torch.empty(shape, dtype=t.dtype, device=device).requires_grad_(True)


def _drop_shape_asserts(gm: fx.GraphModule) -> None:
    """Export's run-time metadata asserts: shapes are static in a compiled program."""
    for node in list(gm.graph.nodes):
        name = getattr(node.target, "__name__", "")
        if node.op == "call_function" and name.startswith("_assert_") and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def strip_wrapper(name: str) -> str:
    """The model's own name ("x.w") of a wrapper name ("model.x.w")."""
    prefix = _WRAPPED + "."
    return name[len(prefix):] if name.startswith(prefix) else name


def _specs(names: list[str], state: dict[str, torch.Tensor],
           aliases: dict[str, tuple[str, ...]],
           shards: dict[str, tuple[int, int, int, int]] | None = None) -> tuple[TensorSpec, ...]:
    out = []
    for name in names:
        t = state[name]
        short = strip_wrapper(name)
        others = tuple(a for a in aliases.get(short, ()) if a != short)
        shape = list(t.shape)
        shard = (shards or {}).get(name)
        if shard is not None:
            shape[shard[0]] //= shard[1]
        out.append(TensorSpec(short, tuple(shape), t.dtype, others,
                              shard_dim=shard[0] if shard else None,
                              shard_pieces=shard[3] if shard else 1))
    return tuple(out)


def _alias_groups(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of each parameter/buffer that is reachable under several names."""
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    return {n: tuple(names) for names in by_id.values() for n in names}


def batch_dims_of(inputs: list[torch.Tensor]) -> tuple[int | None, ...]:
    """Dim 0 is the batch of every input whose dim 0 equals the first input's."""
    if not inputs or inputs[0].dim() == 0:
        return tuple(None for _ in inputs)
    batch = inputs[0].shape[0]
    return tuple(0 if t.dim() > 0 and t.shape[0] == batch else None for t in inputs)


def batch_size(inputs: Sequence[Any]) -> int | None:
    """The number of samples of a batch (the size of its tensors' batch dim,
    `batch_dims_of`), None where no tensor has one."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    return next((x.shape[d] for x, d in zip(tensors, batch_dims_of(tensors)) if d is not None),
                None)


def _name_placeholders(gm: fx.GraphModule, params: list[str], buffers: list[str],
                       n_inputs: int, extra: Sequence[str] = ()) -> None:
    names = ([_safe("p_" + strip_wrapper(n)) for n in params] + [_safe("b_" + strip_wrapper(n)) for n in buffers]
             + [f"input_{i}" for i in range(n_inputs)] + list(extra))
    for node, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        node.name = node.target = name  # FX keeps names unique; these already are
    gm.recompile()


def _safe(name: str) -> str:
    return re.sub(r"\W", "_", name)


# -- error messages for untraceable code ---------------------------------------------------

_HINTS = (  # (what the error's type or text holds, the hint)
    (("data-dependent", "DataDependentOutput"),
     "Python control flow on a tensor's value (`if x.sum() > 0`, `.item()`, `.tolist()`) "
     "cannot be traced: use torch.where / torch.cond, or compute it outside the model"),
    (("DynamicCache",), "the model returns a KV cache: build it with use_cache=False"),
    (("non-tensor",), "inputs and outputs must be tensors (or Hugging Face ModelOutputs)"),
)


def _explain_trace_failure(exc: BaseException, model: torch.nn.Module | None,
                           what: str = "") -> str:
    frame, module_path = _user_frame(exc, model or torch.nn.Module())
    where = ""
    if frame is not None:
        where = f" at {frame.filename}:{frame.lineno} in {frame.name}"
        if frame.line:
            where += f"\n    {frame.line.strip()}"
    owner = f"module `{module_path}`" if module_path else "the model"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = f"{type(exc).__name__}: {exc}".lower()
    hint = next((h for keys, h in _HINTS if any(k.lower() in text for k in keys)), None)
    message = f"cannot trace {what + ' ' if what else ''}{owner}{where}\n  " \
              f"{type(exc).__name__}: {first_line}"
    if hint:
        message += f"\n  hint: {hint}"
    return message


def _user_frame(exc: BaseException, model: torch.nn.Module):
    """The innermost frame outside torch, and the model path of the innermost module running."""
    path_of = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    user_frame, module_path = None, None
    for cause in _causes(exc):
        tb = cause.__traceback__
        summary = traceback.extract_tb(tb)
        frames = [f for f, _ in traceback.walk_tb(tb)]
        for frame, fs in zip(frames, summary):
            this = frame.f_locals.get("self")
            if this is not None and id(this) in path_of:
                module_path = path_of[id(this)]
            if not _is_library_file(fs.filename):
                user_frame = fs
    return user_frame, module_path


def _causes(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_library_file(filename: str) -> bool:
    library = ("/torch/", "/autopar/compiler/", "/contextlib.py", "/functools.py", "<")
    return any(part in filename for part in library)


def local_example(example_inputs: tuple, layout: Layout) -> tuple:
    """One micro-batch of one data-parallel rank: the shapes the graph is traced for."""
    dims = batch_dims_of([x for x in example_inputs if isinstance(x, torch.Tensor)])
    if not any(d is not None for d in dims):
        return example_inputs
    batch = next(x.shape[d] for x, d in zip(example_inputs, dims) if d is not None)
    layout.check_batch(batch)
    local = batch // (layout.dp * layout.microbatches)
    return tuple(x.narrow(d, 0, local) if d is not None else x
                 for x, d in zip(example_inputs, dims))
