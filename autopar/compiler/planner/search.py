"""The planner's search: every layout of the cluster's devices, costed, ranked.

`candidate_layouts` enumerates dp x tp x pp = world size with tp inside a node (its
collectives sit on every layer's critical path: they need NVLink, not the network),
pp at most the model's repeated blocks, micro-batches that split the batch evenly,
each schedule (interleaved with 2 virtual stages where blocks allow), ZeRO stages
(dp > 1) and AMP (when the device lists bf16). Keyword constraints fix any Layout
field. Layouts that compile or the cost model refuse are kept aside with the reason
(`Plan.skipped`), never silently dropped.

`search` costs every candidate with a `Costing`'s `predict(layout)` (the Estimator's,
which shares traces and rewritten graphs between candidates), keeps those whose
predicted peak memory fits `max_memory_fraction` of the device, and ranks them by
step time; every other candidate says why it lost (`why_not`). Branch and bound
leaves out, with the figures, a candidate whose lower bound (`Costing.bound`) or whose
step time costed without its memory (`Costing.timed`: a pipeline's memory replays
every rank's schedule) is above the fastest fitting step costed so far: it cannot be
the plan; and so is one whose memory floor (`Costing.memory_floor`: a pipeline's two
end ranks replayed) is over the memory allowed. What the search has learnt is a
`SearchState`; each round of costing, a `CostingRound`.

Recomputation is tried as the candidates are costed (`Costing.variants`,
`recompute_variants`): a layout found over memory is queued again with full
recomputation (first, while nothing fits), and one with full recomputation not found
over memory with selective (it keeps more: it cannot fit where full does not).
Recomputing adds compute, but it also moves collectives in the step (ZeRO-3's
gathers, the gradient reductions) and so can hide more of them: a recomputing
variant's step is bounded below by its layout's step less its exposed communication
(`Costing.compute_floor`: compute, optimizer and a pipeline's bubble), not by that
layout's step. A variant is skipped when that floor is slower than a layout that
fits, and a layout skipped on its step time is still tried recomputing selectively
when its floor is not; so is a layout over memory whose full variant its bound rules
out (selective adds less compute, and whether it fits is not known). Then
`refinements` add layouts worth costing given what was learnt, each round ranked with
the rest: the fastest fitting data-parallel layout with other gradient bucket sizes
(and, for a caller without
`variants`, rounds that retry a layout over memory faster than the fastest fitting
one with full, then selective recomputation: the same plan). A field the user fixed
is never varied.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.passes.batch_split import MEETS
from autopar.compiler.planner.result import Plan, Prediction
from autopar.costs import dp_node_split
from autopar.layout import Layout, LayoutError

GB = 1e9
PARTS = ("compute", "exposed_comm", "bubble", "optimizer")
PART_NAMES = {"compute": "compute", "exposed_comm": "exposed communication",
              "bubble": "pipeline bubble", "optimizer": "optimizer step"}
LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout))
TIMED_ONLY = "its memory not costed"  # in the reason of a layout skipped on its step time
FLOOR_ONLY = "no schedule simulated"  # in the reason of one skipped on its schedule's floor
MEMORY_FLOOR_ONLY = "its other ranks not replayed"  # ... on its end ranks' memory


class PlanArgumentError(ValueError):
    """An argument of plan / estimate the planner cannot take (trace_blocks, workers,
    optimizer, an empty batch): the message names it and what it accepts."""


class PlanError(ValueError):
    """No layout can run the model on the cluster: the message says what would.
    `smallest`: the layouts costed with the smallest predicted peaks, smallest first
    (empty when none could be costed)."""

    def __init__(self, message: str, smallest: Sequence[Layout] = ()) -> None:
        super().__init__(message)
        self.smallest = list(smallest)


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.3g} GB"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_constraints(constraints: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Layout fields the user fixed, and max_memory_fraction (default 0.9)."""
    fixed = dict(constraints)
    fraction = fixed.pop("max_memory_fraction", 0.9)
    unknown = sorted(set(fixed) - set(LAYOUT_FIELDS))
    if unknown:
        raise LayoutError(f"unknown plan constraint(s) {unknown}: constraints are Layout fields "
                          f"({', '.join(LAYOUT_FIELDS)}) or max_memory_fraction")
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise LayoutError(f"max_memory_fraction must be in (0, 1], got {fraction!r}")
    for name, value in fixed.items():  # a bad value fails here, naming its field
        Layout(**{**_CONTEXT.get(name, {}), name: value})
    return fixed, float(fraction)


# fields valid only next to another: checked on their own in such a layout
_CONTEXT = {"zero": {"dp": 2}, "sequence_parallel": {"tp": 2},
            "virtual_stages": {"schedule": "interleaved"}, "allreduce": {"dp": 2},
            "local_sgd": {"dp": 2}, "dgc": {"dp": 2}}


def _schedules(pp: int, blocks: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("gpipe", 1), ("zero-bubble", 1)]
    return out + [("interleaved", 2)] if blocks >= 2 * pp else out


def _options(name: str, default: list, fixed: dict[str, Any]) -> list:
    return [fixed[name]] if name in fixed else default


def candidate_layouts(cluster: ClusterSpec, batch: int | None, blocks: int,
                      fixed: dict[str, Any]) -> list[Layout]:
    """Every layout the search costs (see the module docstring), constraints applied.
    Micro-batches (`_micro_batch_counts`; each size is a trace of its own: fix
    `microbatches` to try another): without a pipeline 1, 2 and micro-batches of one
    sequence (gradient accumulation); with one pp, 2 pp and micro-batches of one
    sequence."""
    world = cluster.world_size
    amps = ["off", "bf16"] if "bf16" in cluster.device.peak_flops else ["off"]
    out: dict[Layout, None] = {}  # ordered, and a membership test that does not scan
    for tp in _options("tp", divisors(min(world, cluster.devices_per_node)), fixed):
        pps = [p for p in divisors(world // tp) if p <= max(blocks, 1)] if world % tp == 0 else []
        for pp in _options("pp", pps, fixed):
            dp = world // tp // pp
            if dp * tp * pp != world:
                continue
            micro = _options("microbatches", _micro_batch_counts(pp, dp, batch), fixed)
            for m, (sched, vs), zero, amp in itertools.product(
                    [m for m in micro if batch is None or batch % (dp * m) == 0],
                    _schedules(pp, blocks), _options("zero", [0, 1, 2, 3] if dp > 1 else [0], fixed),
                    _options("amp", amps, fixed)):
                if sched == "interleaved" and m % pp:
                    continue
                fields = {"dp": dp, "tp": tp, "pp": pp, "microbatches": m, "schedule": sched,
                          "virtual_stages": vs, "zero": zero, "amp": amp}
                layout = _constrained(fields, fixed)
                if layout is not None:
                    out.setdefault(layout)
    return list(out)


# sequences per micro-batch a pipeline is also tried with (Megatron-LM's
# --micro-batch-size; 1 in its published runs): the smallest bubble and the fewest
# activations in flight. Each size is a trace and rewrites of its own: 2, 4 and 8 as
# well doubled the planning time of Megatron's 1.7B row (24 s to 52 s) for the same plan
MICRO_BATCH_SIZES = (1,)


def _micro_batch_counts(pp: int, dp: int, batch: int | None) -> list[int]:
    """Micro-batch counts tried for a pipeline of `pp` stages (gradient accumulation when
    pp is 1): pp and 2 pp, and those giving each micro-batch MICRO_BATCH_SIZES sequences
    of a rank's share (at least pp of them). Without a pipeline 1 and 2 share the traces
    of dp and 2 dp, whose rank's share is the same micro-batch; accumulating only saves
    activations, so the bounds leave it out wherever one micro-batch fits."""
    if pp == 1 and batch is None:  # no batch dimension to split
        return [1]
    counts = [1, 2] if pp == 1 else [pp, 2 * pp]
    if batch is not None and batch % dp == 0:
        share = batch // dp
        counts += [share // size for size in MICRO_BATCH_SIZES
                   if share % size == 0 and share // size >= pp]
    return sorted(set(counts))


def _constrained(fields: dict[str, Any], fixed: dict[str, Any]) -> Layout | None:
    """The candidate with the fixed fields, or None when it contradicts them."""
    if any(fields.get(k, v) != v for k, v in fixed.items() if k in fields):
        return None
    try:
        return Layout(**{**fields, **fixed})
    except LayoutError:
        return None


def why_not(pred: Prediction, best: Prediction, capacity: float) -> str:
    """An alternative's reason to lose: over memory, or slower by how much and where."""
    if pred.peak_memory_bytes > capacity:
        return (f"does not fit: {_gb(pred.peak_memory_bytes)} per device (the fullest "
                f"rank) over the {_gb(capacity)} allowed, by "
                f"{_gb(pred.peak_memory_bytes - capacity)}")
    slower = pred.step_time_s - best.step_time_s
    if slower <= 0:
        return "as fast as the chosen layout (ties go to the earlier candidate: less tp and pp)"
    deltas = {p: pred.breakdown.get(p, 0.0) - best.breakdown.get(p, 0.0) for p in PARTS}
    worst = max(deltas, key=deltas.__getitem__)
    return (f"slower by {slower / best.step_time_s:.1%} (+{slower * 1e3:.3g} ms), mostly "
            f"{PART_NAMES[worst]} (+{deltas[worst] * 1e3:.3g} ms)")


def rank(costed: list[tuple[Layout, Prediction]], capacity: float
         ) -> tuple[list[tuple[Layout, Prediction]], list[tuple[Layout, Prediction]]]:
    """(fitting layouts fastest first, the others smallest peak memory first); sorting
    is stable, so ties keep the candidates' order."""
    fits = [c for c in costed if c[1].peak_memory_bytes <= capacity]
    over = [c for c in costed if c[1].peak_memory_bytes > capacity]
    return (sorted(fits, key=lambda c: c[1].step_time_s),
            sorted(over, key=lambda c: c[1].peak_memory_bytes))


BUCKET_MB_CHOICES = (5.0, 25.0, 100.0)
# the averaging period a plan allowed Local SGD tries (plan(allow=["local_sgd"])): a longer
# one always costs less, and what it does to convergence is not modelled, so the planner
# does not choose it; fix Layout.local_sgd to try another
LOCAL_SGD_PERIOD = 4
# the final sparsity a plan allowed DGC tries (plan(allow=["dgc"])): the paper's, which
# its accuracy results are for; fix Layout.dgc to try another
DGC_SPARSITY = 0.999
# techniques that change what training converges to: plan(allow=...) names those it may use
ALLOWABLE = ("local_sgd", "dgc")
# the fastest fitting layouts the hierarchical all-reduce (and Local SGD) is tried on: it changes only the
# gradients' sum, so it can reorder close layouts but not lift a slow one to the top
HIERARCHICAL_TRIED = 3


def _two_levels(layout: Layout, cluster: ClusterSpec) -> bool:
    """Whether `layout` could sum its gradients in two levels on `cluster` (a flat
    data-parallel layout whose dp groups span whole nodes, several ranks each)."""
    if layout.allreduce != "flat" or layout.dp == 1 or layout.dgc is not None:
        return False
    try:
        dp_node_split(layout, cluster)
    except LayoutError:
        return False
    return True

Refinement = Callable[[list[tuple[Layout, Prediction]], float], list[Layout]]


def _worth_recomputing(costed, capacity, among: Callable[[Layout], bool] = lambda lay: True
                       ) -> list[Layout]:
    """Layouts over memory that recomputation could make the plan (of those `among`
    keeps): without it, their step less its exposed communication is below the fastest
    step that fits (Costing.compute_floor), or nothing fits (their step times are not asked then:
    _OverMemory)."""
    fits = [p.step_time_s for _, p in costed if p.peak_memory_bytes <= capacity]
    best = min(fits, default=math.inf)
    return [lay for lay, p in costed if p.peak_memory_bytes > capacity
            and lay.recompute == "none" and among(lay) and _faster(p, best)]


def _faster(p, seconds: float) -> bool:
    if seconds == math.inf:
        return True
    if isinstance(p, _OverMemory):
        return p.faster_than(seconds)
    return p.compute_floor_s < seconds


class _OverMemory:
    """What the refinements read of a layout skipped on its memory floor (over the
    memory allowed): that floor as its peak, its step time (costed without its memory,
    once), and whether recomputing it could beat a time, asked of its bound first and
    then of its compute floor (Costing.compute_floor)."""

    def __init__(self, layout: Layout, floor: float, step_time: Callable[[Layout], float],
                 bound: Callable[[Layout], float] | None,
                 compute_floor: Callable[[Layout], float] | None = None):
        self.layout, self.peak_memory_bytes = layout, floor
        self._step_time, self._bound = step_time, bound
        self._compute_floor = compute_floor or step_time

    def faster_than(self, seconds: float) -> bool:
        if self._bound is not None and self._bound(self.layout) >= seconds:
            return False
        return self._compute_floor(self.layout) < seconds

    @functools.cached_property
    def step_time_s(self) -> float:
        return self._step_time(self.layout)


def _with_full_recompute(costed, capacity) -> list[Layout]:
    return [lay.replace(recompute="full") for lay in _worth_recomputing(costed, capacity)]


def _with_selective_recompute(costed, capacity) -> list[Layout]:
    """Selective keeps more than full: not worth trying where full is over memory. (Where
    full was not costed, skipped on its step time, it may fit, and selective, faster,
    may be the plan: tried, so that branch and bound does not change the plan.)"""
    over_full = {lay.replace(recompute="none") for lay, p in costed
                 if lay.recompute == "full" and p.peak_memory_bytes > capacity}
    return [lay.replace(recompute="selective")
            for lay in _worth_recomputing(costed, capacity, lambda lay: lay not in over_full)]


def recompute_variants(fixed: dict[str, Any]
                       ) -> Callable[[Layout, bool | None], list[Layout]] | None:
    """`search`'s `variants`: a layout found over memory is tried with full recomputation,
    and one with full recomputation not found over memory with selective recomputation
    (it keeps more: not worth trying where full does not fit). None when the user fixed
    `recompute`."""
    if "recompute" in fixed:
        return None

    def variants(layout: Layout, over: bool | None) -> list[Layout]:
        if layout.recompute == "none" and over:
            return [layout.replace(recompute="full")]
        if layout.recompute == "full" and not over:
            return [layout.replace(recompute="selective")]
        return []
    return variants


def refinements(fixed: dict[str, Any], recompute: bool = True,
                cluster: ClusterSpec | None = None, allow: Sequence[str] = ()) -> list[Refinement]:
    """The rounds of layouts `search` costs after the candidates (module docstring);
    without the recomputation rounds when `recompute` is False (`recompute_variants`
    tries them as it goes); with `cluster`, the hierarchical all-reduce of the fastest
    fitting data-parallel layouts where the cluster has two levels to sum over; with
    "local_sgd" in `allow`, Local SGD of those layouts (period LOCAL_SGD_PERIOD); with
    "dgc", DGC of them (final sparsity DGC_SPARSITY; the plan's optimizer is SGD with
    momentum, plan.check_allow)."""
    rounds: list[Refinement] = []
    if "recompute" not in fixed and recompute:
        rounds += [_with_full_recompute, _with_selective_recompute]
    if "allreduce" not in fixed and cluster is not None and cluster.nodes > 1:
        def hierarchical(costed, capacity):
            fits = [lay for lay, _ in rank(costed, capacity)[0] if _two_levels(lay, cluster)]
            return [lay.replace(allreduce="hierarchical") for lay in fits[:HIERARCHICAL_TRIED]]
        rounds.append(hierarchical)
    if "local_sgd" in allow and "local_sgd" not in fixed:
        def local(costed, capacity):
            fits = [lay for lay, _ in rank(costed, capacity)[0] if lay.local_sgd is None
                    and lay.dgc is None and lay.dp > 1]
            return [lay.replace(local_sgd=LOCAL_SGD_PERIOD, zero=0, allreduce="flat")
                    for lay in fits[:HIERARCHICAL_TRIED]]
        rounds.append(local)
    if "dgc" in allow and "dgc" not in fixed:
        def compressed(costed, capacity):
            fits = [lay for lay, _ in rank(costed, capacity)[0] if lay.dgc is None
                    and lay.local_sgd is None and lay.dp > 1 and lay.amp != "fp16"]
            return [lay.replace(dgc=DGC_SPARSITY, zero=0, allreduce="flat")
                    for lay in fits[:HIERARCHICAL_TRIED]]
        rounds.append(compressed)
    if "bucket_mb" not in fixed:
        def buckets(costed, capacity):
            fits = rank(costed, capacity)[0]
            if not fits or fits[0][0].dp == 1 or fits[0][0].pp > 1 or fits[0][0].microbatches > 1 \
                    or fits[0][0].local_sgd is not None or fits[0][0].dgc is not None:
                return []  # the pipeline runtime all-reduces its gradients flat; Local SGD
                #            and DGC have no buckets
            best = fits[0][0]
            return [best.replace(bucket_mb=mb) for mb in BUCKET_MB_CHOICES if mb != best.bucket_mb]
        rounds.append(buckets)
    return rounds


# schedules with the least fill and drain first: a fast pipeline costed early lets the
# bounds leave out more of the slower ones
_SCHEDULE_ORDER = {"zero-bubble": 0, "interleaved": 1, "1f1b": 2, "gpipe": 3}


def costing_order(layout: Layout) -> tuple[bool, int]:
    """Among layouts of equal bound, the order they are costed in: unpipelined ones first
    (the pipelines' bounds come from them: plan.compute_bound), then by schedule. Only
    the order of costing: ranking ties still go to the earlier candidate."""
    pipelined = layout.pp > 1 or layout.microbatches > 1
    return pipelined, _SCHEDULE_ORDER.get(layout.schedule, len(_SCHEDULE_ORDER))


@dataclass(frozen=True)
class Costing:
    """What `search` may ask of a layout. Only `predict` is needed: each other question
    is cheaper, and lets the search leave out, with the figures, a layout that cannot
    be the plan (branch and bound: the plan is the same) or settle it sooner."""

    # the layout's Prediction; a ValueError skips the layout with its message
    predict: Callable[[Layout], Prediction]
    # seconds its step cannot beat (planner/plan.py): layouts are costed lowest bound
    # first (then costing_order), and one whose bound, asked again just before it is
    # costed (it may tighten as layouts are costed), exceeds the fastest fitting step
    # costed so far is skipped with that reason
    bound: Callable[[Layout], float] | None = None
    # bytes its peak cannot be below (memory.static_lower_bound): a layout whose bound is
    # over the memory allowed and above the smallest peak costed so far is skipped, as it
    # can neither be the plan nor the smallest peak a PlanError names (give the
    # candidates smallest bound first for this to prune)
    memory_bound: Callable[[Layout], float] | None = None
    # called before a layout the bounds did not rule out is costed (the planner rewrites
    # its pipeline template there); its bound is then asked once more
    prepare: Callable[[Layout], None] | None = None
    # whether `prepare` has nothing left to do; where it has, a layout that recomputes is
    # first skipped if the same layout without recomputation, found over memory before,
    # has a compute floor slower than the fastest fitting step (cheaper to ask than a
    # rewrite)
    prepared: Callable[[Layout], bool] | None = None
    # seconds of a layout's step that its collectives' placement does not change: the
    # step less its exposed communication (compute, optimizer and a pipeline's bubble, its
    # critical rank's), which recomputing only adds to. The same layout recomputing
    # cannot be faster than that; faster than its step it can be, as the
    # recomputed ops move collectives and hide more of them. Without it, the layout's
    # step time stands in (an unsound floor where recomputation hides communication)
    compute_floor: Callable[[Layout], float] | None = None
    # the step time `predict` would give, without costing the memory (cheaper): a layout
    # slower than the fastest fitting one costed so far cannot be the plan whatever its
    # memory, and is skipped with both figures
    timed: Callable[[Layout], float] | None = None
    # seconds below that step time, cheaper still (a pipeline's busiest rank without its
    # schedule simulated); asked before `timed`, a layout whose floor is above the
    # fastest fitting step is skipped with both figures
    floor: Callable[[Layout], float] | None = None
    # bytes below its predicted peak, cheaper than `predict` (a pipeline's first and last
    # ranks replayed); a layout whose floor is over the memory allowed cannot be the plan
    # and is skipped with the figure. The refinements still see it as over memory (and
    # its step time, when they ask for it: `timed`); if nothing fits in the end, those
    # skipped are costed smallest floor first while a floor is below the smallest peak
    # costed, so that the PlanError names the smallest peak as without the floors
    memory_floor: Callable[[Layout], float] | None = None
    # layouts to cost once a candidate (or one of its variants) is found over memory
    # (over=True: by its prediction or its memory floor), fitting (False) or slower than
    # the fastest fitting step so far (None: its memory unknown; its recomputing
    # variants are then queued if its compute floor is not slower). `recompute_variants`
    # gives the same layout recomputing, where the recomputation rounds would add it only
    # if the layout is faster than the fastest fitting step. While nothing fits the variants are
    # costed first, so that a fitting step, which the bounds prune against, is known
    # early; a variant whose bound is already above it is not tried
    variants: Callable[[Layout, bool | None], Iterable[Layout]] | None = None


class TieOrder:
    """The order ties rank in: the candidates in their order, then the same layouts
    recomputing fully, then selectively (in their candidates' order, whether `variants`
    or a refinement added them), then the other refinements' layouts as added."""

    def __init__(self, candidates: list[Layout]) -> None:
        self._rank = {lay: (0, k) for k, lay in enumerate(candidates)}

    def add(self, layout: Layout) -> None:
        base = self._rank.get(layout.replace(recompute="none"), (1, 0))
        if base[0] == 0 and layout.recompute in ("full", "selective"):
            self._rank.setdefault(layout, (1 if layout.recompute == "full" else 2, base[1]))
        else:
            self._rank.setdefault(layout, (3, len(self._rank)))

    def of(self, item: tuple[Layout, Any]) -> tuple[int, int]:
        """The rank of the layout of a (layout, ...) pair."""
        return self._rank[item[0]]


@dataclass
class SearchState:
    """What the search has learnt so far, and the questions it answers from it."""

    costing: Costing
    capacity: float  # the memory allowed per device
    ties: TieOrder
    costed: list[tuple[Layout, Prediction]] = field(default_factory=list)
    skipped: list[tuple[Layout, str]] = field(default_factory=list)
    best: float = math.inf  # the fastest fitting step so far
    smallest: float = math.inf  # the smallest peak so far
    over_memory: dict[Layout, _OverMemory] = field(default_factory=dict)  # on memory_floor
    times: dict[Layout, float] = field(default_factory=dict)  # `timed`'s, asked again later
    predicted: dict[Layout, Prediction] = field(default_factory=dict)

    def compute_floor(self, layout: Layout) -> float:
        """What the same layout recomputing cannot beat (Costing.compute_floor)."""
        floor = self.costing.compute_floor
        return self.step_time(layout) if floor is None else floor(layout)

    def step_time(self, layout: Layout) -> float:
        if layout in self.predicted:
            return self.predicted[layout].step_time_s
        if layout not in self.times:
            timed = self.costing.timed
            self.times[layout] = timed(layout) if timed is not None \
                else self.costing.predict(layout).step_time_s
        return self.times[layout]

    def over_best(self, layout: Layout, seconds: float, what: str) -> bool:
        """Skip `layout` (recorded with why: `what` takes `seconds`) if `seconds` is above
        the fastest fitting step costed so far."""
        if seconds > self.best:
            self.skipped.append((layout, f"not costed: {what.format(ms=f'{seconds * 1e3:.4g}')}, "
                                         f"slower than the fastest fitting layout costed "
                                         f"({self.best * 1e3:.4g} ms)"))
        return seconds > self.best

    def bounded(self, layout: Layout) -> bool:
        bound = self.costing.bound
        least = bound(layout) if bound is not None and self.best < math.inf else 0.0
        return self.over_best(layout, least, "it cannot take less than {ms} ms (plan.compute_bound)")

    def record(self, layout: Layout, pred: Prediction) -> None:
        self.costed.append((layout, pred))
        self.predicted[layout] = pred
        self.smallest = min(self.smallest, pred.peak_memory_bytes)
        if pred.peak_memory_bytes <= self.capacity:
            self.best = min(self.best, pred.step_time_s)

    def known(self) -> list[tuple[Layout, Any]]:
        """What the refinements read, in the candidates' order (and so what they add: its
        order ranks ties), those left out on their memory floor among them."""
        return sorted([*self.costed, *self.over_memory.items()], key=self.ties.of)

    def drop_batch_splits(self) -> None:
        """Where a layout was refused because samples of different shards meet (the
        model's code, whatever the layout), drop every layout that splits the batch: a
        shard of one sample that does not export at two samples is not checked
        (batch_split.py), so it may have been costed."""
        refused = next((why for _, why in self.skipped if MEETS in why), None)
        if refused is None:
            return
        splits = lambda lay: lay.dp * lay.microbatches > 1  # noqa: E731
        dropped = [lay for lay, _ in self.costed if splits(lay)]
        dropped += [lay for lay in self.over_memory if splits(lay)]
        self.costed[:] = [(lay, pred) for lay, pred in self.costed if not splits(lay)]
        for lay in [lay for lay in self.over_memory if splits(lay)]:
            del self.over_memory[lay]
        self.skipped.extend((lay, refused) for lay in dropped)

    def revive_over_memory(self) -> None:
        """Cost the layouts left out on their memory floor, smallest floor first, while a
        floor is below the smallest peak costed: when nothing fits, the error names the
        smallest peak, which may be one of theirs."""
        revived, refused = set(), []
        for layout, o in sorted(self.over_memory.items(),
                                key=lambda item: item[1].peak_memory_bytes):
            if o.peak_memory_bytes > self.smallest:
                break
            revived.add(layout)
            try:
                pred = self.costing.predict(layout)
            except ValueError as exc:
                refused.append((layout, str(exc).splitlines()[0]))
                continue
            self.record(layout, pred)
        self.skipped[:] = [s for s in self.skipped if s[0] not in revived] + refused
        self.costed.sort(key=self.ties.of)


class CostingRound:
    """One round of costing: `layouts` lowest bound first (then `costing_order`; as given
    without a bound: a memory bound prunes them smallest first). The candidates' round
    shows progress and queues `variants` as layouts are found over memory."""

    def __init__(self, state: SearchState, layouts: Iterable[Layout],
                 candidates_round: bool) -> None:
        self.state = state
        self.seen = {lay for lay, _ in state.costed} | {lay for lay, _ in state.skipped}
        self.varies = candidates_round and state.costing.variants is not None
        # (early, *order, pushed, layout): variants pushed while nothing fits come first;
        # then by `_order`, ties in the order pushed
        self.queue = [(1, *self._order(lay), k, lay) for k, lay in enumerate(layouts)
                      if lay not in self.seen]
        heapq.heapify(self.queue)
        self.pushed = itertools.count(len(self.queue))
        self.shown = {lay for *_, lay in self.queue} if candidates_round else set()

    def _order(self, layout: Layout) -> tuple:
        bound = self.state.costing.bound
        return (bound(layout), *costing_order(layout)) if bound is not None else ()

    def run(self, progress: Callable[[Layout], None] | None = None) -> None:
        while self.queue:
            layout = heapq.heappop(self.queue)[-1]
            if layout in self.seen:
                continue
            self.seen.add(layout)
            if progress is not None and layout in self.shown:
                progress(layout)
            self._cost(layout)
        # ties rank in the candidates' order, then the refinements', whatever order they
        # were costed in
        self.state.costed.sort(key=self.state.ties.of)

    def _cost(self, layout: Layout) -> None:
        """Cost `layout`, unless a cheaper question settles it (Costing)."""
        state, costing = self.state, self.state.costing
        if state.bounded(layout) or self._slower_unrecomputed(layout):
            self._vary(layout, None)
            return
        if self._over_memory_bound(layout):
            return
        if costing.prepare is not None and costing.bound is not None and state.best < math.inf:
            costing.prepare(layout)
            if state.bounded(layout):
                self._vary(layout, None)
                return
        try:
            if self._settled_unpredicted(layout):
                return
            pred = costing.predict(layout)
        except ValueError as exc:  # a cut or a tp placement the model cannot take
            state.skipped.append((layout, str(exc).splitlines()[0]))
            return
        state.record(layout, pred)
        self._vary(layout, pred.peak_memory_bytes > state.capacity)

    def _settled_unpredicted(self, layout: Layout) -> bool:
        """Whether `layout` is skipped on its memory floor or its step time: the memory
        floor first once a layout was found over memory (memory is short: it settles
        most), the step time first while none was."""
        if self.state.over_memory:
            return self._over_memory_floor(layout) or self._slower(layout)
        return self._slower(layout) or self._over_memory_floor(layout)

    def _slower_unrecomputed(self, layout: Layout) -> bool:
        """Skip a layout that recomputes, before `prepare` rewrites for it, when the same
        layout without recomputation, found over memory (or costed), has a compute floor
        slower than the fastest fitting step (Costing.compute_floor)."""
        state, prepared = self.state, self.state.costing.prepared
        if layout.recompute == "none" or state.best == math.inf:
            return False
        base = layout.replace(recompute="none")
        if not (base in state.over_memory or base in state.predicted) or prepared is None \
                or prepared(layout):
            return False
        return state.over_best(layout, state.compute_floor(base),
                               "without recomputation its step less its exposed "
                               "communication takes {ms} ms")

    def _over_memory_bound(self, layout: Layout) -> bool:
        state, memory_bound = self.state, self.state.costing.memory_bound
        held = memory_bound(layout) if memory_bound is not None else 0.0
        if held > state.capacity and held > state.smallest:
            state.skipped.append((layout, f"not costed: at least {_gb(held)} per device, over "
                                          f"the {_gb(state.capacity)} allowed and above the "
                                          f"smallest peak costed ({_gb(state.smallest)})"))
            return True
        return False

    def _over_memory_floor(self, layout: Layout) -> bool:
        state, costing = self.state, self.state.costing
        held = costing.memory_floor(layout) if costing.memory_floor is not None else 0.0
        if held <= state.capacity:
            return False
        state.skipped.append((layout, f"not costed: its first and last pipeline ranks alone "
                                      f"need at least {_gb(held)} per device, over the "
                                      f"{_gb(state.capacity)} allowed ({MEMORY_FLOOR_ONLY})"))
        state.over_memory[layout] = _OverMemory(layout, held, state.step_time, costing.bound,
                                                state.compute_floor)
        self._vary(layout, True)
        return True

    def _slower(self, layout: Layout) -> bool:
        state, costing = self.state, self.state.costing
        if costing.timed is None or state.best == math.inf:
            return False
        if not ((costing.floor is not None and state.over_best(
                    layout, costing.floor(layout),
                    f"its busiest pipeline rank alone takes {{ms}} ms ({FLOOR_ONLY})"))
                or state.over_best(layout, state.step_time(layout),
                                   f"its step takes {{ms}} ms ({TIMED_ONLY})")):
            return False
        self._vary(layout, None)
        # timed (not left out on its pipeline floor): recomputing selectively, the least
        # compute added, may hide enough of its communication to be the plan. Its full
        # variant (which adds a forward) is not queued, only what `variants` gives for it
        # as not over memory: the selective one
        if self.varies and layout.recompute == "none" and layout in state.times \
                and state.compute_floor(layout) <= state.best:
            for full in costing.variants(layout, True):
                self._vary(full, False)
        return True

    def _vary(self, layout: Layout, over: bool | None) -> None:
        """Queue `layout`'s variants (Costing.variants, as found `over` memory or not),
        those a bound does not rule out; among ties they rank in the order they are
        added."""
        if not self.varies:
            return
        state = self.state
        for more in state.costing.variants(layout, over):
            if more in self.seen:
                continue
            order = self._order(more)
            if state.costing.bound is not None and order[0] > state.best:
                # ruled out by its bound, as `_cost` would rule it out: what `_cost` then
                # queues for it is still worth its own bound (full recomputation too slow
                # says nothing of selective, which adds less: its memory is not known)
                self._vary(more, None)
                continue
            state.ties.add(more)
            heapq.heappush(self.queue, (0 if state.best == math.inf else 1, *order,
                                        next(self.pushed), more))


def search(candidates: Iterable[Layout], costing: Costing, cluster: ClusterSpec,
           max_memory_fraction: float = 0.9,
           progress: Callable[[Layout], None] | None = None,
           refine: Iterable[Refinement] = ()) -> Plan:
    """Cost every candidate, then each round of `refine`; keep the fastest that fits
    (module docstring; Costing says what each of its questions leaves out)."""
    capacity = cluster.device.memory_bytes * max_memory_fraction
    candidates = list(candidates)
    state = SearchState(costing, capacity, TieOrder(candidates))
    CostingRound(state, candidates, candidates_round=True).run(progress)
    for more in refine:
        added = more(state.known(), capacity)
        for layout in added:
            state.ties.add(layout)
        CostingRound(state, added, candidates_round=False).run()
    state.drop_batch_splits()
    fits, over = rank(state.costed, capacity)
    if not fits and state.over_memory:
        state.revive_over_memory()
        fits, over = rank(state.costed, capacity)
    if not fits:
        raise PlanError(no_fit_message(over, state.skipped, cluster, max_memory_fraction),
                        smallest=[lay for lay, _ in over])
    best_layout, best_pred = fits[0]
    alternatives = [(lay, pred, why_not(pred, best_pred, capacity))
                    for lay, pred in fits[1:] + over]
    return Plan(layout=best_layout, predicted=best_pred, alternatives=alternatives,
                skipped=state.skipped, cluster=cluster.to_dict(),
                max_memory_fraction=max_memory_fraction)


def no_fit_message(over: list[tuple[Layout, Prediction]], skipped: list, cluster: ClusterSpec,
                   fraction: float) -> str:
    if not over:
        reasons = "; ".join(f"{lay}: {why}" for lay, why in skipped[:3])
        return (f"no layout of {cluster.world_size} devices could be costed ({len(skipped)} "
                f"refused, e.g. {reasons}); relax the constraints")
    layout, pred = over[0]
    need = pred.peak_memory_bytes / fraction
    more = need / cluster.device.memory_bytes
    return (f"the model fits no layout on {cluster.describe()}: the smallest predicted peak is "
            f"{_gb(pred.peak_memory_bytes)} per device ({layout}), over "
            f"{fraction:.0%} of {_gb(cluster.device.memory_bytes)}. It would fit devices "
            f"of at least {_gb(need)} (x{more:.2f} this one's memory), or a larger "
            f"max_memory_fraction")
