"""autopar.plan: choose the layout of a model on a cluster (search.py), with the
facts the report shows (details): the chosen layout's predicted timeline per rank,
its tensor-parallel placements, the cost of each layer.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import static_lower_bound
from autopar.compiler.analysis.summary import DTYPE_NAMES
from autopar.compiler.ir.annotate import repeated_block_container
from autopar.compiler.ir.batch import Batch, LossFn, Objective
from autopar.compiler.ir.trace import batch_size
from autopar.compiler.planner.cost_model import model_compute_floor
from autopar.compiler.planner.estimate import Estimator
from autopar.compiler.planner.pipeline_cost import (
    after_schedule_floor,
    pipeline_time,
    run_schedule,
)
from autopar.compiler.planner.result import Plan
from autopar.compiler.planner.rewrites import template_key
from autopar.compiler.planner.search import (
    ALLOWABLE,
    FLOOR_ONLY,
    MEMORY_FLOOR_ONLY,
    TIMED_ONLY,
    Costing,
    PlanArgumentError,
    PlanError,
    candidate_layouts,
    check_constraints,
    costing_order,
    recompute_variants,
    refinements,
    search,
)
from autopar.compiler.planner.workers import available as worker_available
from autopar.costs import DEFAULT_EFFICIENCY, Efficiency
from autopar.layout import Layout, LayoutError

MAX_WORKERS = 2  # plan(workers=None): a large search rewrites a few groups (one per tp)

# how many times the nodes a model that fits nowhere is tried on, to name a cluster
LARGER_CLUSTERS = (2, 4, 8)


def plan(model: torch.nn.Module, cluster: ClusterSpec, example_inputs: Batch,
         loss_fn: LossFn | None = None, optimizer: str = "adamw",
         efficiency: Efficiency = DEFAULT_EFFICIENCY,
         progress: Callable[[int, int, Layout], None] | None = None,
         trace_blocks: int | str | None = "auto", workers: int | None = None,
         example_targets: Batch | None = None, allow: Sequence[str] = (),
         **constraints: Any) -> Plan:
    """The fastest layout of `model` on `cluster` that fits memory, and every other one
    with why not. Constraints fix Layout fields (tp=2, amp="bf16") or set
    max_memory_fraction (default 0.9). `progress(done, total, layout)` is called
    before each candidate is costed. `trace_blocks`: "auto" (default) traces two of the
    model's repeated blocks when it has more (a pipeline: a two-stage template) and
    scales their costs to the whole stack (planner/scaled.py, planner/replicated.py):
    seconds for deep models, within a few percent of exact; "exact" (or None) traces the
    whole model for every layout (minutes for billions of parameters); k: k blocks. The
    plan says which (`plan.details["tracing"]`). `workers=k` forks k
    processes that rewrite graphs while the search costs (planner/workers.py: the same
    plan, sooner on more than one core; only with per-block tracing, on Linux); None: one
    per CPU up to MAX_WORKERS; 0: none. The batch is passed as to `autopar.compile`
    (`example_inputs` to the model, `example_targets` only to the loss). `allow`:
    techniques that change what training converges to, which the plan may then use
    ("local_sgd": Local SGD with period LOCAL_SGD_PERIOD, or fix `local_sgd=H`; "dgc":
    DGC at sparsity DGC_SPARSITY, or fix `dgc=s`, with optimizer="sgd-momentum"); the
    cost model prices their time, not their accuracy, and the report says so."""
    if workers is not None and (not isinstance(workers, int) or workers < 0):
        raise PlanArgumentError(f"workers must be a count of processes (0: none) or None, got "
                         f"{workers!r}")
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"cluster must be an autopar.ClusterSpec, got {type(cluster).__name__}")
    fixed, fraction = check_constraints(constraints)
    allow = check_allow(allow, optimizer)
    objective, flat = Objective.from_example(example_inputs, example_targets, loss_fn)
    with collector_paused():
        return _search(model, cluster, flat, objective, optimizer, efficiency,
                       progress, trace_blocks, workers, constraints, fixed, fraction, allow)


def check_allow(allow: Sequence[str], optimizer: str = "sgd-momentum") -> tuple[str, ...]:
    """plan's `allow`: names of ALLOWABLE techniques, which change convergence; DGC only
    with SGD and momentum (its momentum correction replaces SGD's)."""
    if isinstance(allow, str):
        allow = [allow]
    unknown = [a for a in allow if a not in ALLOWABLE]
    if unknown:
        raise PlanArgumentError(
            f"allow names techniques that change what training converges to, which the plan "
            f"uses only when allowed: {list(ALLOWABLE)}; got {unknown[0]!r}")
    if "dgc" in allow and optimizer != "sgd-momentum":
        raise PlanArgumentError(
            f"allow=['dgc']: DGC corrects SGD's momentum, and the plan's optimizer is "
            f"{optimizer!r}; plan with optimizer='sgd-momentum', or leave 'dgc' out")
    return tuple(allow)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (as it was after). A search makes
    millions of small acyclic tuples (schedules, their simulations, memory replays), and
    each full collection they trigger also walks every object torch and the model
    hold (docs/benchmarks.md measures what that costs the 1T GPT's search). The few
    cycles a search leaves (rewritten graphs) are collected once it is back on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _search(model, cluster, example_inputs, loss_fn, optimizer, efficiency, progress,
            trace_blocks, workers, constraints, fixed, fraction, allow=()) -> Plan:
    estimator = Estimator(model, cluster, example_inputs, loss_fn, optimizer, efficiency,
                          trace_blocks=trace_blocks)
    trace_blocks = estimator.trace_blocks  # "auto" resolved: None or a count
    candidates = _candidates(model, cluster, example_inputs, fixed)
    start = time.perf_counter()
    costed, pruned = prune_static(candidates, model, cluster, fraction, optimizer)
    if costed:
        costed, held = prune_static(costed, model, cluster, fraction, optimizer,
                                    bucketed_gradients(model, estimator,
                                                       estimator.most_shared(costed)))
        pruned += held
    step = None if progress is None else _counter(progress, len(costed))
    bound = compute_bound(estimator, costed, efficiency) if costed else None
    widest = widest_templates(costed)
    count = _worker_count(workers, trace_blocks)
    if bound is not None and count:
        _start_workers(estimator, count, costed, bool(pruned) and "recompute" not in fixed,
                       bound, widest)
    try:
        try:
            capacity = cluster.device.memory_bytes * fraction
            result = search(costed, planner_costing(estimator, bound, widest, capacity, fixed),
                            cluster, fraction, step,
                            refinements(fixed, recompute=False, cluster=cluster, allow=allow))
            result.skipped += pruned
        except PlanError as exc:
            exc = _smallest_peak_error(exc, estimator, costed, pruned, cluster, fraction, fixed)
            hint = _larger_cluster_hint(model, cluster, example_inputs, loss_fn, optimizer,
                                        efficiency, trace_blocks, constraints, exc.smallest)
            raise PlanError(f"{exc}{hint}") from None
        result.details = details(estimator, result.layout, cluster, efficiency, optimizer)
        result.details["tracing"] = estimator.traces.describe(result.layout)
        if estimator.traces.templated(result.layout):  # costed with its cuts between blocks
            result.pass_options = {"cut_inside_blocks": False}
    finally:
        estimator.close_workers()
    result.details["search"] = {"candidates": len(candidates), "pruned": len(pruned),
                                **_skipped_counts(result.skipped),
                                "costed": len(result.alternatives) + 1,
                                **estimator.counts(),
                                "seconds": time.perf_counter() - start}
    return result


def planner_costing(estimator: Estimator, bound: Callable[[Layout], float] | None,
                    widest: dict[tuple, Layout], capacity: float,
                    fixed: dict[str, Any]) -> Costing:
    """What the search asks of the Estimator: each pipeline's widest template is
    rewritten before it is costed (`prepare`), its memory floor asked with the memory
    allowed as the limit."""
    return Costing(
        predict=estimator.predict, bound=bound,
        prepare=lambda lay: estimator.prepare(widest.get(template_key(lay), lay)),
        prepared=lambda lay: estimator.is_prepared(widest.get(template_key(lay), lay)),
        timed=estimator.step_time, floor=estimator.schedule_floor,
        compute_floor=estimator.compute_floor,
        memory_floor=lambda lay: estimator.memory_floor(lay, capacity),
        variants=recompute_variants(fixed))


def _start_workers(estimator: Estimator, count: int, costed: list[Layout], recomputes: bool,
                   bound: Callable[[Layout], float], widest: dict[tuple, Layout]) -> None:
    """Fork `count` workers for the rewrites the search will ask, in its order: the
    candidates by their bound before anything is costed, and, when memory is short
    (`recomputes`), the recomputation the search queues as it goes (full first;
    selective where full fits, last)."""
    first = {lay: bound(lay) for lay in costed}  # before anything is costed
    order = sorted(costed, key=lambda lay: (first[lay], *costing_order(lay)))
    asked = rewrites_asked(order, widest)
    if recomputes:
        asked = [v for lay in asked for v in (lay, lay.replace(recompute="full"))] \
            + [lay.replace(recompute="selective") for lay in asked]
        first.update({lay: bound(lay) for lay in asked if lay not in first})
    estimator.start_workers(count, asked, first.__getitem__)


def _smallest_peak_error(exc: PlanError, estimator: Estimator, costed: list[Layout],
                         pruned: list[tuple[Layout, str]], cluster: ClusterSpec,
                         fraction: float, fixed: dict[str, Any]) -> PlanError:
    """The PlanError to raise: it names the smallest peak, which may be that of a layout
    pruned before the search (searched again with them, smallest static bound first)."""
    if not pruned:
        return exc
    floor = _static_bound(estimator.model, estimator.optimizer)
    costing = Costing(predict=estimator.predict, memory_bound=floor,
                      timed=estimator.step_time, compute_floor=estimator.compute_floor,
                      memory_floor=estimator.memory_floor, variants=recompute_variants(fixed))
    try:
        search(costed + sorted((lay for lay, _ in pruned), key=floor), costing, cluster,
               fraction, None, refinements(fixed, recompute=False, cluster=cluster))
    except PlanError as again:
        return again
    return exc


def _skipped_counts(skipped: list[tuple[Layout, str]]) -> dict[str, int]:
    """How many layouts the search left out on their memory floor, their bound, their
    schedule's floor and their step time (the reasons say which)."""
    timed = sum(TIMED_ONLY in why for _, why in skipped)
    floored = sum(FLOOR_ONLY in why for _, why in skipped)
    over_memory = sum(MEMORY_FLOOR_ONLY in why for _, why in skipped)
    bounded = sum(why.startswith("not costed") for _, why in skipped) \
        - timed - floored - over_memory
    return {"over_memory": over_memory, "bounded": bounded, "floored": floored,
            "timed": timed}


# model FLOPs of the global batch are measured on one micro-batch size and used for all:
# the few ops whose count does not scale with the batch (the loss's mean) get this margin
BOUND_MARGIN = 0.99


def compute_bound(estimator: Estimator, candidates: list[Layout], eff: Efficiency
                  ) -> Callable[[Layout], float]:
    """`bound(layout)`: seconds below any predicted step of `layout`, the largest of the
    bounds below.

    From FLOPs, before anything is costed: each rank computes at least its 1/world share
    of the FLOPs the traced step's kernels perform (its model FLOPs, less the scores a
    causal attention skips, plus those its backward recomputes: what kernel_time
    counts), and no op runs faster than at the highest peak among the
    dtypes it can compute in (fp32, the parameters' and buffers', the layout's AMP
    dtype) times the compute efficiency and the smallest fitted op factor below 1
    (cost_model.kernel_time). A pipeline's pp ranks share 1/dp of the batch, so they
    compute at least pp times that share together, and under 1F1B and GPipe the
    slowest at least bubble_factor times it (the fill and drain: below, with that share
    for c).

    From a costed reference, once the search has rewritten it: the unpipelined layout
    R of the same devices with `layout`'s tp, AMP and recomputation (dp * pp ranks of
    data parallelism, no ZeRO). Its model ops' roofline time c (cost_model.
    model_compute_floor) is a rank's share of a 1/(dp*pp) batch. `layout` runs the same
    ops on smaller or equal pieces (micro-batches, m >= pp), so its pp ranks together
    compute at least pp * c, and the slowest at least c. Under 1F1B and GPipe the fill
    and drain add to that: rank k cannot start before the forwards of the ranks before
    it, and after its last backward those ranks still run theirs, so the makespan is at
    least max_k (sum_{i<k} t_i + m t_k) over per-micro-batch stage times t summing to
    S >= pp * c / m, whose least value over all t is S / (1 - (1 - 1/m)^pp)
    (`bubble_factor`; equalising every term gives it, checked against an LP in the
    tests). Every schedule also gets the granularity of the stages: they hold whole
    repeated blocks, so some rank holds ceil(L / pp) of the L blocks, at least
    ceil(L / pp) * pp / L of the blocks' share of pp * c.

    From a timed sibling: a pipeline that differs only in its ZeRO stage runs the same
    schedule with the same stage times (ZeRO acts after the last action, or before the
    first), so its step is at least the sibling's critical rank's compute plus bubble
    (both inside that rank's end of schedule).

    After the schedule, for a pipeline or micro-batched step: each rank sums its
    gradients over dp, runs the optimizer and (ZeRO) gathers its parameters after its
    last action, not overlapped (pipeline_cost.py). The step is at least the mean over
    the pp ranks of busy time plus that, so at least the mean rank's compute plus
    pipeline_cost.after_schedule_floor / pp (a floor from the parameters' shapes alone)
    plus its receives. The mean compute is the FLOPs' share, c, or, once a template of
    the pipeline's fields is rewritten (the search's `prepare`), m L w / pp with w one
    block's phase work per micro-batch (replicated.block_work_floor: its exposed
    tensor-parallel collectives included); the receives, (S - 1) m transfers of what a
    block sends on and back (Estimator.pipeline_floors, both scaled from the template's
    micro-batch to the layout's).

    The slowest rank, from the same template: rank k holds c_k blocks and runs at
    least m w c_k of work and a c_k / L share of all blocks' after_schedule_floor
    (that floor is concave in a scaling of the parameters and 0 at none), W c_k in all;
    some rank holds ceil(L / pp) blocks. With one chunk per rank (virtual_stages=1),
    rank k starts no earlier than micro-batch 0's forward through the stages before it,
    f sum_{i<k} c_i with f one block's F floor, so the step is at least
    min over c of max_k (f sum_{i<k} c_i + W c_k) = L W / pp * fill_factor(pp, m, m f / W)
    (any schedule: a zero-bubble W fills the drain, not the fill); under 1F1B and GPipe the
    drain adds the backwards before it too: fill_factor(pp, m, 1) over m L w / pp
    (bubble_factor's argument, from the template rather than the reference).

    A whole-graph step (no pipeline, no micro-batches) queues every collective on one
    stream and ends with the optimizer and ZeRO-1/2's gather (cost_model.step_time), so
    it takes at least after_schedule_floor, overlapped or not: on the 1T GPT this rules
    out the data-parallel layouts whose gradient sync alone is slower than the best
    step found."""
    cluster, model = estimator.cluster, estimator.model
    try:
        total = estimator.step_executed_flops(estimator.most_shared(candidates)) * BOUND_MARGIN
    except ValueError:  # the model does not trace: the search reports it for every layout
        total = 0.0
    dtypes = {"fp32"} | {DTYPE_NAMES.get(t.dtype) for t in (*model.parameters(), *model.buffers())
                         if t.is_floating_point()}
    factor = min([1.0, *cluster.device.op_time_factors.values()])
    listed = cluster.device.peak_flops
    floors: dict[Layout, tuple[float, float] | None] = {}  # None: no reference split
    stack = repeated_block_container(model)
    blocks = stack[1] if stack else 0

    params = [(tuple(p.shape), p.element_size()) for p in model.parameters() if p.requires_grad]
    tails: dict[tuple, float] = {}
    in_block = [(tuple(p.shape), p.element_size())
                for p in model.get_submodule(stack[0]).parameters() if p.requires_grad] \
        if stack else []
    per_block: dict[tuple, float] = {}

    def block_after(layout: Layout) -> float:
        """Seconds below what a pipeline rank runs after its last action per block it
        holds: the floor of all blocks' parameters over L (the floor is concave in a
        scaling of the parameters and 0 at none, so c blocks' floor is at least c / L of
        L blocks')."""
        key = (layout.dp, layout.tp, layout.zero, layout.grad_comm_dtype)
        if key not in per_block:
            per_block[key] = after_schedule_floor(in_block, cluster, layout, estimator.optimizer,
                                                  eff) / blocks if blocks else 0.0
        return per_block[key]

    def reference(layout: Layout) -> tuple[float, float]:
        """(the slowest pipeline rank's compute, the mean rank's) from the reference."""
        unpipelined = reference_layout(layout)
        if unpipelined is None:
            return 0.0, 0.0
        if unpipelined not in floors:
            try:
                summary = estimator.rewritten_summary(unpipelined)
            except LayoutError:  # the batch does not split over dp x pp ranks (a pipeline
                # of micro-batches of one sequence, 7 a rank): no floor from it
                floors[unpipelined] = None
                return 0.0, 0.0
            if summary is None:  # not costed yet: no floor from it (asked again later)
                return 0.0, 0.0
            floors[unpipelined] = model_compute_floor(summary, cluster, eff)
        if floors[unpipelined] is None:
            return 0.0, 0.0
        whole, in_blocks = floors[unpipelined]
        fullest = math.ceil(blocks / layout.pp) * layout.pp / blocks if blocks else 1.0
        return (max(whole * bubble_factor(layout), in_blocks * fullest) * BOUND_MARGIN,
                whole * BOUND_MARGIN)

    def from_template(layout: Layout) -> tuple[float, float, float]:
        """(the mean pipeline rank's block work, from its template once one is
        rewritten; its receives plus its gradient sync, optimizer and ZeRO gather after
        its last action; the slowest rank's block work with the fill and drain, or the
        fullest rank's). Zeros for a step without micro-batches: its sync overlaps."""
        if layout.pp == 1 and layout.microbatches == 1:
            return 0.0, 0.0, 0.0
        boundary, block, forward = estimator.pipeline_floors(layout)
        pp, m = layout.pp, layout.microbatches
        received = (pp * layout.virtual_stages - 1) * m * boundary
        if pp == 1:
            return 0.0, (tail(layout) + received) * BOUND_MARGIN, 0.0
        work = m * blocks * block / pp
        own = m * block + block_after(layout)  # a rank's, per block it holds
        slowest = math.ceil(blocks / pp) * own
        if layout.virtual_stages == 1 and block > 0:
            slowest = max(slowest, blocks * own / pp * fill_factor(pp, m, m * forward / own))
            if layout.schedule in ("1f1b", "gpipe"):
                slowest = max(slowest, work * fill_factor(pp, m, 1.0))
        return (work * BOUND_MARGIN, (tail(layout) + received) / pp * BOUND_MARGIN,
                slowest * BOUND_MARGIN)

    def tail(layout: Layout) -> float:
        key = (layout.dp, layout.tp, layout.zero, layout.grad_comm_dtype)
        if key not in tails:
            tails[key] = after_schedule_floor(params, cluster, layout, estimator.optimizer, eff)
        return tails[key]

    def sibling(layout: Layout) -> float:
        if layout.pp == 1 and layout.microbatches == 1:
            return 0.0
        timed = (estimator.schedule_time(other) for other in _zero_siblings(layout))
        return max((t for t in timed if t is not None), default=0.0) * BOUND_MARGIN

    def bound(layout: Layout) -> float:
        peaks = [listed[d] for d in dtypes | {layout.amp} if d in listed]
        flops = total / cluster.world_size / (max(peaks) * eff.compute) * factor \
            if peaks and total else 0.0
        slowest, mean = reference(layout)
        work, after, fill = from_template(layout)
        whole = tail(layout) * BOUND_MARGIN if layout.pp == layout.microbatches == 1 else 0.0
        return max(slowest, sibling(layout), max(flops, mean, work) + after, whole, fill,
                   flops * bubble_factor(layout))

    return bound


def _zero_siblings(layout: Layout) -> list[Layout]:
    """`layout` under each other ZeRO stage it can run with (none with DGC or Local SGD,
    whose state is per rank and whole: zero=0 only)."""
    out = []
    for z in range(4):
        if z == layout.zero or (z and layout.dp == 1):
            continue
        try:
            out.append(layout.replace(zero=z))
        except LayoutError:
            continue
    return out


def rewrites_asked(order: list[Layout], widest: dict[tuple, Layout]) -> list[Layout]:
    """The layouts whose rewrites the search asks for, in the order it asks (`order`: the
    candidates by their bound): a pipeline's widest template (`prepare`), then its own
    (its micro-batch's)."""
    asked = []
    for layout in order:
        if layout.pp > 1:
            asked.append(widest.get(template_key(layout), layout))
        asked.append(layout)
    return list(dict.fromkeys(asked))


def widest_templates(candidates: list[Layout]) -> dict[tuple, Layout]:
    """rewrites.template_key -> the pipelined candidate with the largest micro-batch among
    those costed from a template of that key: search's `prepare` rewrites that one's
    template before the first of them is costed (Estimator.pipeline_floors scales it
    down to the others, not up)."""
    widest: dict[tuple, Layout] = {}
    for layout in candidates:
        if layout.pp > 1:
            key = template_key(layout)
            if key not in widest or (layout.dp * layout.microbatches
                                     < widest[key].dp * widest[key].microbatches):
                widest[key] = layout
    return widest


def _worker_count(workers: int | None, trace_blocks: int | None) -> int:
    """plan's `workers`: None is one per CPU besides the parent's, at most MAX_WORKERS
    (the parent costs while they rewrite: on two CPUs one worker keeps both busy, a
    second takes time from the parent)."""
    if workers is not None and trace_blocks is None and workers > 0:
        raise PlanArgumentError("workers needs per-block tracing (trace_blocks 'auto' on a "
                                "model "
                         "with more than two repeated blocks, or k): a worker sends scaled "
                         "summaries back, "
                         "not an exact trace's graphs")
    if trace_blocks is None or not worker_available():
        return 0
    if workers is None:
        cpus = os.cpu_count() or 1
        return min(cpus - 1, MAX_WORKERS)
    return workers


def reference_layout(layout: Layout) -> Layout | None:
    """compute_bound's reference for `layout`: the unpipelined layout of its devices with
    its forward-level fields, or None where a pipeline's micro-batches are fewer than
    its stages (its pieces are larger than the reference's: no bound from it)."""
    if layout.pp > 1 and layout.microbatches < layout.pp:
        return None
    defaults = Layout()
    try:
        return layout.replace(dp=layout.dp * layout.pp, pp=1, microbatches=1, schedule="1f1b",
                              virtual_stages=1, zero=0, bucket_mb=defaults.bucket_mb,
                              overlap_comm=defaults.overlap_comm,
                              grad_comm_dtype=defaults.grad_comm_dtype)
    except LayoutError:
        return None


def bubble_factor(layout: Layout) -> float:
    """compute_bound's factor over the slowest rank's share for the fill and drain of
    1F1B and GPipe: pp / (m (1 - (1 - 1/m)^pp)); 1 for other schedules."""
    if layout.pp == 1 or layout.schedule not in ("1f1b", "gpipe"):
        return 1.0
    return fill_factor(layout.pp, layout.microbatches, 1.0)


def fill_factor(pp: int, m: int, ratio: float) -> float:
    """The least makespan over the mean rank's work when rank k cannot end before
    `ratio` times the per-micro-batch work of the ranks before it plus its own m
    micro-batches: min over c >= 0 of max_k (ratio sum_{i<k} c_i + m c_k) with
    sum c = pp / m, which is ratio pp / (m (1 - (1 - ratio / m)^pp)) (equalising every
    term; a test solves the LP). Ratio 1 is 1F1B's and GPipe's fill and drain
    (bubble_factor); a schedule whose W fills the drain (zero-bubble) still waits for
    the forwards before it: the ratio of a block's F to its work."""
    if pp == 1 or ratio <= 0:
        return 1.0
    return ratio * pp / (m * (1 - (1 - ratio / m) ** pp))


def prune_static(candidates: list[Layout], model: torch.nn.Module, cluster: ClusterSpec,
                 fraction: float, optimizer: str,
                 bucketed: Sequence[tuple[tuple[int, ...], int]] = ()
                 ) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """(candidates worth tracing, the others with why): a layout whose parameters,
    gradients and optimizer state alone exceed the memory allowed
    (memory.static_lower_bound, from parameter counts: no trace) cannot fit; nor, given
    `bucketed` (bucketed_gradients), a whole-graph data-parallel one whose gradient
    buckets, held until the graph returns, overflow beside its parameters and state."""
    floor, plain = _static_bound(model, optimizer, bucketed), _static_bound(model, optimizer)
    capacity = cluster.device.memory_bytes * fraction
    keep, pruned = [], []
    for layout in candidates:
        bound = floor(layout)
        if bound <= capacity:
            keep.append(layout)
            continue
        what = f"parameters, gradients and {optimizer} state"
        if bucketed and plain(layout) <= capacity:
            what = (f"parameters, {optimizer} state and the gradient buckets its collectives "
                    f"hold until the step's graph returns")
        pruned.append((layout, f"does not fit: {what} alone take at least {bound / 1e9:.3g} GB "
                               f"per device, over the {capacity / 1e9:.3g} GB allowed (not "
                               f"traced)"))
    return keep, pruned


def _static_bound(model: torch.nn.Module, optimizer: str,
                  bucketed: Sequence[tuple[tuple[int, ...], int]] = ()
                  ) -> Callable[[Layout], float]:
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return lambda layout: static_lower_bound(param_bytes, layout, optimizer, bucketed)


def bucketed_gradients(model: torch.nn.Module, estimator: Estimator, layout: Layout
                       ) -> list[tuple[tuple[int, ...], int]]:
    """(shape, itemsize) of each trainable parameter a whole-graph data-parallel step sums
    in buckets, for memory.static_lower_bound: all but those an embedding op reads in
    the trace of `layout`'s micro-batch (insert_allreduce may gather their rows
    instead). None at all (no bound from buckets) when the model does not trace, or an
    embedding reads a parameter of the repeated blocks (with trace_blocks, those of the
    blocks not traced are not named in the trace)."""
    try:
        traced = estimator.traced_in_precision(layout)
    except ValueError:  # the search reports it for every layout
        return []
    placeholders = {n: spec.name for n, spec in zip(traced.placeholders(), traced.signature.params)}
    embedded = set()
    for node in traced.call_nodes():
        if node.target == torch.ops.aten.embedding.default:
            table = node.args[0]
            while table not in placeholders and len(table.all_input_nodes) == 1:
                table = table.all_input_nodes[0]  # a view or cast of the table
            if table not in placeholders:
                return []
            embedded.add(placeholders[table])
    stack = repeated_block_container(model)
    if stack and any(name.startswith(stack[0] + ".") for name in embedded):
        return []
    return [(tuple(p.shape), p.element_size()) for name, p in model.named_parameters()
            if p.requires_grad and name not in embedded]


def _candidates(model, cluster, example_inputs, fixed) -> list[Layout]:
    blocks = repeated_block_container(model)
    candidates = candidate_layouts(cluster, batch_size(example_inputs),
                                   blocks[1] if blocks else 1, fixed)
    if not candidates:
        raise PlanError(f"no layout of {cluster.world_size} devices satisfies the constraints "
                        f"{fixed} with a global batch of {batch_size(example_inputs)}: dp * "
                        "microbatches must divide the batch, tp must fit in one node "
                        f"({cluster.devices_per_node} devices)")
    return candidates


def _counter(progress, total):
    done = iter(range(total))
    return lambda layout: progress(next(done), total, layout)


def _larger_cluster_hint(model, cluster, example_inputs, loss_fn, optimizer, efficiency,
                         trace_blocks, constraints, smallest=()) -> str:
    """' The smallest cluster that fits: nodes=N' from a layout that fits on more nodes.
    `smallest`: the layouts with the smallest peaks here; the same with dp that many
    times larger are tried first there (each rank's share of the batch and of ZeRO's
    state shrinks)."""
    for factor in LARGER_CLUSTERS:
        bigger = ClusterSpec.from_dict({**cluster.to_dict(), "nodes": cluster.nodes * factor})
        first = [lay.replace(dp=lay.dp * factor) for lay in smallest]
        found = _first_fit(model, bigger, example_inputs, loss_fn, optimizer, efficiency,
                           trace_blocks, constraints, first)
        if found is not None:
            return (f". The smallest cluster of these nodes that fits: nodes={bigger.nodes} "
                    f"({bigger.world_size} devices, e.g. {found})")
    return f". It fits none of nodes={[cluster.nodes * f for f in LARGER_CLUSTERS]} either"


def _first_fit(model, cluster, example_inputs, loss_fn, optimizer, efficiency, trace_blocks,
               constraints, first: Sequence[Layout] = ()) -> Layout | None:
    """A layout of `cluster` that fits memory, or None when none does. Not the fastest:
    the candidates in `first` (as given, when they are candidates), then the others
    smallest static memory bound first, each with full recomputation (the least
    activation memory) and then without it, unless the constraints fix it; the first
    that fits is the answer."""
    fixed, fraction = check_constraints(constraints)
    try:
        candidates = _candidates(model, cluster, example_inputs, fixed)
    except PlanError:
        return None
    candidates, _ = prune_static(candidates, model, cluster, fraction, optimizer)
    estimator = Estimator(model, cluster, example_inputs, loss_fn, optimizer, efficiency,
                          trace_blocks=trace_blocks)
    capacity = cluster.device.memory_bytes * fraction
    variants = [None] if "recompute" in fixed else ["full", "none"]
    # `first` may carry another recomputation than the candidates: match them without it
    base = {lay.replace(recompute="none"): lay for lay in candidates}
    chosen = list(dict.fromkeys(base[key] for key in (lay.replace(recompute="none")
                                                      for lay in first) if key in base))
    picked = set(chosen)
    ordered = chosen + sorted((lay for lay in candidates if lay not in picked),
                              key=_static_bound(model, optimizer))
    for layout in ordered:
        for recompute in variants:
            tried = layout if recompute is None else layout.replace(recompute=recompute)
            try:
                if estimator.memory_floor(tried) > capacity:  # its end ranks alone do not fit
                    continue
                if estimator.predict(tried).peak_memory_bytes <= capacity:
                    return tried
            except ValueError:  # a cut or a placement the model cannot take
                continue
    return None


# -- what the report shows ------------------------------------------------------------------

def details(estimator: Estimator, layout: Layout, cluster: ClusterSpec, eff: Efficiency,
            optimizer: str) -> dict[str, Any]:
    return {"timeline": timeline(estimator, layout, cluster, eff, optimizer),
            "tp_placements": estimator.tp_placements(layout) if layout.tp > 1 else None,
            "layers": estimator.layer_rows(layout)}


def timeline(estimator: Estimator, layout: Layout, cluster: ClusterSpec, eff: Efficiency,
             optimizer: str) -> list[dict[str, Any]]:
    """Predicted spans per pipeline rank: the schedule's actions, then gradient sync and
    optimizer; a whole-graph step as compute, exposed communication, optimizer."""
    summary, stages, _ = estimator.rewritten(layout)
    if stages is None:
        pred = estimator.predict(layout)
        parts = [("compute", pred.breakdown["compute"]),
                 ("exposed comm", pred.breakdown["exposed_comm"]),
                 ("optimizer", pred.breakdown["optimizer"])]
        return _sequence(0, 0.0, parts)
    times = pipeline_time(summary, stages, cluster, layout, optimizer, eff,
                          run_schedule(summary, stages, cluster, layout, eff, spans=True))
    events = []
    for rank, spans in enumerate(times.timeline.spans):
        gather = [("param gather", times.param_gather_s[rank])] if layout.zero else []
        shift = times.param_gather_s[rank] if layout.zero == 3 else 0.0
        events += _sequence(rank, 0.0, gather) if layout.zero == 3 else []
        events += [{"rank": rank, "name": str(a), "kind": a.kind, "start": s + shift,
                    "end": e + shift} for a, s, e in spans]
        end = max((e for _, _, e in spans), default=0.0) + shift
        events += _sequence(rank, end, [("grad sync", times.grad_sync_s[rank]),
                                        ("optimizer", times.optimizer_per_rank_s[rank]),
                                        *(gather if layout.zero in (1, 2) else [])])
    return events


def _sequence(rank: int, start: float, parts: list[tuple[str, float]]) -> list[dict[str, Any]]:
    out = []
    for name, seconds in parts:
        out.append({"rank": rank, "name": name, "kind": name, "start": start,
                    "end": start + seconds})
        start += seconds
    return out
