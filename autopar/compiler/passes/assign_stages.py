"""AssignStages: cut the joint graph into pipeline stages (one `autopar.stage` per node).

Cut points fall between the model's repeated blocks (`autopar.layer`), chosen by
dynamic programming to minimise the slowest stage's estimated time (a roofline
of each node's FLOPs and bytes on the cluster's device); what comes before the
first block (embeddings, masks) joins the first stage, what follows the last (final
norm, head, loss) the last stage. `PassOptions.pipeline_cuts` pins the cuts by module
path: the named blocks start a new stage. Every other node follows the data:
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

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.summary import node_time
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.manager import register_pass
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


def balanced_cuts(costs: list[float], parts: int, head: float = 0.0,
                  tail: float = 0.0) -> list[int]:
    """Start index of every part after the first, cutting `costs` (one per block) into
    `parts` contiguous parts that minimise the costliest part; `head` and `tail` are
    added to the first and the last part. Every part holds at least one block, except
    that the last may hold only a nonzero tail (a cut at len(costs)): an output head
    over a large vocabulary can outweigh several blocks."""
    # the tail as a block of its own, which always falls in the last part
    ends = list(costs) + [tail] * (tail > 0)
    return _balanced(ends, min(parts, len(ends)), head, 0.0)


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
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
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
    cuts, j = [], n
    for k in range(parts, 1, -1):
        j = choice[k][j]
        cuts.append(j)
    return sorted(cuts)


@register_pass
class AssignStages(GraphPass):
    name = "assign_stages"
    requires = frozenset({"traced"})
    provides = frozenset({"stages_assigned"})
    # it also reads the cluster (each node's time, to balance the cuts) and
    # PassOptions.pipeline_cuts
    layout_fields = frozenset({"pp", "virtual_stages"})

    def reads(self, layout: Layout) -> tuple:
        """The number of stages, pp * virtual_stages: how they map to ranks is the
        schedule's, not the graph's."""
        return (("stages", layout.pp * layout.virtual_stages),)

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        stages = ctx.layout.pp * ctx.layout.virtual_stages
        tg = tg.copy()
        layers = sorted({n.meta[M.LAYER] for n in tg.call_nodes() if n.meta.get(M.LAYER) is not None})
        check_stage_count(ctx.layout, len(layers))
        cluster = ctx.cluster or ClusterSpec.local(1)  # without one: this machine's device
        stage_of_layer, cuts, costs = self._cut(tg, layers, stages, cluster, ctx.options)
        self._assign_forward(tg, stage_of_layer, stages - 1)
        self._assign_backward(tg, stages)
        per_stage = [0.0] * stages
        for n in tg.call_nodes():
            per_stage[n.meta[M.STAGE]] += node_time(n, cluster)
        # first_block_of_stage: None for a stage of only final norm, head and loss
        stats = {"stages": stages, "first_block_of_stage": cuts,
                 "estimated_stage_seconds": [round(t, 6) for t in per_stage]}
        return tg, PassResult(self.name, changed=True, stats=stats)

    def _cut(self, tg, layers, stages, cluster, options):
        by_layer = {layer: 0.0 for layer in layers}
        head = tail = 0.0
        forward_seen = backward_seen = False  # a block's forward op, a block's backward op
        for n in tg.call_nodes():
            layer, seconds = n.meta.get(M.LAYER), node_time(n, cluster)
            backward = n.meta[M.ROLE] == M.Role.BACKWARD
            if layer is not None:
                by_layer[layer] += seconds
                forward_seen |= not backward
                backward_seen |= backward
            elif backward:
                # outside the blocks, the backward of the head and the loss runs before
                # the blocks' backward, on the last stage; the embeddings' after it, on
                # the first (a stage's time is its forward and backward: both weigh)
                if backward_seen:
                    head += seconds
                else:
                    tail += seconds
            elif forward_seen:
                tail += seconds
            else:
                head += seconds
        costs = [by_layer[layer] for layer in layers]
        pinned = options.pipeline_cuts
        if pinned:
            cuts = self._pinned(tg, layers, pinned, stages)
        else:
            cuts = balanced_cuts(costs, stages, head, tail) if stages > 1 else []
        stage_of_layer = {}
        for index, layer in enumerate(layers):
            stage_of_layer[layer] = sum(1 for c in cuts if index >= c)
        # a cut after the last block: that stage holds only what follows the stack
        return stage_of_layer, [layers[c] if c < len(layers) else None for c in cuts], costs

    @staticmethod
    def _pinned(tg, layers, pinned, stages) -> list[int]:
        """Cut indices from block paths ("transformer.h.2": stage boundary before block 2)."""
        blocks = tg.source.blocks if tg.source is not None else None
        if blocks is None:
            raise StageError("pipeline_cuts needs a model with a stack of repeated blocks")
        container, count = blocks
        known = [f"{container}.{i}" for i in range(count)]
        cuts = []
        for path in pinned:
            if path not in known:
                raise StageError(f"pipeline cut {path!r} is not a block of the model; the blocks "
                                 f"are {known[0]} ... {known[-1]}")
            cuts.append(layers.index(known.index(path)))
        if len(cuts) != stages - 1 or sorted(set(cuts)) != cuts or 0 in cuts:
            raise StageError(f"{stages} stages need {stages - 1} distinct cuts, in order, none at "
                             f"the first block; got {list(pinned)}")
        return cuts

    @staticmethod
    def _assign_forward(tg: TrainGraph, stage_of_layer: dict[int, int], last: int) -> None:
        forward = [n for n in tg.call_nodes() if n.meta[M.ROLE] != M.Role.BACKWARD]
        in_stack = [i for i, n in enumerate(forward) if n.meta.get(M.LAYER) is not None]
        after_stack = in_stack[-1] if in_stack else len(forward)
        deferred = []
        for i, n in enumerate(forward):
            inputs = [a.meta[M.STAGE] for a in n.all_input_nodes if M.STAGE in a.meta]
            layer = n.meta.get(M.LAYER)
            if layer is not None:
                n.meta[M.STAGE] = max([stage_of_layer[layer]] + inputs)
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
