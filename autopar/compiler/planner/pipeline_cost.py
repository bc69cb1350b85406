"""Step time of a pipelined or micro-batched step (Layout.pp > 1 or microbatches > 1).

A pure function of (GraphSummary, StageSummary, ClusterSpec, Layout), like the rest
of the cost model. The summary is one rank's graph for one micro-batch, cut into
stages by AssignStages. What it adds up is what the pipeline runtime does
(runtime/pipeline.py):

1. each stage's programs F, B (and I, W for zero-bubble) are replayed on the compute
   and communication streams (cost_model.simulate_streams: tensor-parallel
   collectives inside a stage cost there);
2. the schedule of the layout (compiler/ir/schedule.py) is simulated with those times;
   a receive (RF, RB) takes alpha + bytes / bandwidth per value on the link between
   neighbouring pipeline ranks (ranks tp*dp apart) and holds up its rank;
3. after its last action a rank sums gradients: tied weights over the pipeline ranks
   that share them, then over dp (not overlapped) one flat all-reduce of the
   gradients it updates whole and, under ZeRO-2/3, a reduce-scatter of each one it
   updates a dim-0 block of; then it runs the optimizer on what it updates (ZeRO:
   its blocks) and all-gathers the updated blocks (ZeRO-1/2; ZeRO-3 gathers its
   parameters before the schedule instead).

The step time is the slowest rank's; its idle time that is not a receive is the
bubble.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import (
    WIRE_BYTES,
    tp_piece_bytes,
    zero_block_bytes,
)
from autopar.compiler.analysis.summary import GraphSummary, changed
from autopar.compiler.ir.schedule import (
    COMPUTE,
    Schedule,
    Timeline,
    build,
    rank_floors,
    simulate,
)
from autopar.compiler.planner.cost_model import (
    AVERAGE_KEY,
    DGC_KEY,
    overlapped_average,
    simulate_streams,
)
from autopar.compiler.planner.stages import StageSummary
from autopar.costs import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    collective_time,
    dgc_compressed,
    dgc_kept,
    dgc_select_time,
    dp_sum_bytes,
    dp_sum_time,
    group_spans_nodes,
    optimizer_time,
)
from autopar.layout import Layout

PHASE_PROGRAMS = {"F": "F", "B": "IW", "I": "I", "W": "W"}


@dataclass(frozen=True)
class PhaseTime:
    compute_s: float
    comm_s: float  # collectives inside the phase (tensor parallelism)
    total_s: float  # compute plus what of comm_s is not overlapped


@dataclass(frozen=True)
class PipelineTime:
    total_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    optimizer_s: float
    critical_rank: int
    timeline: Timeline  # the simulated schedule, seconds (spans: run_schedule's `spans`)
    grad_sync_s: tuple[float, ...]  # per pipeline rank, after its last action
    optimizer_per_rank_s: tuple[float, ...]  # per pipeline rank, after its gradient sync
    # per pipeline rank, ZeRO's parameter all-gather: after the optimizer (ZeRO-1/2), before
    # the schedule (ZeRO-3; the timeline above starts at 0 without it)
    param_gather_s: tuple[float, ...] = ()

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.total_s if self.total_s > 0 else 0.0


def phase_time(summary: GraphSummary, members: Iterable[int], cluster: ClusterSpec,
               layout: Layout, eff: Efficiency = DEFAULT_EFFICIENCY) -> PhaseTime:
    """One program's time: its ops replayed alone, in order (a wait for a collective of
    another program does not wait)."""
    chosen = sorted(members)
    where = {i: k for k, i in enumerate(chosen)}
    ops = tuple(changed(op, waits_on=where.get(op.waits_on, -1))
                if op.waits_on is not None else op for op in (summary.ops[i] for i in chosen))
    compute, comm, end = simulate_streams(
        GraphSummary(ops, (), (), 0, frozenset()), cluster, layout, eff)
    return PhaseTime(compute, comm, end)


def stage_phase_times(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                      layout: Layout, eff: Efficiency = DEFAULT_EFFICIENCY
                      ) -> dict[tuple[int, str], PhaseTime]:
    """(stage, "F" | "B" | "I" | "W") -> its PhaseTime; stages of one kind replayed once."""
    groups = stages.programs()
    kinds = stages.kinds or tuple(range(stages.stages))
    cache: dict[tuple, PhaseTime] = {}
    out = {}
    for s in range(stages.stages):
        for kind, programs in PHASE_PROGRAMS.items():
            key = (kinds[s], kind)
            if key not in cache:
                members = [i for p in programs for i in groups.get((s, p), ())]
                cache[key] = phase_time(summary, members, cluster, layout, eff)
            out[s, kind] = cache[key]
    return out


def p2p_time(nbytes: float, tensors: int, cluster: ClusterSpec, layout: Layout,
             eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Point-to-point send of `tensors` values, `nbytes` in all, between pipeline
    neighbours: alpha per value plus bytes over the link (the network once the
    pipeline group leaves the node: its slowest hop paces every micro-batch)."""
    spans = group_spans_nodes(layout.pp, layout.tp * layout.dp, cluster)
    link = cluster.inter_node if spans else cluster.intra_node
    return tensors * link.latency_s + nbytes / (link.bandwidth * eff.link)


def receive_costs(stages: StageSummary, cluster: ClusterSpec, layout: Layout,
                  eff: Efficiency = DEFAULT_EFFICIENCY) -> dict[tuple[int, str], float]:
    """(stage, "RF" | "RB") -> seconds of the values that stage receives per micro-batch
    (values between stages on one rank, interleaved, stay in memory)."""
    out: dict[tuple[int, str], float] = {}
    for m in stages.messages:
        if m.src % layout.pp == m.dst % layout.pp:
            continue
        key = (m.dst, "R" + m.phase)
        out[key] = out.get(key, 0.0) + p2p_time(m.nbytes, m.tensors, cluster, layout, eff)
    return out


def rank_params(summary: GraphSummary, stages: StageSummary, layout: Layout
                ) -> list[list[tuple[int, int]]]:
    """The parameters each pipeline rank holds (read by one of its stages), as (index,
    count) pairs: index i stands for `count` of them with its element count, itemsize
    and rows, all that the costs below read of a parameter (repeated blocks hold a few
    shapes many times: each is costed once)."""
    held: list[dict[tuple, list[int]]] = [{} for _ in range(layout.pp)]
    rows = summary.param_rows or [0] * len(summary.param_numel)
    for i, readers in enumerate(stages.param_stages):
        shape = (summary.param_numel[i], summary.param_itemsize[i], rows[i])
        for rank in {s % layout.pp for s in readers}:
            held[rank].setdefault(shape, [i, 0])[1] += 1
    return [[(i, count) for i, count in sorted(shapes.values())] for shapes in held]


def grad_sync_time(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                   layout: Layout, eff: Efficiency = DEFAULT_EFFICIENCY,
                   by_rank: list[list[tuple[int, int]]] | None = None) -> list[float]:
    """Per pipeline rank, as runtime/pipeline.py sums gradients: tied-weight all-reduces
    over the ranks sharing them, then over dp (in Layout.grad_comm_dtype when set) one
    flat all-reduce of the gradients it updates whole (Local SGD: the same bytes of
    parameters averaged every H steps, amortised; DGC: dgc_rank_time), and under ZeRO-2/3 a reduce-scatter
    of each one it updates a block of. `by_rank`: rank_params, if known."""
    out = [0.0] * layout.pp
    for i, readers in enumerate(stages.param_stages):
        ranks = {s % layout.pp for s in readers}
        if len(ranks) < 2:  # read on one rank: nothing to reduce across the pipeline
            continue
        # the sharing ranks are tp * dp devices apart per pipeline rank between them
        spacing = layout.tp * layout.dp * (max(ranks) - min(ranks)) // (len(ranks) - 1)
        seconds = collective_time("all_reduce", summary.param_numel[i] * summary.param_itemsize[i],
                                  len(ranks), cluster, spacing, eff)
        for rank in ranks:
            out[rank] += seconds

    @functools.cache  # blocks repeat: one per parameter shape
    def scatter(block: int) -> float:
        return collective_time("reduce_scatter", _wire(block * layout.dp, summary, layout),
                               layout.dp, cluster, layout.tp, eff)

    for rank, params in enumerate(by_rank or rank_params(summary, stages, layout)):
        whole = 0
        for i, count in params:
            block = zero_block_bytes(summary, i, layout) if layout.zero >= 2 else 0
            if block:
                out[rank] += count * scatter(block)
            else:
                whole += count * summary.param_numel[i] * summary.param_itemsize[i]
        if layout.dgc is not None:
            out[rank] += dgc_rank_time(summary, params, cluster, layout, eff)
        elif layout.local_sgd is not None:  # the parameter average every H steps instead
            out[rank] += dp_sum_time(whole, cluster, layout, eff) / layout.local_sgd
        else:
            out[rank] += dp_sum_time(_wire(whole, summary, layout), cluster, layout, eff)
    return out


def rank_comm_bytes(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                    layout: Layout, by_rank: list[list[tuple[int, int]]] | None = None
                    ) -> list[dict[str, int]]:
    """Per pipeline rank, the bytes its communication carries per step, by the group it
    runs over, as cost_model.comm_bytes counts a whole-graph step's (each collective's
    full tensor, as the times above price it):
    - "tp": the collectives inside its stages' programs, once per micro-batch;
    - "pp": the values its stages send to other ranks' stages (activations forward,
      their gradients back), once per micro-batch, and its share of each tied weight's
      gradient sum over the pipeline ranks that read it;
    - over dp, what grad_sync_time and param_gather_time time: the flat or hierarchical
      sum of the gradients it updates whole (dp_sum_bytes), ZeRO-2/3's reduce-scatter
      and ZeRO's all-gather of each block it updates (under "dp"); Local SGD's
      parameter average amortised over its period (AVERAGE_KEY) instead of the sum;
      DGC's dense sum (under "dp") and all-gather of values and indices (DGC_KEY).
    `by_rank`: rank_params, if known."""
    out: list[Counter] = [Counter() for _ in range(layout.pp)]
    # a replica's stages of one kind run the programs of the first stage of that kind
    kinds = stages.kinds or tuple(range(stages.stages))
    first = {}
    for s in range(stages.stages):
        first.setdefault(kinds[s], s)
    per_stage: Counter = Counter()  # first stage of a kind -> its collectives' bytes, by group
    for i, s in enumerate(stages.stage_of):
        op = summary.ops[i]
        if s is not None and op.collective and op.group:
            per_stage[s, op.group] += op.comm_bytes * op.repeat
    for s in range(stages.stages):
        for (k, group), nbytes in per_stage.items():
            if k == first[kinds[s]]:
                out[s % layout.pp][group] += nbytes * layout.microbatches
    for m in stages.messages:
        if m.src % layout.pp != m.dst % layout.pp:
            out[m.src % layout.pp]["pp"] += m.nbytes * layout.microbatches
    for i, readers in enumerate(stages.param_stages):
        ranks = {s % layout.pp for s in readers}
        if len(ranks) > 1:
            for rank in ranks:
                out[rank]["pp"] += summary.param_numel[i] * summary.param_itemsize[i]
    if layout.dp > 1:
        for rank, params in enumerate(by_rank or rank_params(summary, stages, layout)):
            out[rank].update(_dp_rank_bytes(summary, params, cluster, layout))
    return [{group: int(nbytes) for group, nbytes in c.items() if nbytes} for c in out]


def _dp_rank_bytes(summary: GraphSummary, params: list[tuple[int, int]], cluster: ClusterSpec,
                   layout: Layout) -> Counter:
    """One pipeline rank's bytes over dp after its schedule (rank_comm_bytes)."""
    out: Counter = Counter()
    whole = 0
    for i, count in params:
        numel, size = summary.param_numel[i], summary.param_itemsize[i]
        block = zero_block_bytes(summary, i, layout) if layout.zero else 0
        if block:  # ZeRO's all-gather of the updated block; ZeRO-2/3 reduce-scatter it
            out["dp"] += count * block * layout.dp
        if block and layout.zero >= 2:
            out["dp"] += count * _wire(block * layout.dp, summary, layout)
        elif layout.dgc is not None and dgc_compressed(numel, size):
            out[DGC_KEY] += count * 8 * dgc_kept(numel, layout.dgc) * layout.dp
        else:
            whole += count * numel * size
    if layout.local_sgd is not None:
        out[AVERAGE_KEY] += whole // layout.local_sgd
    elif layout.dgc is not None:
        out["dp"] += whole
    else:
        out.update(dp_sum_bytes(_wire(whole, summary, layout), cluster, layout))
    return out


def rank_uncompressed_bytes(summary: GraphSummary, stages: StageSummary, layout: Layout,
                            by_rank: list[list[tuple[int, int]]] | None = None) -> list[int]:
    """Per pipeline rank, what its gradient sum would carry summed whole every step
    under DGC or Local SGD (cost_model.uncompressed_bytes' per rank); 0s otherwise."""
    if layout.dgc is None and layout.local_sgd is None:
        return [0] * layout.pp
    return [sum(count * summary.param_numel[i] * summary.param_itemsize[i] for i, count in params)
            for params in by_rank or rank_params(summary, stages, layout)]


def dgc_rank_time(summary: GraphSummary, params: list[tuple[int, int]],
                  cluster: ClusterSpec, layout: Layout,
                  eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """DGC on one pipeline rank (runtime/dgc.py, as cost_model prices a whole-graph
    step): the dense all-reduce of its small gradients, the all-gather of k values and
    k indices per compressed one, and the selection."""
    dense = sparse = 0
    select = 0.0
    for i, count in params:
        numel, size = summary.param_numel[i], summary.param_itemsize[i]
        if dgc_compressed(numel, size):
            sparse += count * 8 * dgc_kept(numel, layout.dgc) * layout.dp
            select += count * dgc_select_time(numel, layout.dgc_topk, cluster, eff)
        else:
            dense += count * numel * size
    return (collective_time("all_reduce", dense, layout.dp, cluster, layout.tp, eff)
            + collective_time("all_gather", sparse, layout.dp, cluster, layout.tp, eff) + select)


def param_gather_time(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                      layout: Layout, eff: Efficiency = DEFAULT_EFFICIENCY,
                      by_rank: list[list[tuple[int, int]]] | None = None) -> list[float]:
    """Per pipeline rank: ZeRO's all-gather of each parameter it updates a block of (after
    the optimizer under ZeRO-1/2, before the schedule under ZeRO-3), one per parameter
    as the runtime issues them."""
    if not layout.zero or layout.dp == 1:  # zero_block_bytes is 0 for every parameter
        return [0.0] * layout.pp

    @functools.cache  # blocks repeat: one per parameter shape
    def gather(block: int) -> float:
        return collective_time("all_gather", block * layout.dp, layout.dp, cluster, layout.tp, eff)

    return [sum(count * gather(block) for block, count in
                ((zero_block_bytes(summary, i, layout), count) for i, count in params) if block)
            for params in by_rank or rank_params(summary, stages, layout)]


def updated_bytes(summary: GraphSummary, stages: StageSummary, layout: Layout,
                  by_rank: list[list[tuple[int, int]]] | None = None) -> list[int]:
    """Per pipeline rank: the bytes its optimizer step updates (ZeRO: its blocks)."""
    return [sum(count * (zero_block_bytes(summary, i, layout)
                         or summary.param_numel[i] * summary.param_itemsize[i])
                for i, count in params)
            for params in by_rank or rank_params(summary, stages, layout)]


def _wire(nbytes: int, summary: GraphSummary, layout: Layout) -> float:
    return _wired(nbytes, summary.param_itemsize, layout)


def _wired(nbytes: float, itemsizes: Sequence[int], layout: Layout) -> float:
    if layout.grad_comm_dtype is None or not itemsizes:
        return nbytes
    return nbytes * WIRE_BYTES[layout.grad_comm_dtype] * len(itemsizes) / sum(itemsizes)


def after_schedule_floor(params: Sequence[tuple[tuple[int, ...], int]], cluster: ClusterSpec,
                         layout: Layout, optimizer: str = "adamw",
                         eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds below the sum over pipeline ranks of what each runs after its last action
    (grad_sync_time + optimizer + param_gather_time), from the trainable parameters'
    (shape, itemsize) alone: nothing traced (the planner's bound, plan.compute_bound).

    Why it is below: each parameter is held whole or as one tensor-parallel piece, at
    least numel * (d // tp) / d of it for its smallest such ratio over dims d; every
    collective time is a minimum of affine functions of the bytes with nonnegative
    intercepts, so a sum of them is at least one collective of the summed bytes (a
    ZeRO-2/3 rank's reduce-scatters and all-reduce: the cheaper kind for all of them);
    a tied weight counted once is counted too few times, never too many; a parameter
    counts as gathered under ZeRO only if it keeps dp rows or more after tensor
    parallelism (dim 0 // tp >= dp); each rank's ZeRO block is at least 1/dp of what it
    holds."""
    if not params:
        return 0.0
    held, gathered = 0.0, 0.0
    # a deep model's parameters are a few shapes repeated once per block: each costed once
    for (shape, itemsize), count in Counter(params).items():
        piece = tp_piece_bytes(shape, itemsize, layout.tp) * count
        held += piece
        if layout.zero and layout.dp > 1 and shape and shape[0] // layout.tp >= layout.dp:
            gathered += piece
    wire = _wired(held, [size for _, size in params], layout)
    sync = collective_time("all_reduce", wire, layout.dp, cluster, layout.tp, eff)
    if layout.allreduce == "hierarchical":  # its levels over the summed bytes, if less
        sync = min(sync, dp_sum_time(wire, cluster, layout, eff))
    if layout.dgc is not None:  # its exchange can be far below the all-reduce: nothing
        sync = 0.0
    elif layout.local_sgd is not None and layout.local_sgd_overlap:
        sync = 0.0  # it may run wholly under the local steps (overlapped_average)
    elif layout.local_sgd is not None:  # as grad_sync_time: an average every H steps
        sync = dp_sum_time(held, cluster, layout, eff) / layout.local_sgd
    if layout.zero >= 2:
        sync = min(sync, collective_time("reduce_scatter", wire, layout.dp, cluster, layout.tp, eff))
    gather = collective_time("all_gather", gathered, layout.dp, cluster, layout.tp, eff) \
        if gathered else 0.0
    updated = held / layout.dp if layout.zero else held
    return sync + gather + optimizer_time(updated, optimizer, cluster, eff)


@functools.lru_cache(maxsize=64)
def _simulated(schedule: tuple, cost: tuple, spans: bool) -> Timeline:
    """simulate(build(*schedule), dict(cost), spans), once for the layouts that differ
    only in what the schedule does not see (dp, ZeRO: the planner costs them one after
    another)."""
    return simulate(build(*schedule), dict(cost), spans)


@dataclass(frozen=True)
class ScheduleRun:
    """Steps 1 and 2 of the module docstring for one layout: its stages' phase times,
    receives and simulated schedule, each rank's end of schedule and parameters. The
    same for layouts that differ only in their ZeRO stage (it acts before the first
    action or after the last): pipeline_time takes it to cost them once."""
    phases: dict[tuple[int, str], PhaseTime]
    receives: dict[tuple[int, str], float]
    schedule: Schedule
    timeline: Timeline
    ends: tuple[float, ...]
    by_rank: list[list[tuple[int, int]]]  # rank_params


@dataclass(frozen=True)
class StagePhases:
    """What a schedule's simulation takes: each stage's phase times and receives (the
    same for layouts that differ only in ZeRO), and the parameters of each rank."""
    phases: dict[tuple[int, str], PhaseTime]
    receives: dict[tuple[int, str], float]
    by_rank: list[list[tuple[int, int]]]  # rank_params

    @property
    def cost(self) -> dict[tuple[int, str], float]:
        """runtime.schedule.simulate's cost of each (stage, kind)."""
        return {**{key: phase.total_s for key, phase in self.phases.items()}, **self.receives}


def stage_phases(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                 layout: Layout, eff: Efficiency = DEFAULT_EFFICIENCY) -> StagePhases:
    return StagePhases(stage_phase_times(summary, stages, cluster, layout, eff),
                       receive_costs(stages, cluster, layout, eff),
                       rank_params(summary, stages, layout))


def run_schedule(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                 layout: Layout, eff: Efficiency = DEFAULT_EFFICIENCY,
                 known: StagePhases | None = None, spans: bool = False) -> ScheduleRun:
    """Steps 1 and 2 of the module docstring (`known`: stage_phases of these arguments;
    `spans`: keep every action's span in the timeline, for a report)."""
    known = known or stage_phases(summary, stages, cluster, layout, eff)
    schedule = build(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    timeline = _simulated((layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages),
                          tuple(sorted(known.cost.items())), spans)
    return ScheduleRun(known.phases, known.receives, schedule, timeline, timeline.ends,
                       known.by_rank)


def after_schedule(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                   layout: Layout, optimizer: str, eff: Efficiency,
                   by_rank: list[list[tuple[int, int]]]
                   ) -> tuple[list[float], list[float], list[float]]:
    """Per pipeline rank, after its last action: (gradient sync, ZeRO's parameter
    gather, optimizer step) seconds."""
    sync = grad_sync_time(summary, stages, cluster, layout, eff, by_rank)
    gather = param_gather_time(summary, stages, cluster, layout, eff, by_rank)
    optim = [optimizer_time(b, optimizer, cluster, eff)
             for b in updated_bytes(summary, stages, layout, by_rank)]
    return sync, gather, optim


def schedule_floor(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                   layout: Layout, optimizer: str = "adamw",
                   eff: Efficiency = DEFAULT_EFFICIENCY,
                   known: StagePhases | None = None) -> float:
    """Seconds below pipeline_time's step, without simulating the schedule: each rank's
    runtime.schedule.rank_floors (its busy time, after micro-batch 0's forward reaches
    it) plus what it runs after its last action; the step is the largest such end."""
    known = known or stage_phases(summary, stages, cluster, layout, eff)
    floors = rank_floors(layout.schedule, layout.pp, layout.microbatches,
                         layout.virtual_stages, known.cost)
    sync, gather, optim = after_schedule(summary, stages, cluster, layout, optimizer, eff,
                                         known.by_rank)
    sync = _exposed_average(sync, floors, gather, optim, layout)
    return max(floors[r] + sync[r] + optim[r] + gather[r] for r in range(layout.pp))


def _exposed_average(sync: list[float], ends: list[float], gather: list[float],
                     optim: list[float], layout: Layout) -> list[float]:
    """Per rank, what of Local SGD's amortised average (`sync`, grad_sync_time's) an
    overlapped one exposes under the rank's local step (its schedule's end, gather and
    optimizer: cost_model.overlapped_average); `sync` itself otherwise."""
    return [overlapped_average(s, e + g + o, layout)
            for s, e, g, o in zip(sync, ends, gather, optim)]


def pipeline_time(summary: GraphSummary, stages: StageSummary, cluster: ClusterSpec,
                  layout: Layout, optimizer: str = "adamw",
                  eff: Efficiency = DEFAULT_EFFICIENCY,
                  run: ScheduleRun | None = None) -> PipelineTime:
    """The predicted step of `layout`'s schedule over `stages` (see the module docstring).
    `run`: run_schedule of these arguments, or of a layout that differs only in ZeRO."""
    run = run or run_schedule(summary, stages, cluster, layout, eff)
    phases, receives, timeline, ends = run.phases, run.receives, run.timeline, run.ends
    sync, gather, optim = after_schedule(summary, stages, cluster, layout, optimizer, eff,
                                         run.by_rank)
    sync = _exposed_average(sync, ends, gather, optim, layout)
    rank = max(range(layout.pp), key=lambda r: ends[r] + sync[r] + optim[r] + gather[r])
    # the critical rank's compute actions, each its phase's time (simulate's span)
    done = Counter((a.stage, a.kind) for a in run.schedule.ranks[rank] if a.kind in COMPUTE)
    compute = sum(n * phases[key].compute_s for key, n in done.items())
    inside_comm = sum(n * phases[key].comm_s for key, n in done.items())
    inside_exposed = sum(n * phases[key].total_s for key, n in done.items()) - compute
    received = sum(receives.get((a.stage, a.kind), 0.0) for a in run.schedule.ranks[rank])
    bubble = max(0.0, ends[rank] - compute - inside_exposed - received)
    return PipelineTime(
        total_s=ends[rank] + sync[rank] + optim[rank] + gather[rank], compute_s=compute,
        comm_s=inside_comm + received + sync[rank] + gather[rank],
        exposed_comm_s=inside_exposed + received + sync[rank] + gather[rank], bubble_s=bubble,
        optimizer_s=optim[rank], critical_rank=rank, timeline=timeline, grad_sync_s=tuple(sync),
        optimizer_per_rank_s=tuple(optim), param_gather_s=tuple(gather))
