"""autopar.estimate: the predicted step time and memory of a model under one Layout.

Traces one data-parallel rank's share of the batch (the model may live on the meta
device, the inputs may be meta tensors: nothing is allocated), runs the same passes
`autopar.compile` would run, and costs the rewritten graph (cost_model.py).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import MemoryPrediction
from autopar.compiler.analysis.summary import GraphSummary, summarize
from autopar.compiler.ir.batch import Batch, LossFn, Objective
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.trace import batch_dims_of, local_example, trace_train_step
from autopar.compiler.passes.assign_stages import check_stage_count
from autopar.compiler.passes.base import GraphPass
from autopar.compiler.passes.defaults import (
    default_passes,
    forward_level_fields,
    forward_level_passes,
    is_pipelined,
    retrace_fields,
    run_passes,
)
from autopar.compiler.planner.cost_model import layer_costs
from autopar.compiler.planner.pipeline_cost import (
    ScheduleRun,
    StagePhases,
    p2p_time,
    run_schedule,
    schedule_floor,
    stage_phases,
)
from autopar.compiler.planner.pipeline_memory import pipeline_memory_per_rank
from autopar.compiler.planner.predict import predict, step_times
from autopar.compiler.planner.replicated import (
    TEMPLATE_BLOCKS,
    Template,
    block_work_floor,
    first_rank_saved_floor,
    pipeline_memory_from_summary,
    replicate,
    stage_programs,
    template_of,
)
from autopar.compiler.planner.result import Prediction
from autopar.compiler.planner.scaled import multiplicities, reduced, scale_summary
from autopar.compiler.planner.stages import StageSummary, stage_summary
from autopar.compiler.planner.workers import RewriteWorker, child_groups, firsts
from autopar.costs import DEFAULT_EFFICIENCY, OPTIMIZER_STATES, Efficiency
from autopar.layout import Layout, LayoutError

RUNS_KEPT = 64  # Estimator._schedule_run: the search times ZeRO siblings close together


def estimate(model: torch.nn.Module, cluster: ClusterSpec, layout: Layout,
             example_inputs: Batch, loss_fn: LossFn | None = None,
             optimizer: str = "adamw", efficiency: Efficiency = DEFAULT_EFFICIENCY,
             passes: Sequence[GraphPass | str] | None = None,
             example_targets: Batch | None = None) -> Prediction:
    """Predict one training step of `model` on `cluster` under `layout`.

    `example_inputs` (and `example_targets`) is one global batch, as `autopar.compile`
    takes it. `optimizer` is the optimizer's kind for the
    memory and time of its step: "adamw", "adam", "sgd-momentum" or "sgd". `passes`
    replaces the default pass list, to score your own passes.
    """
    check_layout(layout, cluster)
    objective, flat = Objective.from_example(example_inputs, example_targets, loss_fn)
    return Estimator(model, cluster, flat, objective, optimizer, efficiency,
                     passes).predict(layout)


class Estimator:
    """Predictions of one model on one cluster under many layouts (the planner's
    inner loop). A trace is shared by the layouts with the same micro-batch per rank,
    and a rewritten graph by those the passes treat alike (schedules, micro-batch
    counts of one size): what `predict` costs is exactly what `estimate` would."""

    def __init__(self, model: torch.nn.Module, cluster: ClusterSpec,
                 example_inputs: Sequence[torch.Tensor], loss_fn: LossFn | None = None,
                 optimizer: str = "adamw", efficiency: Efficiency = DEFAULT_EFFICIENCY,
                 passes: Sequence[GraphPass | str] | None = None,
                 trace_blocks: int | None = None) -> None:
        if optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, "
                             f"got {optimizer!r}")
        self.example_inputs = tuple(example_inputs)
        if not self.example_inputs:
            raise ValueError("estimate needs example_inputs: one global batch (meta tensors "
                             "will do)")
        self.model, self.cluster, self.loss_fn = model, cluster, loss_fn
        self.optimizer, self.efficiency, self.passes = optimizer, efficiency, passes
        if trace_blocks is not None and (not isinstance(trace_blocks, int) or trace_blocks < 1):
            raise ValueError(f"trace_blocks must be a positive integer or None, got {trace_blocks!r}")
        self.trace_blocks = trace_blocks  # planner/scaled.py: trace a few blocks, scale
        self._traced: dict[tuple, tuple] = {}
        self._trace_keys: dict[Layout, tuple] = {}  # _trace_key's
        self._keys: dict[Layout, tuple] = {}  # _key's
        self._rewritten: dict[tuple, tuple] = {}
        self._tables: dict[tuple, dict] = {}
        self._replicas: dict[tuple, tuple] = {}
        self._timing_replicas: dict[tuple, tuple] = {}  # rewritten(timing=True)'s
        self._timing_programs: dict[tuple, tuple] = {}  # memory_floor's: (programs, replays)
        self._kind_programs: dict[tuple, dict] = {}  # stage_programs' `shared`, per template
        self._forward: dict[tuple, TrainGraph] = {}  # graphs after the forward-level passes
        self._predictions: dict[Layout, Prediction] = {}
        self._last_times: tuple = (None, None)  # (layout, its step_times): predict's next
        self._schedules: dict[Layout, float] = {}  # schedule_time of the layouts timed
        self._runs: dict[tuple, ScheduleRun] = {}  # _schedule_run's
        self._phases: dict[tuple, StagePhases] = {}  # _stage_phases'
        # pipeline templates' floors by the fields their passes read:
        # [(micro-batch size, sends across a boundary, one block's work)]
        self._templates: dict[Layout, list[tuple[float, tuple, float]]] = {}
        self.workers: dict[tuple, RewriteWorker] = {}  # group -> its worker (start_workers)

    def predict(self, layout: Layout) -> Prediction:
        """The Prediction of `layout`, kept: a search that asks again (the no-fit
        fallback, the report) gets the same object."""
        if layout not in self._predictions:
            # a template's replica with one stage of each kind: its step and every rank's
            # memory are the whole replica's (tests/unit/test_replicated.py)
            summary, stages, model_flops = self.rewritten(layout, timing=True)
            self._predictions[layout] = predict(
                summary, self.cluster, layout, self.optimizer, self.efficiency,
                model_flops=model_flops, stages=stages,
                memory=self._pipeline_memory(layout, summary, stages),
                times=self._step_times(layout, summary, stages),
                compute_dtype=summary.compute_dtype(
                    None if stages is None else stages.op_copies()))
        return self._predictions[layout]

    def step_time(self, layout: Layout) -> float:
        """The predicted step time of `layout`, as `predict` gives it, without costing its
        memory (a pipeline's memory replays every rank's schedule: the search asks this
        first, and costs the memory only of a layout that could be the plan)."""
        if layout in self._predictions:
            return self._predictions[layout].step_time_s
        summary, stages, _ = self.rewritten(layout, timing=True)
        return self._step_times(layout, summary, stages).total_s

    def _step_times(self, layout: Layout, summary: GraphSummary, stages: StageSummary | None):
        """step_times of `layout`; the last one is kept (the search asks step_time, then
        predict, of one layout; a pipeline's times hold its whole timeline)."""
        if self._last_times[0] != layout:
            run = None if stages is None else self._schedule_run(layout, summary, stages)
            times = step_times(summary, self.cluster, layout, self.optimizer, self.efficiency,
                               stages, run)
            self._last_times = (layout, times)
            self._schedules[layout] = times.compute_s + times.bubble_s
        return self._last_times[1]

    def _pipeline_memory(self, layout, summary, stages) -> MemoryPrediction | None:
        """The fullest pipeline rank's memory, each rank's schedule replayed (None: the
        unpipelined step's, as for one stage traced with a few blocks)."""
        if stages is None:
            return None
        key = self._key(layout)
        graph, template = self._rewritten[key][2:]
        if template is not None:  # planner/replicated.py: the stages' summaries replayed
            programs, replays = self._programs(key, self._stages(layout), summary, stages)
            ranks = pipeline_memory_from_summary(summary, stages, layout, self.optimizer,
                                                 programs, replays)
        elif graph is not None:
            ranks = pipeline_memory_per_rank(graph, layout, self.optimizer,
                                             fallbacks=self.cluster.device.kind == "cpu")
        else:
            return None
        return max(ranks, key=lambda m: m.peak_bytes)

    def step_model_flops(self, layout: Layout) -> int:
        """Model FLOPs of one training step of the global batch (all ranks) under `layout`,
        from the trace of its micro-batch (scaled to the whole stack with trace_blocks)."""
        return self._trace(layout)[2] * layout.dp * layout.microbatches

    def most_shared(self, layouts: Sequence[Layout]) -> Layout:
        """The first of `layouts` whose trace the most of them share: what to trace first
        when any trace will do (the FLOP count, the parameters an embedding reads), so
        that the search reuses it (a fork's workers inherit it), rather than a micro-batch
        size it may never cost."""
        counts = Counter(self._trace_key(layout) for layout in layouts)
        return max(layouts, key=lambda layout: counts[self._trace_key(layout)])

    def counts(self) -> dict[str, int]:
        """How many traces and rewritten graphs the layouts costed so far needed."""
        return {"traces": len(self._traced), "rewrites": len(self._rewritten)}

    def traced(self, layout: Layout) -> TrainGraph:
        """The traced graph of one rank's micro-batch under `layout`."""
        return self._trace(layout, graph=True)[1]

    # -- a worker process (workers.py) ------------------------------------------------------

    def start_workers(self, count: int, order: Sequence[Layout],
                      bound: Callable[[Layout], float]) -> None:
        """Fork `count` RewriteWorkers for the groups of `order` (the layouts in the order
        the search asks for them, `bound` their FLOP bounds) that workers.child_groups
        gives them; each rewrites ahead, in that order, the first template and the first
        layout without one of each of its groups (workers.firsts)."""
        least: dict[tuple, float] = {}  # group -> its least bound, in the search's order
        for layout in order:
            group = self.group_of(layout)
            least[group] = min(least.get(group, math.inf), bound(layout))
        for share in child_groups(list(least), list(least.values()), count):
            if share:
                mine = set(share)
                ahead = firsts([lay for lay in order if self.group_of(lay) in mine],
                               self.group_of)
                worker = RewriteWorker(self, ahead, share)
                self.workers.update(dict.fromkeys(share, worker))

    def close_workers(self) -> None:
        for worker in set(self.workers.values()):
            worker.close()
        self.workers = {}

    def group_of(self, layout: Layout) -> tuple:
        """The layouts that share a trace and the forward-level passes' costly part (tensor
        parallelism's solve and AMP's re-trace; recomputation's variants rewrite the graph
        before it, `_forward_level`): what a worker rewrites together. Known without
        tracing."""
        return self._trace_key(layout), retrace_fields(layout)

    def export_entry(self, layout: Layout) -> tuple:
        """What `adopt` takes in another process: `layout`'s rewritten entry as plain
        data (its trace's FLOPs and scaling, not the graphs)."""
        key = self._entry(layout)
        entry = self._rewritten[key]
        if entry[2] is not None:
            raise RuntimeError("an exact trace's rewritten graph is not sent")
        trace = self._traced[key[0]]
        return key, entry, self._tables.get(key), (trace[0], None, *trace[2:])

    def adopt(self, layout: Layout, key: tuple, entry: tuple, table: dict | None,
              trace: tuple) -> tuple:
        """Keep an entry that a worker rewrote, as `_entry` keeps its own."""
        self._traced.setdefault(trace[0], trace)
        if key not in self._rewritten:
            self._rewritten[key] = entry
            if table is not None:
                self._tables[key] = table
            if entry[3] is not None:
                self._keep_template(layout, entry[3])
        return key

    def layer_rows(self, layout: Layout) -> list[dict[str, Any]]:
        """cost_model.layer_costs of `layout`'s traced graph (from the worker that traced it)."""

        worker = self.workers.get(self.group_of(layout))
        if worker is not None and worker.alive:
            status, data = worker.result("layers", layout)
            if status == "ok":
                return data
        return layer_costs(self.traced(layout), self.cluster)

    def _remote(self, layout: Layout) -> tuple | None:
        """The key of `layout`'s entry when the worker rewrites its group (None: this
        process does)."""
        group = self.group_of(layout)
        worker = self.workers.get(group)
        if worker is None or not worker.alive:
            return None
        if worker.take_back(group):  # not started there: rewritten here, not waited for
            del self.workers[group]
            return None
        while True:
            worker.collect()
            if group[0] in worker.traces:  # the trace the search needs now, from the child
                self._traced.setdefault(group[0], worker.traces[group[0]])
            if group[0] in self._traced:
                key = self._key(layout)
                if key in self._rewritten:
                    return key
                if key in worker.ready:
                    return self.adopt(layout, *worker.ready.pop(key))
            # the child is busy with it (or with another group before answering): rather
            # than wait, rewrite here a group the child has not started
            stolen = worker.steal(lambda other: other[0] in self._traced
                                  and self._traced[other[0]][1] is not None)
            if stolen is None:
                break
            del self.workers[stolen[0]]
            with contextlib.suppress(ValueError):  # reported when the search asks for it
                self._entry(stolen[1])
        status, data = worker.result("entry", layout)
        if status == "error":
            raise ValueError(data)
        return self.adopt(layout, *data) if status == "ok" else None

    def _schedule_run(self, layout: Layout, summary: GraphSummary,
                      stages: StageSummary) -> ScheduleRun:
        """pipeline_cost.run_schedule of `layout`, shared by the layouts that differ only
        in ZeRO (the last RUNS_KEPT: each holds its simulated timeline)."""
        key = (self._key(layout), self._stages(layout), layout.replace(zero=0))
        if key not in self._runs:
            if len(self._runs) >= RUNS_KEPT:
                del self._runs[next(iter(self._runs))]
            self._runs[key] = run_schedule(summary, stages, self.cluster, layout,
                                           self.efficiency,
                                           self._stage_phases(layout, summary, stages))
        return self._runs[key]

    def _stage_phases(self, layout: Layout, summary: GraphSummary,
                      stages: StageSummary) -> StagePhases:
        """pipeline_cost.stage_phases of `layout`, shared by the layouts that differ only
        in ZeRO (the floor and the schedule's run of a layout read the same)."""
        key = (self._key(layout), self._stages(layout), layout.replace(zero=0))
        if key not in self._phases:
            self._phases[key] = stage_phases(summary, stages, self.cluster, layout,
                                             self.efficiency)
        return self._phases[key]

    def schedule_floor(self, layout: Layout) -> float:
        """Seconds below `layout`'s predicted step from its stages' phase times, without
        simulating its schedule (pipeline_cost.schedule_floor); 0 for a step without a
        pipeline. The search asks it before `step_time`."""
        if not is_pipelined(layout):
            return 0.0
        summary, stages, _ = self.rewritten(layout, timing=True)
        if stages is None:
            return 0.0
        return schedule_floor(summary, stages, self.cluster, layout, self.optimizer,
                              self.efficiency, self._stage_phases(layout, summary, stages))

    def memory_floor(self, layout: Layout, limit: float | None = None) -> int:
        """Bytes below `layout`'s predicted peak, cheaper than `predict`: a pipeline costed
        from a template has its first and last ranks replayed on the replica its step is
        timed on (replicate's `representatives`: a stage of one kind runs the programs of
        the first stage of its kind, as in the whole replica, and what crosses stages is
        in the messages: each rank's replay is the whole replica's, tested), the peak of
        the whole pipeline being the largest of all its ranks'. 0 for any other step. The
        search asks it before `predict`: a layout whose two end ranks alone do not fit is
        not costed. With `limit`, a lesser floor above it may be returned, tried first:
        the saved activations the first rank holds before its first backward, from the
        template alone (replicated.first_rank_saved_floor: no replica, no replay), then
        the end ranks replayed keeping no send past its micro-batch (what the sends keep
        only adds; no schedule.send_releases)."""
        if layout in self._predictions:
            return self._predictions[layout].peak_memory_bytes
        if not (is_pipelined(layout) and self._templated(layout)):
            return 0
        key, depth = self._entry(layout), self._stages(layout)
        pattern = self._rewritten[key][3]
        if pattern is None:  # traced whole (no repeated blocks): no template
            return 0
        check_stage_count(layout, pattern.blocks)
        if limit is not None:  # the first rank's saved activations alone, before any replica
            saved = first_rank_saved_floor(pattern, layout)
            if saved > limit:
                return saved
        summary, stages, _ = self.rewritten(layout, timing=True)
        programs, replays = self._programs(key, depth, summary, stages)
        ranks = sorted({0, layout.pp - 1})
        if limit is not None:
            ends = pipeline_memory_from_summary(summary, stages, layout, self.optimizer, programs,
                                                replays, ranks, sends=False)
            if max(m.peak_bytes for m in ends) > limit:
                return max(m.peak_bytes for m in ends)
        ends = pipeline_memory_from_summary(summary, stages, layout, self.optimizer, programs,
                                            replays, ranks)
        return max(m.peak_bytes for m in ends)

    def _programs(self, key: tuple, depth: int, summary: GraphSummary, stages: StageSummary
                  ) -> tuple[dict, dict]:
        """(stage_programs, the replays kept) of a template's replica `depth` stages deep:
        the whole replica's if it was built, else those of the one `rewritten(timing=True)`
        gives (the same programs: a stage runs its kind's)."""
        if (key, depth) in self._replicas:
            return self._replicas[key, depth][2:]
        if (key, depth) not in self._timing_programs:
            self._timing_programs[key, depth] = (
                stage_programs(summary, stages, self._kind_programs.setdefault(key, {})), {})
        return self._timing_programs[key, depth]

    def schedule_time(self, layout: Layout) -> float | None:
        """The critical rank's compute plus bubble of `layout`'s schedule if its step was
        timed already (step_time or predict), else None."""
        return self._schedules.get(layout)

    def pipeline_floors(self, layout: Layout) -> tuple[float, float, float]:
        """(seconds below one stage boundary's receives per micro-batch, below one
        repeated block's work per micro-batch on any stage: F and B, or F, I and W, below
        its F alone) for a
        pipelined `layout`, from a template rewritten already with the same fields at
        micro-batch size b0 (replicated.block_work_floor). Scaled to `layout`'s size b by
        min(1, b / b0): each op's and value's FLOPs and bytes are affine in the batch
        with nonnegative terms (b appears once in a shape, or not at all), so each op
        time, collective and transfer at b is at least that share of its time at b0, and
        so is any replay of them. Zeros when no such template was rewritten yet."""
        templates = self._templates.get(template_fields(layout))
        if not templates or not self._templated(layout):
            return 0.0, 0.0, 0.0
        size = self._micro_batch(layout)
        received = work = forward = 0.0
        for b0, sends, (block, block_forward) in templates:
            share = min(1.0, size / b0)
            received = max(received, sum(p2p_time(nbytes * share, values, self.cluster, layout,
                                                  self.efficiency) for nbytes, values in sends))
            work = max(work, block * share)
            forward = max(forward, block_forward * share)
        return received, work, forward

    def _keep_template(self, layout: Layout, t: Template) -> None:
        """Keep the floors of `layout`'s template for `pipeline_floors` (its fields fix
        the tensor-parallel group its block work is costed on)."""
        self._templates.setdefault(template_fields(layout), []).append(
            (self._micro_batch(layout), _boundary_sends(t),
             block_work_floor(t, self.cluster, layout, self.efficiency)))

    def _micro_batch(self, layout: Layout) -> float:
        """One rank's micro-batch size (the example's batch when it has no batch dim)."""
        tensors = [x for x in self.example_inputs if isinstance(x, torch.Tensor)]
        dims = batch_dims_of(tensors)
        batch = next((x.shape[d] for x, d in zip(tensors, dims) if d is not None), None)
        return 1.0 if batch is None else batch / (layout.dp * layout.microbatches)

    def rewritten_summary(self, layout: Layout) -> GraphSummary | None:
        """The summary of the unpipelined `layout`'s rewritten graph if an earlier call
        rewrote it, else None: nothing is traced or rewritten here."""
        if is_pipelined(layout) or self._trace_key(layout) not in self._traced:
            return None
        entry = self._rewritten.get(self._key(layout))
        return None if entry is None else entry[0]

    def tp_placements(self, layout: Layout) -> dict | None:
        """The tensor-parallel placement table of `layout`'s rewritten graph (tp > 1)."""
        self._entry(layout)
        return self._tables.get(self._key(layout))

    def _keep(self, layout: Layout) -> int | None:
        """Blocks to trace (None: all): a pipeline of several stages traces the two of its
        template (planner/replicated.py). Accumulation without a pipeline is traced
        whole: its memory is a replay of the one stage's programs, which a scaled
        summary does not have (the search does not try it; `estimate` of it is exact)."""
        if self.trace_blocks is None:
            return None
        if self._stages(layout) > 1:
            return TEMPLATE_BLOCKS
        return None if is_pipelined(layout) else self.trace_blocks

    @staticmethod
    def _stages(layout: Layout) -> int:
        return layout.pp * layout.virtual_stages if is_pipelined(layout) else 1

    def _trace_key(self, layout: Layout) -> tuple:
        """(shapes of one rank's micro-batch, blocks kept): what a trace is shared by
        (asked for every layout the search looks at: kept per layout)."""
        if layout not in self._trace_keys:
            local = local_example(self.example_inputs, layout)
            self._trace_keys[layout] = (
                tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in local),
                self._keep(layout))
        return self._trace_keys[layout]

    def _trace(self, layout: Layout, graph: bool = False):
        """(key, traced graph, model FLOPs, scaling); a trace kept from a worker has no
        graph: traced here when `graph` asks for it."""
        key = self._trace_key(layout)
        keep = key[1]
        if key not in self._traced or (graph and self._traced[key][1] is None):
            local = local_example(self.example_inputs, layout)
            with reduced(self.model, keep) as stack:
                traced = trace_train_step(self.model, local, self.loss_fn)
            scaling = (stack[0], multiplicities(stack[1], keep)) \
                if keep and stack and stack[1] > keep else None
            flops = self._scaled(summarize(traced), traced, scaling).model_flops
            self._traced[key] = (key, traced, flops, scaling)
        return self._traced[key]

    @staticmethod
    def _scaled(summary: GraphSummary, tg: TrainGraph, scaling) -> GraphSummary:
        return summary if scaling is None else scale_summary(summary, tg, scaling[1])

    def _key(self, layout: Layout) -> tuple:
        """The key of `layout`'s rewritten graph in `_rewritten` (traced if new; kept per
        layout: the search asks it for every layout it floors, times or costs)."""
        if layout in self._keys:
            return self._keys[layout]
        pipelined = is_pipelined(layout)
        # the passes of a pipelined step read its number of stages, not how the schedule
        # runs them nor dp (the runtime reduces its gradients; the micro-batch size is in
        # the trace's key); a template (planner/replicated.py) serves every depth
        stages = self._stages(layout)
        if self._template(layout):
            stages = 2
        fields = template_fields(layout, stages) if pipelined else layout
        self._keys[layout] = (self._trace(layout)[0], pipelined, fields)
        return self._keys[layout]

    def _template(self, layout: Layout) -> bool:
        """Whether `layout` is costed from a two-stage template (a scaled trace, several
        stages)."""
        return self._trace(layout)[3] is not None and self._stages(layout) > 1

    def rewritten(self, layout: Layout, timing: bool = False
                  ) -> tuple[GraphSummary, StageSummary | None, int]:
        """(summary of the rewritten graph, its stages when pipelined, model FLOPs of
        one rank's micro-batch) for `layout`. `timing`: a pipeline replicated from a
        template has the ops of one stage per kind only (replicate's `representatives`:
        its step time, not its memory)."""
        key = self._entry(layout)  # before the trace: a worker's entry brings its FLOPs
        model_flops = self._trace(layout)[2]
        summary, stages, _, pattern = self._rewritten[key]
        if pattern is not None:
            depth = self._stages(layout)
            check_stage_count(layout, pattern.blocks)
            if (key, depth) in self._replicas:
                summary, stages = self._replicas[key, depth][:2]
            elif timing:
                if (key, depth) not in self._timing_replicas:
                    self._timing_replicas[key, depth] = replicate(pattern, depth,
                                                                  representatives=True)
                summary, stages = self._timing_replicas[key, depth]
            else:
                summary, stages = replicate(pattern, depth)
                self._replicas[key, depth] = (summary, stages, stage_programs(
                    summary, stages, self._kind_programs.setdefault(key, {})),
                                              {})
        return summary, stages, model_flops

    def prepare(self, layout: Layout) -> None:
        """Rewrite the pipeline template `layout` is costed from (if it is), so that
        `pipeline_floors` bounds the pipelines of its fields: at the largest micro-batch
        among them, it bounds them all (plan.widest_templates). A rewrite that fails is
        left for `predict` to report."""
        if self._templated(layout):
            with contextlib.suppress(ValueError):
                self._entry(layout)

    def is_prepared(self, layout: Layout) -> bool:
        """Whether `prepare(layout)` has nothing left to rewrite."""
        return not self._templated(layout) or self._key(layout) in self._rewritten

    def _templated(self, layout: Layout) -> bool:
        """Whether `layout` would be costed from a template, without tracing it."""
        return self.trace_blocks is not None and self._stages(layout) > 1

    def _entry(self, layout: Layout) -> tuple:
        """The key of `layout`'s rewritten graph in `_rewritten`, rewritten if new (by the
        worker when its group is the worker's)."""
        remote = self._remote(layout)
        if remote is not None:
            return remote
        key = self._key(layout)
        template = self._template(layout)
        if key not in self._rewritten:
            _, traced, _, scaling = self._trace(layout, graph=True)
            options, passes_layout = {}, layout
            if template:  # two stages cut between the two traced blocks
                path, counts = scaling
                options["pipeline_cuts"] = [f"{path}.1"]
                passes_layout = layout.replace(pp=2, virtual_stages=1, schedule="1f1b")
            rewritten = self._run_passes(traced, key[0], passes_layout, options)
            if template:
                pattern = template_of(rewritten, sum(scaling[1]), self.cluster)
                entry = (None, None, None, pattern)
                self._keep_template(layout, pattern)
            else:
                stages = stage_summary(rewritten) if key[1] else None
                summary = self._scaled(summarize(rewritten), rewritten, scaling)
                entry = (summary, stages, None if scaling else rewritten, None)
            self._rewritten[key] = entry
            if "tp" in rewritten.attrs:
                self._tables[key] = rewritten.attrs["tp"]
        return key

    def _run_passes(self, traced: TrainGraph, trace_key: tuple, layout: Layout,
                    options: dict) -> TrainGraph:
        """run_passes of `layout`; with the default pass list, the graph after its
        forward-level passes (tensor parallelism, AMP, recomputation: the costly
        re-traces) is kept for the layouts that read the same fields of them."""
        if self.passes is not None:
            return run_passes(traced, layout, self.cluster, self.passes, options=options)[0]
        first = forward_level_passes(layout)
        rest = default_passes(layout)[len(first):]
        return run_passes(self._forward_level(traced, trace_key, layout, options),
                          layout, self.cluster, rest, options=options)[0]

    def _forward_level(self, traced: TrainGraph, trace_key: tuple, layout: Layout,
                       options: dict) -> TrainGraph:
        """The graph after `layout`'s forward-level passes, kept by the fields they read.
        Recomputation runs last and on the joint graph (no re-trace of its own): its
        variants share the graph before it, tensor parallelism's solve and AMP's
        re-trace."""
        # the cuts are AssignStages' option: a pipeline's template shares the graph of
        # the unpipelined layout with the same trace
        key = (trace_key, forward_level_fields(layout),
               repr(sorted((k, v) for k, v in options.items() if k != "pipeline_cuts")))
        if key not in self._forward:
            first = forward_level_passes(layout)
            if layout.recompute != "none" and len(first) > 1:
                before = self._forward_level(traced, trace_key,
                                             layout.replace(recompute="none"), options)
                self._forward[key] = run_passes(before, layout, self.cluster, first[-1:],
                                                options=options)[0]
            else:
                self._forward[key] = run_passes(traced, layout, self.cluster, first,
                                                options=options)[0]
        return self._forward[key]


def template_fields(layout: Layout, stages: int = 2) -> Layout:
    """What the passes of a pipeline of `stages` stages read of a layout (Estimator._key's
    fields; two: a template's)."""
    return layout.replace(schedule="1f1b", microbatches=2, virtual_stages=1, dp=1, zero=0,
                          pp=stages)


def _boundary_sends(t) -> tuple[tuple[int, int], tuple[int, int]]:
    """((bytes, values) forward, (bytes, values) backward) that cross every boundary
    between neighbouring stages of a pipeline replicated from template `t`
    (replicated._messages: what a block sends on, and the gradients it makes or reads)."""
    out = {"F": [0, 0], "B": [0, 0]}
    for phase, from_block, to_block, nbytes in t.sends:
        if from_block or (phase == "B" and to_block):
            out[phase][0] += nbytes
            out[phase][1] += 1
    return tuple(out["F"]), tuple(out["B"])


def check_layout(layout: Any, cluster: ClusterSpec) -> None:
    """Refuse what the cost model cannot honestly cost: a non-Layout, fields whose pass
    has not landed (as compile does) or that the cost model does not model yet, a
    device count that is not the cluster's."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be an autopar.Layout, got {type(layout).__name__}")
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"cluster must be an autopar.ClusterSpec, got {type(cluster).__name__}")
    if layout.world_size != cluster.world_size:
        raise LayoutError(_world_size_message(layout, cluster))


def _world_size_message(layout: Layout, cluster: ClusterSpec) -> str:
    per_node = cluster.devices_per_node
    have = (f"cluster {cluster.name!r} has {cluster.world_size} ({cluster.nodes} node"
            f"{'s' * (cluster.nodes != 1)} x {per_node})")
    fixes = [f"a layout with dp*tp*pp = {cluster.world_size} (e.g. Layout(dp={cluster.world_size}))"]
    if cluster.name == "local":
        fixes.append(f"ClusterSpec.local(nprocs={layout.world_size})")
    elif layout.world_size % per_node == 0:
        fixes.append(f"a cluster of nodes={layout.world_size // per_node}")
    return (f"{layout} uses dp*tp*pp = {layout.world_size} devices, but the {have}: "
            f"use {' or '.join(fixes)}")
