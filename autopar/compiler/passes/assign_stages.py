"""AssignStages: cut the joint graph into pipeline stages (one `autopar.stage` per node).

Cut points fall between the model's repeated blocks (`autopar.layer`), chosen by
dynamic programming to minimise the slowest stage's estimated time (a roofline
of each node's FLOPs and bytes on the cluster's device); what comes before the
first block (embeddings, masks) joins the first stage, what follows the last (final
norm, head, loss) the last stage. Where a stage of that cut would hold more than the
memory budget (`PassOptions.memory_budget`, else the device's memory), the fastest cut
whose stages all fit is taken instead, and where none fits the one whose fullest stage
holds least (`CutMemory`: a stage's parameters with their gradients and optimizer
state, and the activations its forward keeps per micro-batch times the micro-batches
the schedule keeps in flight on it: under 1F1B pp on the first stage, one on the
last); not with virtual stages (a rank holds several stages).
Then each cut may move inside a block (`PassOptions.cut_inside_blocks`, on by default;
not with virtual stages): to where a direct child module of the block beside it starts
(the block before the cut when the stage before is the slower, else the block after),
where that makes the slowest stage faster, each stage's sends and receives of values
between stages counted; within the memory budget, the bytes of a
stage that starts or ends inside a block counted with the whole block. A block
recomputed in its backward is not cut.
`PassOptions.pipeline_cuts` pins the cuts by module
path: a named block starts a new stage, and so does a module inside a block
("transformer.h.2.mlp": the block's forward ops from the first one that runs in that
module on go to the next stage, as torch.distributed.pipelining's split points cut
at any module). Every other node follows the data:
a forward op runs on the latest stage among its inputs, an op fed only by
parameters and inputs on the earliest stage that uses it, and a backward op on the
stage of the forward op it differentiates (same autograd `seq_nr`).

Requires: "traced". Provides: "stages_assigned".

Before:                                  After (pp=2, 2 blocks):
    addmm = addmm(b, x, t(w))  @h.0          addmm = addmm(...)   # stage 0
    addmm_5 = addmm(...)       @h.1          addmm_5 = addmm(...) # stage 1
    mm_9 = mm(...)  (backward) @h.1          mm_9 = mm(...)       # stage 1
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from autopar.cluster import ClusterSpec, LinkSpec
from autopar.compiler.analysis.memory import OptimizerMemory, held_per_byte
from autopar.compiler.analysis.summary import node_time, summarize
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import tensor_bytes
from autopar.compiler.ir.graph import TrainGraph, param_layers
from autopar.compiler.ir.schedule import in_flight
from autopar.compiler.passes.base import GraphPass, PassContext, PassOptions, PassResult, writable
from autopar.compiler.passes.manager import register_pass
from autopar.costs import DEFAULT_EFFICIENCY, group_spans_nodes
from autopar.layout import Layout


class StageError(ValueError):
    """The model cannot be cut as asked; the message says what would work."""


def check_stage_count(layout: Layout, blocks: int) -> None:
    """Refuse more stages than the model has repeated blocks to cut between."""
    stages = layout.pp * layout.virtual_stages
    if stages > max(blocks, 1):
        raise StageError(
            f"{stages} pipeline stages (pp={layout.pp} x virtual_stages={layout.virtual_stages}) "
            f"but the model has {blocks} repeated blocks to cut between; use "
            f"pp*virtual_stages <= {max(blocks, 1)}")


# TrainGraph.attrs key: the CutWeights AssignStages cut the graph by (the planner's
# pipeline templates replicate a cut of the whole model from them)
CUT_WEIGHTS = "cut_weights"


@dataclass(frozen=True)
class CutMemory:
    """What each stage of a cut holds, as the cut weighs it. Per block: bytes held
    whatever the schedule (`fixed`: its parameters with their gradients and optimizer
    state) and bytes kept per micro-batch in flight (`saved`: what its forward keeps
    for its backward). The same for what comes before the stack (`head_*`, on the first
    stage) and after it (`tail_*`, on the last). `in_flight`: per stage, the most
    micro-batches it holds at once under the schedule (schedule.in_flight)."""

    fixed: tuple[float, ...]
    saved: tuple[float, ...]
    head_fixed: float
    head_saved: float
    tail_fixed: float
    tail_saved: float
    in_flight: tuple[int, ...]

    def stage_bytes(self, cuts: list[int]) -> list[float]:
        """Bytes of each stage of `cuts` (balanced_cuts' form), as the cut weighs them."""
        bounds = [0, *cuts, len(self.fixed)]
        out = []
        for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
            held = sum(self.fixed[a:b]) + self.in_flight[k] * sum(self.saved[a:b])
            if k == 0:
                held += self.head_fixed + self.in_flight[k] * self.head_saved
            if k == len(bounds) - 2:
                held += self.tail_fixed + self.in_flight[k] * self.tail_saved
            out.append(held)
        return out


def balanced_cuts(costs: list[float], parts: int, head: float = 0.0,
                  tail: float = 0.0, memory: CutMemory | None = None,
                  budget: float | None = None, time_cuts: list[int] | None = None
                  ) -> list[int]:
    """Start index of every part after the first, cutting `costs` (one per block) into
    `parts` contiguous parts that minimise the costliest part; `head` and `tail` are
    added to the first and the last part. Every part holds at least one block, except
    that the last may hold only a nonzero tail (a cut at len(costs)): an output head
    over a large vocabulary can outweigh several blocks.

    With `memory` and a `budget` (bytes per stage): where a part of that cut holds more
    than the budget, the least costly cut whose every part fits; where none fits, the
    cut whose fullest part holds least (of those, the least costly). `time_cuts`: the
    time-balanced cut, known already (balanced_cuts without `memory`)."""
    # the tail as a block of its own, which always falls in the last part
    ends = list(costs) + [tail] * (tail > 0)
    parts = min(parts, len(ends))
    cuts = time_cuts if time_cuts is not None else _balanced(ends, parts, head, 0.0)
    if memory is None or budget is None or parts < 2:
        return cuts
    if len(memory.fixed) != len(costs) or len(memory.saved) != len(costs) \
            or len(memory.in_flight) != parts:
        raise ValueError(f"CutMemory of {len(memory.fixed)} blocks and {len(memory.in_flight)} "
                         f"stages for {len(costs)} blocks cut into {parts} stages")
    fits = memory.stage_bytes(cuts)
    if max(fits) <= budget:
        return cuts
    if len(set(costs)) == 1 and len(set(memory.fixed)) == 1 and len(set(memory.saved)) == 1:
        return _fitting_uniform(len(costs), parts, costs[0], head, tail, memory, budget)
    return _fitting(cuts, ends, parts, head, tail > 0, memory, budget)


def _fitting_uniform(n: int, parts: int, block: float, head: float, tail: float,
                     memory: CutMemory, budget: float) -> list[int]:
    """balanced_cuts with `memory` and `budget` for n blocks that weigh alike (a stack of
    equal blocks: the planner's replicated pipelines, and a whole model of them, cut
    alike), by block counts: stage k's time and bytes grow with its count alone, so
    the least bound that some counts meet is found by binary search over the bounds a
    stage can have, each tried in O(parts log n); the counts are then filled one block
    at a time where the stage's time (then bytes) after it is least."""
    w = memory.in_flight
    per_block = [memory.fixed[0] + w[k] * memory.saved[0] for k in range(parts)]

    def time_of(k: int, c: int) -> float:
        return c * block + (head if k == 0 else 0.0) + (tail if k == parts - 1 else 0.0)

    def bytes_of(k: int, c: int) -> float:
        held = c * per_block[k]
        if k == 0:
            held += memory.head_fixed + w[0] * memory.head_saved
        if k == parts - 1:
            held += memory.tail_fixed + w[-1] * memory.tail_saved
        return held

    least = [1] * (parts - 1) + [0 if tail > 0 else 1]  # only a tail may stand alone

    def most(value, per: float, limit: float) -> int:
        """The largest count c <= n with value(c) = c * per + value(0) <= limit (-1: none),
        from the quotient, then checked on value itself as the caller computes it."""
        if value(0) > limit:
            return -1
        c = n if per <= 0 or limit == float("inf") else min(n, int((limit - value(0)) / per))
        while c < n and value(c + 1) <= limit:
            c += 1
        while c > 0 and value(c) > limit:
            c -= 1
        return c

    def caps(limit_s: float, limit_bytes: float) -> list[int] | None:
        out = []
        for k in range(parts):
            cap = min(most(lambda c: time_of(k, c), block, limit_s),
                      most(lambda c: bytes_of(k, c), per_block[k], limit_bytes))
            if cap < least[k]:
                return None
            out.append(cap)
        return out if sum(out) >= n else None

    def least_bound(values: list[float], fits) -> float | None:
        values = sorted(set(values))
        at = bisect.bisect_left(range(len(values)), True, key=lambda i: fits(values[i]))
        return values[at] if at < len(values) else None

    # a stage's time depends on whether it is the first, the last or one between
    times = [time_of(k, c) for k in {0, min(1, parts - 1), parts - 1} for c in range(n + 1)]
    limit_s = least_bound(times, lambda t: caps(t, budget) is not None)
    limit_bytes = budget
    if limit_s is None:  # nothing fits: the lightest, and of those the fastest
        inf = float("inf")
        limit_bytes = least_bound([bytes_of(k, c) for k in range(parts) for c in range(n + 1)],
                                  lambda m: caps(inf, m) is not None)
        limit_s = least_bound(times, lambda t: caps(t, limit_bytes) is not None)
    cap = caps(limit_s, limit_bytes)
    counts = list(least)
    for _ in range(n - sum(least)):
        k = min((k for k in range(parts) if counts[k] < cap[k]),
                key=lambda k: (time_of(k, counts[k] + 1), bytes_of(k, counts[k] + 1), -k))
        counts[k] += 1
    return list(itertools.accumulate(counts[:-1]))


def _fitting(cuts: list[int], ends: list[float], parts: int, head: float, tail_block: bool,
             memory: CutMemory, budget: float) -> list[int]:
    """balanced_cuts with `memory` and `budget` where the time-balanced `cuts` of `ends`
    (the blocks' costs, the tail's as a last block when `tail_block`) do not fit."""
    n = len(ends)
    w = memory.in_flight
    extra = ([memory.tail_fixed], [memory.tail_saved]) if tail_block else ([], [])
    seconds, fixed, saved = [0.0], [0.0], [0.0]
    for c, f, v in zip(ends, list(memory.fixed) + extra[0], list(memory.saved) + extra[1]):
        seconds.append(seconds[-1] + c)
        fixed.append(fixed[-1] + f)
        saved.append(saved[-1] + v)
    head_bytes = memory.head_fixed + w[0] * memory.head_saved
    tail_bytes = 0.0 if tail_block else memory.tail_fixed + w[-1] * memory.tail_saved

    def time_of(k: int, i: int, j: int) -> float:  # part k (1-based) holds ends[i:j]
        return seconds[j] - seconds[i] + (head if k == 1 else 0.0)

    def bytes_of(k: int, i: int, j: int) -> float:
        return (fixed[j] - fixed[i] + w[k - 1] * (saved[j] - saved[i])
                + (head_bytes if k == 1 else 0.0) + (tail_bytes if k == parts else 0.0))

    _, fastest = _least_max(n, parts, time_of, lambda k, i, j: bytes_of(k, i, j) <= budget)
    if fastest is not None:
        return fastest
    lightest, _ = _least_max(n, parts, bytes_of, lambda k, i, j: True)
    limit = lightest * (1 + 1e-9)
    _, fastest = _least_max(n, parts, time_of, lambda k, i, j: bytes_of(k, i, j) <= limit)
    return fastest if fastest is not None else cuts


def _least_max(n: int, parts: int, value: Callable[[int, int, int], float],
               fits: Callable[[int, int, int], bool]) -> tuple[float, list[int] | None]:
    """(the least max over parts of value(k, i, j), its cuts) over cuts of n items into
    `parts` nonempty contiguous parts where every part fits; (inf, None) if none does.
    Part k (1-based) holds items i..j-1; value and fits may depend on k, and as i rises
    (the part shrinks) value never rises and fits never turns false. So, as in
    `_balanced`, each (k, j) needs two binary searches: the first i that fits, and
    where the best of the parts before crosses this part's value."""
    inf = float("inf")
    best, choice = _tables(n, parts)
    for k in range(1, parts + 1):
        before = best[k - 1]
        for j in range(k, n - (parts - k) + 1):
            lo = bisect.bisect_left(range(k - 1, j), True,
                                    key=lambda i: fits(k, i, j)) + k - 1
            if lo >= j:
                continue
            cross = bisect.bisect_left(range(lo, j), True,
                                       key=lambda i: before[i] >= value(k, i, j)) + lo
            found, at = inf, 0
            if cross < j:
                found, at = max(before[cross], value(k, cross, j)), cross
            if cross > lo:
                below = max(before[cross - 1], value(k, cross - 1, j))
                if below <= found:
                    found, at = below, cross - 1
            best[k][j], choice[k][j] = found, at
    if best[parts][n] == inf:
        return inf, None
    return best[parts][n], _backtrack(choice, parts, n)


def _tables(n: int, parts: int) -> tuple[list[list[float]], list[list[int]]]:
    """The dynamic programs' tables over (parts, prefix): best[k][j], the least max of
    cutting the first j items into k parts (inf: not yet, or not at all), and where
    the last of those parts starts."""
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    return best, [[0] * (n + 1) for _ in range(parts + 1)]


def _backtrack(choice: list[list[int]], parts: int, n: int) -> list[int]:
    """The cuts of the best split of all n items into `parts`, from `_tables`' choices."""
    cuts, j = [], n
    for k in range(parts, 1, -1):
        j = choice[k][j]
        cuts.append(j)
    return sorted(cuts)


def _balanced(costs: list[float], parts: int, head: float, tail: float) -> list[int]:
    """The cuts of `balanced_cuts` (costs >= 0), by dynamic programming over (parts,
    prefix): best[k][j] is the least max cost of cutting costs[:j] into k parts. For
    each (k, j) the part before j starts after i, where best[k-1][i] rises and the part's
    cost falls with i, so their max is least where they cross: a binary search, not a
    scan of every i (O(parts n log n): the planner cuts 128 blocks for many depths).
    Ties go to the smallest i, as a scan would."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best, choice = _tables(n, parts)
    for k in range(1, parts + 1):
        before = best[k - 1]
        extra = (head if k == 1 else 0.0) + (tail if k == parts else 0.0)
        for j in range(k, n - (parts - k) + 1):
            def part(i: int, j: int = j) -> float:
                return prefix[j] - prefix[i] + extra
            # the first i in [k-1, j) where the parts before cost at least this one
            cross = bisect.bisect_left(range(k - 1, j), True,
                                       key=lambda i: before[i] >= part(i)) + k - 1
            value, at = inf, 0
            if cross < j:
                value, at = max(before[cross], part(cross)), cross
            if cross > k - 1 and part(cross - 1) <= value:
                # below the crossing this part's cost is the max: the first i where it is
                # already this low
                value = part(cross - 1)
                at = bisect.bisect_left(range(k - 1, cross - 1), True,
                                        key=lambda i: part(i) <= value) + k - 1
            if value < inf:
                best[k][j], choice[k][j] = value, at
    return _backtrack(choice, parts, n)


@dataclass(frozen=True)
class CutWeights:
    """What a stage-free joint graph weighs for a cut, per block (by M.LAYER) and before
    (`head`) and after (`tail`) the stack: seconds of its forward and backward ops
    (node_time), bytes of its parameters (`params`), and bytes its forward keeps for the
    backward per micro-batch (`saved`: storages a forward op makes that a backward op
    reads). A parameter read both before and after the stack (a tied embedding) weighs
    on both ends: each end stage holds it."""

    seconds: dict[int, float]
    params: dict[int, int]
    saved: dict[int, int]
    head_s: float = 0.0
    tail_s: float = 0.0
    head_params: int = 0
    tail_params: int = 0
    head_saved: int = 0
    tail_saved: int = 0

    def memory(self, layers: list[int], layout: Layout,
               optimizer: str | OptimizerMemory = "adamw") -> CutMemory:
        """The CutMemory of a cut of `layers` into `layout`'s pipeline stages."""
        held = held_per_byte(layout, optimizer)
        return CutMemory(tuple(held * self.params.get(b, 0) for b in layers),
                         tuple(float(self.saved.get(b, 0)) for b in layers),
                         held * self.head_params, float(self.head_saved),
                         held * self.tail_params, float(self.tail_saved),
                         in_flight(layout.schedule, layout.pp, layout.microbatches))


def stage_budget(cluster: ClusterSpec, options: PassOptions) -> float:
    """The bytes a pipeline stage's cut fits in: PassOptions.memory_budget, else the
    cluster's device memory."""
    budget = options.memory_budget
    return float(budget if budget is not None else cluster.device.memory_bytes)


def cut_weights(tg: TrainGraph, cluster: ClusterSpec) -> CutWeights:
    """The CutWeights of `tg`."""
    seconds: dict[int, float] = {}
    head_s = tail_s = 0.0
    part: dict[int, object] = {}  # summary index of a forward op -> its layer, "head", "tail"
    summary = summarize(tg)
    first = len(summary.ops) - len(tg.call_nodes())
    forward_seen = backward_seen = False  # a block's forward op, a block's backward op
    backward_layer: dict = {}  # a backward node -> the block it weighs on
    for k, n in enumerate(tg.call_nodes()):
        layer, time = n.meta.get(M.LAYER), node_time(n, cluster)
        backward = n.meta[M.ROLE] == M.Role.BACKWARD
        if layer is None and backward and n.meta.get("is_gradient_acc"):
            # autograd's sum of the gradient terms of a block's input (its residual and
            # its norm both read it) has no block; it runs with the block's backward
            # (_assign_backward puts it on the stage of its inputs), so it weighs there
            inputs = [backward_layer[a] for a in n.all_input_nodes if a in backward_layer]
            layer = min(inputs) if inputs else None
        if layer is not None and backward:
            backward_layer[n] = layer
        if layer is not None:
            seconds[layer] = seconds.get(layer, 0.0) + time
            forward_seen |= not backward
            backward_seen |= backward
            if not backward:
                part[first + k] = layer
        elif backward:
            # outside the blocks, the backward of the head and the loss runs before
            # the blocks' backward, on the last stage; the embeddings' after it, on
            # the first (a stage's time is its forward and backward: both weigh)
            if backward_seen:
                head_s += time
            else:
                tail_s += time
        elif forward_seen:
            tail_s += time
            part[first + k] = "tail"
        else:
            head_s += time
            part[first + k] = "head"
    saved: dict[object, int] = {}
    kept: set[int] = set()
    for op in summary.ops[first:]:
        if op.role != M.Role.BACKWARD.value:
            continue
        for u in op.uses:
            s = summary.ops[u].storage
            if s is not None and s in part and s not in kept:
                kept.add(s)
                saved[part[s]] = saved.get(part[s], 0) + summary.ops[s].allocates
    params: dict[object, int] = {}
    index = {n: first + k for k, n in enumerate(tg.call_nodes())}
    for node, layer, numel, itemsize in zip(tg.placeholders(), param_layers(tg),
                                            summary.param_numel, summary.param_itemsize):
        ends = {layer} if layer is not None else \
            {part.get(index[u]) for u in node.users if index.get(u) in part} & {"head", "tail"}
        for end in ends:
            params[end] = params.get(end, 0) + numel * itemsize
    return CutWeights(
        seconds,
        {b: v for b, v in params.items() if isinstance(b, int)},
        {b: v for b, v in saved.items() if isinstance(b, int)},
        head_s, tail_s, params.get("head", 0), params.get("tail", 0),
        saved.get("head", 0), saved.get("tail", 0))


def _link(layout: Layout, cluster: ClusterSpec) -> LinkSpec:
    """The link between neighbouring pipeline stages: the network once a pipeline group
    leaves the node."""
    spans = group_spans_nodes(layout.pp, layout.tp * layout.dp, cluster)
    return cluster.inter_node if spans else cluster.intra_node


def _bytes_bound(memory: CutMemory, at: list[tuple[int, int]]) -> list[float]:
    """Each stage's bytes for the cuts `at` ((block index, position in it)), as the cut
    weighs them: a stage that starts or ends inside a block counted with all of it (its
    bytes lie between those of the two block cuts around)."""
    floors = [c for c, _ in at]
    ceils = [c + (p > 0) for c, p in at]
    return [memory.stage_bytes(floors[:s] + ceils[s:])[s] for s in range(len(at) + 1)]


def _positions(tg: TrainGraph) -> dict:
    """Each forward op of a block -> its position among that block's forward ops, in the
    order they run."""
    seen: dict[int, int] = {}
    out = {}
    for n in tg.call_nodes():
        layer = n.meta.get(M.LAYER)
        if layer is not None and n.meta[M.ROLE] != M.Role.BACKWARD:
            out[n] = seen.get(layer, 0)
            seen[layer] = out[n] + 1
    return out


def _in_module(node, path: str) -> bool:
    """Whether `node` runs in the module at `path` or in one inside it."""
    where = node.meta.get(M.MODULE_PATH) or ""
    return where == path or where.startswith(path + ".")


def _modules(node, block: str) -> list[str]:
    """The modules inside `block` that `node` runs in, outermost first: the cut points
    a message can offer."""
    where = node.meta.get(M.MODULE_PATH) or ""
    if not where.startswith(block + "."):
        return []
    parts = where[len(block) + 1:].split(".")
    return [".".join([block, *parts[:k]]) for k in range(1, len(parts) + 1)]


@register_pass
class AssignStages(GraphPass):
    name = "assign_stages"
    requires = frozenset({"traced"})
    provides = frozenset({"stages_assigned"})
    # it also reads the cluster (each node's time, to balance the cuts; its device's
    # memory, the stages' budget) and PassOptions.pipeline_cuts, memory_budget and
    # optimizer_memory (the bytes a stage's parameters hold)
    layout_fields = frozenset({"pp", "virtual_stages", "microbatches", "schedule", "dp",
                               "zero"})

    def __init__(self, weigh_memory: bool = True) -> None:
        # False: cut on time alone, and read only the stage count (the planner's two-block
        # pipeline templates, whose cut PassOptions.pipeline_cuts pins anyway)
        self.weigh_memory = weigh_memory

    def reads(self, layout: Layout) -> tuple:
        """The number of stages, pp * virtual_stages, and what a stage's bytes are weighed
        by: the micro-batches each keeps in flight under the schedule and the bytes held
        per parameter byte (dp and ZeRO). How the stages map to ranks is the schedule's."""
        stages = (("stages", layout.pp * layout.virtual_stages),)
        if not self.weigh_memory or layout.virtual_stages != 1 or layout.pp == 1:
            return stages
        # held_per_byte's split of a pipeline's state: ZeRO-1 shards the optimizer state
        # over dp, ZeRO-2 and 3 also the gradients (a pipeline keeps its parameters)
        zero = min(layout.zero, 2)
        return stages + (("in_flight", in_flight(layout.schedule, layout.pp, layout.microbatches)),
                         ("zero_over_dp", (zero, layout.dp if zero else 1)))

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        stages = ctx.layout.pp * ctx.layout.virtual_stages
        tg = writable(tg, ctx)
        layers = sorted({n.meta[M.LAYER] for n in tg.call_nodes() if n.meta.get(M.LAYER) is not None})
        check_stage_count(ctx.layout, len(layers))
        cluster = ctx.cluster or ClusterSpec.local(1)  # without one: this machine's device
        # each block forward op's position in its block, each node's estimated seconds:
        # read by every cut tried
        position = _positions(tg)
        seconds = {n: node_time(n, cluster) for n in tg.call_nodes()}
        link = _link(ctx.layout, cluster)
        at, first, memory, weights = self._cut(tg, layers, stages, cluster, ctx, position,
                                               seconds, link)
        tg.attrs[CUT_WEIGHTS] = weights
        per_stage = self._assign(tg, at, layers, stages, position, seconds)
        sends = self._with_sends(tg, [0.0] * stages, link)
        # first_block_of_stage: the block a stage starts with; None for a stage of only
        # final norm, head and loss; a module path where it starts inside a block.
        # estimated_send_seconds: each stage's sends and receives of one micro-batch
        stats = {"stages": stages, "first_block_of_stage": first,
                 "estimated_stage_seconds": [round(t, 6) for t in per_stage],
                 "estimated_send_seconds": [round(t, 6) for t in sends]}
        if memory is not None:  # the stages' bytes as the cut weighed them, and the budget
            stats["weighed_stage_bytes"] = [round(b) for b in memory]
            stats["stage_budget_bytes"] = round(stage_budget(cluster, ctx.options))
        return tg, PassResult(self.name, changed=True, stats=stats)

    def _cut(self, tg, layers, stages, cluster, ctx, position, seconds, link):
        """(each cut as (block index, forward-op position in the block: 0 at its start),
        the first block of each stage after the first (a module path where it starts
        inside a block), the stages' bytes as weighed or None, the CutWeights)."""
        weights = cut_weights(tg, cluster)
        costs = [weights.seconds.get(layer, 0.0) for layer in layers]
        pinned = ctx.options.pipeline_cuts
        memory = None
        inside: dict[int, tuple[int, str]] = {}  # cut -> (position in its block, path)
        if pinned:
            cuts, inside = self._pinned(tg, layers, pinned, stages, position)
        elif stages > 1:
            if self.weigh_memory and ctx.layout.virtual_stages == 1:
                memory = weights.memory(layers, ctx.layout, ctx.options.optimizer_memory)
            cuts = balanced_cuts(costs, stages, weights.head_s, weights.tail_s, memory,
                                 stage_budget(cluster, ctx.options))
        else:
            cuts = []
        at = [(c, inside[k][0] if k in inside else 0) for k, c in enumerate(cuts)]
        if not pinned and cuts and ctx.options.cut_inside_blocks \
                and ctx.layout.virtual_stages == 1:
            at, paths = self._inside_blocks(tg, layers, at, stages, memory,
                                            stage_budget(cluster, ctx.options), link,
                                            position, seconds)
            inside = {k: (at[k][1], path) for k, path in paths.items()}
        # a cut after the last block: that stage holds only what follows the stack
        first = [inside[k][1] if k in inside else layers[c] if c < len(layers) else None
                 for k, (c, _) in enumerate(at)]
        return at, first, _bytes_bound(memory, at) if memory is not None else None, weights

    def _assign(self, tg: TrainGraph, at: list[tuple[int, int]], layers: list[int],
                stages: int, position: dict, seconds: dict) -> list[float]:
        """Give every node of `tg` its stage for the cuts `at` (any stage given before is
        dropped); each stage's estimated seconds (`seconds`: each node's)."""
        index = {layer: i for i, layer in enumerate(layers)}

        def base(node) -> int:
            """The stage a forward op of a block runs on at least: the cuts at or before it."""
            here = (index[node.meta[M.LAYER]], position[node])
            return sum(1 for cut in at if cut <= here)
        for n in tg.call_nodes():
            n.meta.pop(M.STAGE, None)
        self._assign_forward(tg, base, stages - 1)
        self._assign_backward(tg, stages)
        per_stage = [0.0] * stages
        for n in tg.call_nodes():
            per_stage[n.meta[M.STAGE]] += seconds[n]
        return per_stage

    def _inside_blocks(self, tg, layers, at, stages, memory, budget, link, position, seconds
                       ) -> tuple[list[tuple[int, int]], dict[int, str]]:
        """The block cuts `at` with each moved, where that makes the slowest stage faster,
        to the start of a module inside one of the two blocks beside it (the block before
        when the stage before the cut is the slower, else the block after), cuts taken in
        order: (the cuts, {cut: the module's path} for each moved). A module is a direct
        child of its block, where the block's first forward op run in it starts; a block
        recomputed in its backward is not cut (its recomputation would run on both
        stages). With `memory` (the cut weighs bytes), a move is taken only if every
        stage's bytes, bounded by the two block cuts around the new one, stay within
        `budget` (or within the block cut's fullest stage, where that exceeds it)."""
        blocks = tg.source.blocks if tg.source is not None else None
        if blocks is None:
            return at, {}
        recomputed = {n.meta.get(M.LAYER) for n in tg.call_nodes() if n.meta.get(M.RECOMPUTED)}
        starts: dict[int, dict[str, int]] = {}  # block index -> {child path: first position}
        index = {layer: i for i, layer in enumerate(layers)}
        for n, p in position.items():
            layer = n.meta[M.LAYER]
            child = _modules(n, f"{blocks[0]}.{layer}")[:1]
            if child and layer not in recomputed:
                starts.setdefault(index[layer], {}).setdefault(child[0], p)
        # a module where the block's first op runs starts the block: the block's own cut
        starts = {b: {path: p for path, p in firsts.items() if p > 0}
                  for b, firsts in starts.items()}
        if not any(starts.values()):
            return at, {}
        limit = None if memory is None else \
            max(budget, max(memory.stage_bytes([c for c, _ in at])))
        chosen, paths = list(at), {}
        per_stage = self._with_sends(tg, self._assign(tg, chosen, layers, stages, position,
                                                      seconds), link)
        for k in range(len(chosen)):
            c = chosen[k][0]
            block = c - 1 if per_stage[k] > per_stage[k + 1] else c
            below = chosen[k - 1] if k else (-1, 0)
            above = chosen[k + 1] if k + 1 < len(chosen) else (len(layers) + 1, 0)
            for path, p in starts.get(block, {}).items():
                trial = [*chosen[:k], (block, p), *chosen[k + 1:]]
                if not below < trial[k] < above:
                    continue
                if limit is not None and max(_bytes_bound(memory, trial)) > limit:
                    continue
                times = self._with_sends(tg, self._assign(tg, trial, layers, stages, position,
                                                          seconds), link)
                if max(times) < max(per_stage) * (1 - 1e-9):
                    chosen, per_stage, paths[k] = trial, times, path
        return chosen, paths

    @staticmethod
    def _with_sends(tg: TrainGraph, per_stage: list[float], link: LinkSpec) -> list[float]:
        """`per_stage` (seconds of each stage's ops) plus, on both stages of each value one
        stage sends another (an activation forward, its gradient back), its transfer over
        `link`: a cut inside a block sends more than the block's output (the residual
        and the module's input), which its more even stages must pay for."""
        out = list(per_stage)
        for n in tg.call_nodes():
            here = n.meta[M.STAGE]
            for there in {u.meta[M.STAGE] for u in n.users if M.STAGE in u.meta} - {here}:
                seconds = link.latency_s + tensor_bytes(n.meta.get(M.VAL)) \
                    / (link.bandwidth * DEFAULT_EFFICIENCY.link)
                out[here] += seconds
                out[there] += seconds
        return out

    @staticmethod
    def _pinned(tg, layers, pinned, stages, position: dict
                ) -> tuple[list[int], dict[int, tuple[int, str]]]:
        """Cut indices from module paths ("transformer.h.2": stage boundary before block 2;
        "transformer.h.2.mlp": inside block 2, before the first of its forward ops that
        runs in that module), with the position of each cut inside a block (k-th cut ->
        (its op's position among the block's forward ops, the path)); `position`: _positions(tg)."""
        blocks = tg.source.blocks if tg.source is not None else None
        if blocks is None:
            raise StageError("pipeline_cuts needs a model with a stack of repeated blocks")
        container, count = blocks
        known = [f"{container}.{i}" for i in range(count)]
        cuts, inside, order = [], {}, []
        for k, path in enumerate(pinned):
            block = next((b for b, name in enumerate(known) if path.startswith(name + ".")),
                         None)
            if path not in known and block is None:
                raise StageError(f"pipeline cut {path!r} is not a block of the model or a module "
                                 f"inside one; the blocks are {known[0]} ... {known[-1]}")
            if path in known:
                cuts.append(layers.index(known.index(path)))
                order.append((cuts[-1], 0))
                continue
            ops = [n for n in tg.call_nodes() if n.meta.get(M.LAYER) == block
                   and n.meta[M.ROLE] != M.Role.BACKWARD]
            runs = [n for n in ops if _in_module(n, path)]
            if not runs:
                named = sorted({m for n in ops for m in _modules(n, known[block])})
                raise StageError(f"pipeline cut {path!r} names no module that runs a forward op "
                                 f"in block {known[block]}; its modules that do are "
                                 f"{', '.join(named)}")
            if any(n.meta.get(M.RECOMPUTED) and n.meta.get(M.LAYER) == block
                   for n in tg.call_nodes()):
                after = f" or {known[block + 1]}" if block + 1 < count else ""
                raise StageError(
                    f"pipeline cut {path!r} is inside block {known[block]}, whose forward is "
                    f"recomputed in its backward (Layout.recompute): the recomputation would "
                    f"run on both stages; cut at a block ({known[block]}{after}) or use "
                    f"recompute='none'")
            cuts.append(layers.index(block))
            order.append((cuts[-1], position[runs[0]]))
            if order[-1][1] > 0:  # at the block's first op it is the block's own cut
                inside[k] = (order[-1][1], path)
        if len(cuts) != stages - 1 or sorted(set(order)) != order or (0, 0) in order:
            raise StageError(f"{stages} stages need {stages - 1} distinct cuts, in order, none at "
                             f"the first block; got {list(pinned)}")
        return cuts, inside

    @staticmethod
    def _assign_forward(tg: TrainGraph, base: Callable[[object], int], last: int) -> None:
        forward = [n for n in tg.call_nodes() if n.meta[M.ROLE] != M.Role.BACKWARD]
        in_stack = [i for i, n in enumerate(forward) if n.meta.get(M.LAYER) is not None]
        after_stack = in_stack[-1] if in_stack else len(forward)
        deferred = []
        for i, n in enumerate(forward):
            inputs = [a.meta[M.STAGE] for a in n.all_input_nodes if M.STAGE in a.meta]
            layer = n.meta.get(M.LAYER)
            if layer is not None:
                n.meta[M.STAGE] = max([base(n)] + inputs)
            elif inputs and i > after_stack:  # final norm, head, loss: the last stage's
                n.meta[M.STAGE] = max(inputs + [last])
            elif inputs:
                n.meta[M.STAGE] = max(inputs)
            else:  # fed only by parameters and inputs: decided by its users below
                deferred.append(n)
        for n in reversed(deferred):  # the earliest stage that uses it
            users = [u.meta[M.STAGE] for u in n.users if M.STAGE in u.meta]
            if users:
                n.meta[M.STAGE] = min(users)
        for n in deferred:  # used by backward ops only (saved statistics): with its inputs
            if M.STAGE not in n.meta:
                inputs = [a.meta[M.STAGE] for a in n.all_input_nodes if M.STAGE in a.meta]
                n.meta[M.STAGE] = max(inputs, default=0)
        for n in forward:  # a deferred input now known may raise a node's stage
            n.meta[M.STAGE] = max([n.meta[M.STAGE]] + [a.meta[M.STAGE] for a in n.all_input_nodes
                                                   if M.STAGE in a.meta])

    @staticmethod
    def _assign_backward(tg: TrainGraph, stages: int) -> None:
        # NOTE: ops that create no autograd node keep the seq_nr of the last one that did,
        # so the op a backward node differentiates is the first forward op of its seq_nr.
        by_seq: dict[int, int] = {}
        for n in tg.call_nodes():
            if n.meta[M.ROLE] != M.Role.BACKWARD and "seq_nr" in n.meta:
                by_seq.setdefault(n.meta["seq_nr"], n.meta[M.STAGE])
        for n in tg.call_nodes():
            if n.meta[M.ROLE] not in (M.Role.BACKWARD, M.Role.COMM) or M.STAGE in n.meta:
                continue
            if n.meta.get("seq_nr") in by_seq and not n.meta.get("is_gradient_acc"):
                n.meta[M.STAGE] = by_seq[n.meta["seq_nr"]]
            else:  # accumulation and seeds: where their latest backward input is
                inputs = [a.meta[M.STAGE] for a in n.all_input_nodes if M.STAGE in a.meta
                          and a.meta[M.ROLE] == M.Role.BACKWARD]
                n.meta[M.STAGE] = min(inputs) if inputs else stages - 1
