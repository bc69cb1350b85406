"""TensorParallel: split the step's tensors over the `tp` ranks by sharding propagation.

A forward-level pass, like AMP:

1. Every op of the exported forward graph gets its valid strategies on tp ranks
   (tp_rules.py: which placement, replicated / split on a dim / partial sum, each
   tensor input needs and what the output then is); parameters may be replicated or
   split on any dim that divides.
2. An integer program (tp_solver.py, HiGHS) picks one strategy per op at the least
   predicted step time: compute split over ranks, against the collectives the
   placements force, and the optimizer work saved on split weights. On transformer
   blocks it finds Megatron's layout by itself (column- then row-parallel linears,
   attention split by heads, vocabulary-parallel embedding and loss).
3. The step is re-traced (`retrace`) with split parameters entering as their local
   blocks and a ForwardHook that runs each op on local shards: it converts each
   input to the placement the op's strategy needs (tp_comm.py: functional
   collectives wrapped in autograd functions), rewrites view shapes to local
   shapes, and runs the few ops whose local form differs (vocabulary-parallel
   embedding and cross-entropy, a row-parallel bias added on one rank). Autograd
   then derives the backward with the matching collectives.

Each rank's program bakes in its own tp rank (which block it holds); the
collectives are the same on every rank.

Requires: "traced", "retraceable". Provides: "tensor_parallel".
Options (PassOptions): tp_rank, which rank's blocks the program holds (default 0).

Before (tp=1), an MLP block:             After (tp=2, rank 0; printing.py's text):
    t = t(p_fc1_weight)                       t = t(p_fc1_weight)            # f32[16, 32]: a block
    addmm = addmm(p_fc1_bias, x, t)           addmm = addmm(p_fc1_bias, x, t) # f32[8, 16]
    relu = relu(addmm)                        relu = relu(addmm)
    mm = mm(relu, t_1)                        mm = mm(relu, t_1)              # partial sum
                                              all_reduce = all_reduce(mm, sum, autopar.mesh.tp)
    (backward: one all_reduce of the block's input gradient, Megatron's "f")
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from autopar.compiler.ir.annotate import module_of, tensor_bytes
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.program import mesh_group_tag
from autopar.compiler.ir.trace import (
    canonical_state_names,
    forward_module,
    retrace,
    strip_wrapper,
)
from autopar.compiler.passes import tp_comm
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.manager import register_pass
from autopar.compiler.passes.tp_rules import (
    SHAPE_ARG_VIEWS,
    Placement,
    R,
    Strategy,
    Strided,
    is_tensor_node,
    local_slice_args,
    piece_slice,
    pieces_of,
    show,
    split_dim,
    split_pieces,
)
from autopar.compiler.passes.tp_solver import TPCosts, TPPlan, solve

aten = torch.ops.aten


def local_shape(shape, placement: Placement, tp: int) -> list[int]:
    out = list(shape)
    d = split_dim(placement)
    if d is not None:
        out[d] //= tp
    return out


def local_split_args(node: fx.Node, args: tuple, placement: Placement, tp: int) -> tuple:
    """A split of a Strided dim into its pieces, rewritten for the local block: each
    piece's size over tp (chunk counts pieces, and runs as it is); a slice of one piece,
    its bounds over tp."""
    if not isinstance(placement, Strided):
        return args
    if piece_slice(node) is not None:
        return local_slice_args(node, args, tp)
    if split_pieces(node) is None:
        return args
    if node.target == aten.split.Tensor:
        return (args[0], args[1] // tp) + tuple(args[2:])
    if node.target == aten.split_with_sizes.default:
        return (args[0], [s // tp for s in args[1]]) + tuple(args[2:])
    return args


def local_view_args(node: fx.Node, args: tuple, placement: Placement, tp: int) -> tuple:
    """The arguments of a view that names output sizes, rewritten for the local block: the
    shape of view/reshape/expand, the sizes of unflatten. Views that name only dims
    (flatten, squeeze, permute, ...) run on the block as they are."""
    if node.target in SHAPE_ARG_VIEWS:
        return (args[0], local_shape(node.meta["val"].shape, placement, tp)) + tuple(args[2:])
    if node.target == aten.unflatten.int:
        dim = args[1] % node.args[0].meta["val"].dim()
        local = local_shape(node.meta["val"].shape, placement, tp)
        return (args[0], args[1], local[dim:dim + len(args[2])]) + tuple(args[3:])
    return args


class TensorParallelHook:
    """The ForwardHook that runs each exported op on this rank's shards by the plan."""

    def __init__(self, plan: TPPlan, group: tp_comm.TPGroup):
        self.plan = plan
        self.group = group
        self._converted: WeakIdKeyDictionary = WeakIdKeyDictionary()  # value -> {key: tensor}

    def call_function(self, node: fx.Node, args: tuple, kwargs: dict, run) -> Any:
        strategy = self.plan.choice.get(node.name)
        if strategy is None:  # getitem: indexes its producer's (local) outputs
            return run(args, kwargs)
        flat, spec = tree_flatten((args, kwargs))
        slot = 0
        for i, arg in enumerate(tree_flatten((node.args, node.kwargs))[0]):
            if is_tensor_node(arg):
                flat[i] = self.convert(flat[i], self.plan.placement[arg.name],
                                       strategy.inputs[slot],
                                       strategy.inputs[slot] == R and strategy.splits_work)
                slot += 1
        args, kwargs = tree_unflatten(flat, spec)
        args = local_view_args(node, args, strategy.output, self.group.size)
        if strategy.inputs:
            args = local_split_args(node, args, strategy.inputs[0], self.group.size)
        if strategy.lowering:
            return _LOWERINGS[strategy.lowering](self, node, args, kwargs, run)
        return run(args, kwargs)

    def convert(self, x: torch.Tensor, have: Placement, want: Placement,
                split_consumer: bool) -> torch.Tensor:
        """x moved from placement `have` to `want`, once per (value, placement)."""
        wrap = split_consumer and x.requires_grad
        if have == want and not wrap:
            return x
        done = self._converted.setdefault(x, {})
        key = (want, wrap)
        if key not in done:
            done[key] = tp_comm.redistribute(x, have, want, self.group, split_work=wrap)
        return done[key]


# -- ops whose local form is not the op on local shards --------------------------------------

def _arg(node: fx.Node, args: tuple, kwargs: dict, index: int, name: str, default):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _bias_on_rank0(hook: TensorParallelHook, node, args, kwargs, run):
    """A contracted (row-parallel) matmul gives partial sums: the bias joins one of them."""
    args = list(args)
    index = 2 if node.target == aten.linear.default else 0
    keep = 1.0 if hook.group.rank == 0 else 0.0
    args[index] = args[index] * keep  # NOTE: multiplied, not dropped: every rank's backward
    return run(tuple(args), kwargs)   # then reaches the bias's gradient all-reduce


def _reduce_then_bias(hook: TensorParallelHook, node, args, kwargs, run):
    """A contracted (row-parallel) matmul: all-reduce the partial sums, then add the bias."""
    if node.target == aten.linear.default:
        x, weight, bias = args
        partial = run((x, weight, None), kwargs)
    else:  # addmm(bias, x, weight)
        bias, x, weight = args
        partial = torch.mm(x, weight)
    return tp_comm.sum_partials(partial, hook.group) + bias


def _vocab_parallel_embedding(hook: TensorParallelHook, node, args, kwargs, run):
    """Rows this rank holds are looked up, others give zeros: a partial sum over ranks."""
    weight, ids = args[0], args[1]
    rows = weight.shape[0]
    first = hook.group.rank * rows
    mine = (ids >= first) & (ids < first + rows)
    local_ids = torch.where(mine, ids - first, torch.zeros_like(ids))
    padding = _arg(node, args, kwargs, 2, "padding_idx", -1)
    padding = padding - first if padding is not None and first <= padding < first + rows else -1
    out = run((weight, local_ids, padding) + tuple(args[3:]), {})
    return out * mine.unsqueeze(-1).to(out.dtype)


def _vocab_parallel_cross_entropy(hook: TensorParallelHook, node, args, kwargs, run):
    """Cross-entropy over classes split across ranks, without gathering the logits: the
    row maximum, the sum of exponentials and the target's logit are combined across
    ranks (log-sum-exp minus the target logit)."""
    logits, target = args[0], args[1]
    reduction = _arg(node, args, kwargs, 3, "reduction", 1)
    ignore_index = _arg(node, args, kwargs, 4, "ignore_index", -100)
    group = hook.group
    classes = logits.shape[1]
    first = group.rank * classes
    with torch.no_grad():  # any common shift gives the same loss; the max keeps exp in range
        shift = tp_comm.all_reduce(logits.detach().amax(dim=1), group, op="max")
    shifted = logits - shift.unsqueeze(1)
    mine = (target >= first) & (target < first + classes)
    local_target = torch.where(mine, target - first, torch.zeros_like(target))
    picked = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1) * mine
    summed = tp_comm.sum_partials(torch.stack([shifted.exp().sum(dim=1), picked]), group)
    valid = target != ignore_index
    loss = torch.where(valid, summed[0].log() - summed[1], torch.zeros_like(summed[1]))
    if reduction == 0:
        return loss
    if reduction == 2:
        return loss.sum()
    return loss.sum() / valid.sum()


def _mean_over_shards(hook: TensorParallelHook, node, args, kwargs, run):
    """A mean over a split dim: each rank's mean of its block, over tp, sums to it."""
    return run(args, kwargs) / hook.group.size


_LOWERINGS = {
    "bias_on_rank0": _bias_on_rank0,
    "reduce_then_bias": _reduce_then_bias,
    "vocab_parallel_embedding": _vocab_parallel_embedding,
    "vocab_parallel_cross_entropy": _vocab_parallel_cross_entropy,
    "mean_over_shards": _mean_over_shards,
}


# -- the pass -----------------------------------------------------------------------------

@register_pass
class TensorParallel(GraphPass):
    name = "tensor_parallel"
    requires = frozenset({"traced", "retraceable"})
    provides = frozenset({"tensor_parallel"})
    invalidates = frozenset()  # a forward-level rewrite: the graph stays retraceable
    # reads tg.source and, of tg.signature, the parameters' names and the batch dims, which
    # a re-trace left pending does not change: that re-trace can wait
    retraces_from_source = True
    forward_level = True
    # it also reads the cluster: the placements are costed on its devices (without one,
    # on ClusterSpec.local(world_size))
    layout_fields = frozenset({"tp", "sequence_parallel"})

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        tp = ctx.layout.tp
        if tp == 1:
            return tg, PassResult(self.name, changed=False,
                                  declined=[("tensor parallelism", "Layout.tp=1")])
        plan, exported = plan_tensor_parallel(tg, tp, ctx.cluster, ctx.layout.world_size,
                                              sequence_parallel=ctx.layout.sequence_parallel)
        rank = ctx.options.tp_rank
        hook = TensorParallelHook(plan, tp_comm.TPGroup(mesh_group_tag("tp"), tp, rank))
        shards = {target: (split_dim(p), tp, rank, pieces_of(p))
                  for name, target in exported.items()
                  if split_dim(p := plan.placement[name]) is not None}
        # NOTE: the result is the plan's, not the trace's: when AMP follows, its re-trace
        # runs this hook too, and this one is left to it
        out = retrace(tg, hook, param_shards=shards, deferred=ctx.may_defer_retrace)
        table = placement_table(forward_module(tg.source).graph, plan, exported)
        out.attrs["tp"] = {"tp": tp, "rank": rank, "cost_s": plan.cost_s,
                           "replicated_cost_s": plan.replicated_cost_s, **table}
        stats = Counter(show(p) for p in table["params"].values())
        declined = [(f"split of {name}", why) for name, why in table["replicated_why"].items()]
        declined += whole_attention(forward_module(tg.source).graph, plan, tp)
        return out, PassResult(self.name, changed=True,
                               stats={"params": dict(stats),
                                      "predicted_speedup": round(
                                          plan.replicated_cost_s / max(plan.cost_s, 1e-12), 3)},
                               declined=declined)


_ATTENTION = (torch.ops.aten.scaled_dot_product_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


def whole_attention(graph: fx.Graph, plan: TPPlan, tp: int) -> list[tuple[str, str]]:
    """(attention op, why) for each attention the plan runs whole on every rank (q, k and
    v gathered): said in the pass result, never silently. Heads that do not divide by
    tp are the usual reason; else the solver found the split costlier."""
    out = []
    for node in graph.nodes:
        strategy = plan.choice.get(node.name)
        if node.target not in _ATTENTION or strategy is None or \
                any(p != R for p in strategy.inputs[:3]):
            continue
        heads = [a.meta["val"].shape[1] for a in node.args[:2]
                 if isinstance(a, fx.Node) and a.meta["val"].dim() == 4]
        odd = [h for h in heads if h % tp]
        why = (f"{'/'.join(map(str, heads))} heads (q/k) do not split over tp={tp}" if odd
               else "splitting it by heads was costed higher")
        out.append((f"attention {node.name} at {module_of(node)[0] or 'the model'}",
                    f"{why}: it runs whole on every rank, q, k and v gathered"))
    return out


def plan_tensor_parallel(tg: TrainGraph, tp: int, cluster: Any, world_size: int,
                         param_budget: bool = True, sequence_parallel: bool = False,
                         ) -> tuple[TPPlan, dict[str, str]]:
    """The solver's plan for tg's exported forward, and the trainable parameters'
    placeholders -> exported names (the keys TraceSource.param_shards takes).
    `param_budget=False` drops the limit on each rank's parameter bytes."""
    from autopar.cluster import ClusterSpec

    if tg.source is None:
        raise ValueError("tensor parallelism needs a graph straight from trace_train_step")
    ep = tg.source.exported
    graph = forward_module(tg.source).graph
    canonical = canonical_state_names(ep)
    trainable = {p.name for p in tg.signature.params}
    params: dict[str, str] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.PARAMETER and strip_wrapper(canonical[spec.target]) in trainable:
            params[spec.arg.name] = canonical[spec.target]
    options: dict[str, list[Placement]] = {}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    for name in params:
        val = placeholders[name].meta["val"]
        options[name] = [R] + [d for d in range(val.dim()) if val.shape[d] % tp == 0]
    tied: dict[str, list[str]] = {}
    for name, target in params.items():
        tied.setdefault(target, []).append(name)
    cluster = cluster if cluster is not None else ClusterSpec.local(world_size)
    inputs = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    ndims = {n: placeholders[n].meta["val"].dim() for n in inputs}
    unsplit = unsplit_dims(ndims, tg.signature.batch_dims, sequence_parallel)
    split = {n: set(range(d)) - unsplit[n] for n, d in ndims.items()}
    groups = [g for g in tied.values() if len(g) > 1]
    budget = budget_bytes(placeholders, options, groups, tp) if param_budget else None
    plan = solve(graph, tp, TPCosts(cluster, tp), options, groups, unsplit, budget, split)
    return plan, params


def unsplit_dims(ndims: dict[str, int], batch_dims: tuple[int | None, ...],
                 sequence_parallel: bool) -> dict[str, set[int]]:
    """User input -> the dims tp must not split in anything derived from them.

    Without sequence parallelism: every dim of an input (batch and sequence: what the
    activations index samples and tokens by). Splitting those is data parallelism in
    disguise and would leave every weight whole; it is the dp dimension's job. With
    sequence parallelism only the batch dim: the other dims (the sequence) are split
    wherever an op can run so (norms, dropout, residual adds between the matmuls; not
    attention or matmuls, which take their input gathered), with all-gather /
    reduce-scatter at the edges of those regions instead of all-reduce. It trades
    collectives for activation memory, which the solver's time objective does not
    price, so it is the user's choice, not the solver's."""
    out = {}
    for (name, ndim), batch in zip(ndims.items(), batch_dims):
        out[name] = {batch} if sequence_parallel and batch is not None else set(range(ndim))
    return out


# NOTE: the share of the parameters a rank may keep whole beyond the splittable ones'
# 1/tp: room for norm weights and biases, whose split would cost more than it saves
REPLICATED_ALLOWANCE = 0.05


def budget_bytes(placeholders: dict[str, fx.Node], options: dict[str, list[Placement]],
                 tied: list[list[str]], tp: int) -> float:
    """Bytes of parameters one rank may hold: 1/tp of those that can be split, all of
    those that cannot, and REPLICATED_ALLOWANCE of the total. Tensor parallelism is
    asked for to shrink each rank's weights; the solver chooses how, not whether."""
    repeats = {name for group in tied for name in group[1:]}
    total = splittable = 0.0
    for name, places in options.items():
        if name in repeats:
            continue
        nbytes = tensor_bytes(placeholders[name].meta["val"])
        total += nbytes
        splittable += nbytes if len(places) > 1 else 0
    return splittable / tp + (total - splittable) + REPLICATED_ALLOWANCE * total


def placement_table(graph: fx.Graph, plan: TPPlan, params_of: dict[str, str]) -> dict[str, Any]:
    """JSON-able: parameter (the model's own name) -> placement, one row per op with its
    module and strategy, and why parameters that could not be split stayed whole.
    `params_of`: placeholder -> exported parameter name."""
    params, why = {}, {}
    rows = []
    for node in graph.nodes:
        if node.op == "placeholder" and node.name in params_of:
            name = strip_wrapper(params_of[node.name])
            p = plan.placement[node.name]
            params[name] = show(p) if isinstance(p, Strided) else p  # (JSON-able)
            if plan.options.get(node.name, 1) == 1:
                why[name] = (f"no dim of {list(node.meta['val'].shape)} divides by "
                             f"tp={plan.tp}: kept whole (replicated)")
        elif node.op == "call_function" and node.name in plan.choice:
            s: Strategy = plan.choice[node.name]
            rows.append({"node": node.name, "op": str(node.target),
                         "module": module_of(node)[0], "strategy": s.describe()})
    return {"params": params, "ops": rows, "replicated_why": why}


def format_placements(table: dict[str, Any]) -> str:
    """The placement table as text: one line per parameter, then per op."""
    lines = ["parameter placements (R: replicated, S(d): split on dim d, S(d)xk: each of its "
             "k pieces split on dim d):"]
    lines += [f"  {name:<60} {show(p)}" for name, p in table["params"].items()]
    lines.append("op strategies (inputs -> output):")
    lines += [f"  {r['node']:<28} {r['op']:<36} {r['module'] or '':<32} {r['strategy']}"
              for r in table["ops"]]
    return "\n".join(lines)
