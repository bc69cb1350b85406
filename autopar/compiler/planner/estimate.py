"""autopar.estimate: the predicted step time and memory of a model under one Layout.

Traces one data-parallel rank's share of the batch (the model may live on the meta
device, the inputs may be meta tensors: nothing is allocated), runs the same passes
`autopar.compile` would run, and costs the rewritten graph (cost_model.py).

`Estimator` does it for the many layouts of a search, from parts that each keep what
the layouts share: `Traces` (traces.py), `Rewrites` (rewrites.py: the pass list run
once per set of layouts its passes read alike), `Replicas` of pipeline templates
(replicas.py), `ScheduleTimes` (schedule_times.py), `TemplateFloors`
(template_floors.py) and a `WorkerPool` of processes that rewrite ahead (workers.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import MemoryPrediction
from autopar.compiler.analysis.summary import GraphSummary
from autopar.compiler.ir.batch import Batch, LossFn, Objective
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.passes.assign_stages import check_stage_count, stage_budget
from autopar.compiler.passes.base import GraphPass, PassOptions
from autopar.compiler.passes.defaults import is_pipelined
from autopar.compiler.planner.cost_model import layer_costs
from autopar.compiler.planner.pipeline_memory import pipeline_memory_per_rank
from autopar.compiler.planner.predict import predict
from autopar.compiler.planner.replicas import Replicas
from autopar.compiler.planner.replicated import (
    Template,
    first_rank_saved_floor,
    pipeline_memory_from_summary,
)
from autopar.compiler.planner.result import Prediction
from autopar.compiler.planner.rewrites import ExportedEntry, Group, RewriteKey, Rewrites
from autopar.compiler.planner.schedule_times import ScheduleTimes
from autopar.compiler.planner.search import PlanArgumentError
from autopar.compiler.planner.stages import StageSummary
from autopar.compiler.planner.template_floors import NO_FLOORS, PipelineFloors, TemplateFloors
from autopar.compiler.planner.traces import Traces, resolve_trace_blocks, stages_of
from autopar.compiler.planner.workers import WorkerPool
from autopar.costs import DEFAULT_EFFICIENCY, OPTIMIZER_STATES, Efficiency
from autopar.layout import Layout, LayoutError


def estimate(model: torch.nn.Module, cluster: ClusterSpec, layout: Layout,
             example_inputs: Batch, loss_fn: LossFn | None = None,
             optimizer: str = "adamw", efficiency: Efficiency = DEFAULT_EFFICIENCY,
             passes: Sequence[GraphPass | str] | None = None,
             example_targets: Batch | None = None,
             trace_blocks: int | str | None = "auto") -> Prediction:
    """Predict one training step of `model` on `cluster` under `layout`.

    `example_inputs` (and `example_targets`) is one global batch, as `autopar.compile`
    takes it. `optimizer` is the optimizer's kind for the
    memory and time of its step: "adamw", "adam", "sgd-momentum" or "sgd" (torch's
    class with its defaults), or one of those + "-fused" (fused=True). `passes`
    replaces the default pass list, to score your own passes. `trace_blocks`: "auto"
    traces two of the model's repeated blocks and scales them to the stack when it has
    more (a pipeline: a two-stage template), "exact" (or None) the whole model, k that
    many blocks; `Prediction.tracing` says which was done (docs/planner.md).
    """
    check_layout(layout, cluster)
    objective, flat = Objective.from_example(example_inputs, example_targets, loss_fn)
    return Estimator(model, cluster, flat, objective, optimizer, efficiency,
                     passes, trace_blocks).predict(layout)


class Estimator:
    """Predictions of one model on one cluster under many layouts (the planner's
    inner loop). A trace is shared by the layouts with the same micro-batch per rank,
    and a rewritten graph by those the passes read alike (schedules, micro-batch
    counts of one size): what `predict` costs is exactly what `estimate` would."""

    def __init__(self, model: torch.nn.Module, cluster: ClusterSpec,
                 example_inputs: Sequence[torch.Tensor], loss_fn: LossFn | None = None,
                 optimizer: str = "adamw", efficiency: Efficiency = DEFAULT_EFFICIENCY,
                 passes: Sequence[GraphPass | str] | None = None,
                 trace_blocks: int | str | None = "auto",
                 pass_options: dict[str, Any] | None = None) -> None:
        if optimizer not in OPTIMIZER_STATES:
            raise PlanArgumentError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, "
                             f"got {optimizer!r}")
        self.example_inputs = tuple(example_inputs)
        if not self.example_inputs:
            raise PlanArgumentError("estimate needs example_inputs: one global batch (meta "
                                    "tensors "
                             "will do)")
        self.model, self.cluster, self.loss_fn = model, cluster, loss_fn
        self.optimizer, self.efficiency, self.passes = optimizer, efficiency, passes
        # planner/scaled.py: trace a few blocks, scale (traces.resolve_trace_blocks)
        self.trace_blocks = resolve_trace_blocks(model, trace_blocks)
        self.traces = Traces(model, self.example_inputs, loss_fn, self.trace_blocks,
                             kernels=cluster.device.kind,
                             attention=cluster.device.attention,
                             cluster=cluster if passes is None else None)
        # pass_options: PassOptions fields every layout is rewritten with, as
        # compile(pass_options=) would
        self.rewrites = Rewrites(self.traces, cluster, passes, pass_options)
        self.replicas = Replicas()
        self.schedules = ScheduleTimes(cluster, optimizer, efficiency)
        self.floors = TemplateFloors(cluster, efficiency)
        # the bytes a pipeline stage's cut fits in, as AssignStages takes it under the
        # default passes (PassOptions.memory_budget, else the cluster's device memory)
        self.stage_budget = stage_budget(cluster, PassOptions.of(pass_options))
        self.workers = WorkerPool()
        self._predictions: dict[Layout, Prediction] = {}

    # -- what the search asks ---------------------------------------------------------------

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
            self._predictions[layout].tracing = self.traces.describe(layout)
        return self._predictions[layout]

    def step_time(self, layout: Layout) -> float:
        """The predicted step time of `layout`, as `predict` gives it, without costing its
        memory (a pipeline's memory replays every rank's schedule: the search asks this
        first, and costs the memory only of a layout that could be the plan)."""
        if layout in self._predictions:
            return self._predictions[layout].step_time_s
        summary, stages, _ = self.rewritten(layout, timing=True)
        return self._step_times(layout, summary, stages).total_s

    def compute_floor(self, layout: Layout) -> float:
        """`layout`'s predicted step less its exposed communication: its compute,
        pipeline bubble and optimizer seconds (a pipeline's critical rank's), as
        `step_time` times them. Recomputing adds compute to every stage (and so to the
        bubble between them) and can only move collectives: what the same layout
        recomputing cannot beat (search.Costing.compute_floor)."""
        if layout in self._predictions:
            return self._predictions[layout].compute_floor_s
        summary, stages, _ = self.rewritten(layout, timing=True)
        times = self._step_times(layout, summary, stages)
        return times.total_s - times.exposed_comm_s

    def schedule_floor(self, layout: Layout) -> float:
        """Seconds below `layout`'s predicted step from its stages' phase times, without
        simulating its schedule (pipeline_cost.schedule_floor); 0 for a step without a
        pipeline. The search asks it before `step_time`."""
        if not is_pipelined(layout):
            return 0.0
        summary, stages, _ = self.rewritten(layout, timing=True)
        if stages is None:
            return 0.0
        return self.schedules.floor(layout, self._where(layout), summary, stages)

    def schedule_time(self, layout: Layout) -> float | None:
        """The critical rank's compute plus bubble of `layout`'s schedule if its step was
        timed already (step_time or predict), else None."""
        return self.schedules.critical(layout)

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
        if not (is_pipelined(layout) and self.traces.templated(layout)):
            return 0
        key = self.rewrite(layout)
        pattern = self.rewrites.entry(key).template
        if pattern is None:  # traced whole (no repeated blocks): no template
            return 0
        check_stage_count(layout, pattern.blocks)
        counts = self.blocks_per_stage(pattern, layout)
        if limit is not None:  # the first rank's saved activations alone, before any replica
            saved = first_rank_saved_floor(pattern, layout, self.optimizer, self.stage_budget)
            if saved > limit:
                return saved
        summary, stages, _ = self.rewritten(layout, timing=True)
        programs, replays = self.replicas.programs(key, counts, summary, stages)
        ranks = sorted({0, layout.pp - 1})
        if limit is not None:
            ends = pipeline_memory_from_summary(summary, stages, layout, self.optimizer, programs,
                                                replays, ranks, sends=False)
            if max(m.peak_bytes for m in ends) > limit:
                return max(m.peak_bytes for m in ends)
        ends = pipeline_memory_from_summary(summary, stages, layout, self.optimizer, programs,
                                            replays, ranks)
        return max(m.peak_bytes for m in ends)

    def pipeline_floors(self, layout: Layout) -> PipelineFloors:
        """Floors of a pipelined `layout` per micro-batch (template_floors.PipelineFloors)
        from the templates rewritten already that its passes read alike, at any
        micro-batch size (scaled to its own). Zeros when none was rewritten yet."""
        if not self.traces.templated(layout) or not self.floors.has(layout):
            return NO_FLOORS
        return self.floors.floors(layout, self.traces.micro_batch(layout))

    def prepare(self, layout: Layout) -> None:
        """Rewrite the pipeline template `layout` is costed from (if it is), so that
        `pipeline_floors` bounds the pipelines of its template_key: at the largest
        micro-batch among them, it bounds them all (plan.widest_templates). A rewrite
        that fails is left for `predict` to report."""
        if self.traces.templated(layout):
            with contextlib.suppress(ValueError):
                self.rewrite(layout)

    def is_prepared(self, layout: Layout) -> bool:
        """Whether `prepare(layout)` has nothing left to rewrite."""
        return not self.traces.templated(layout) or self.rewrites.key(layout) in self.rewrites

    # -- what the plan and its report read --------------------------------------------------

    def step_model_flops(self, layout: Layout) -> int:
        """Model FLOPs of one training step of the global batch (all ranks) under `layout`,
        from the trace of its micro-batch (scaled to the whole stack with trace_blocks)."""
        return self.traces.get(layout).model_flops * layout.dp * layout.microbatches

    def step_executed_flops(self, layout: Layout) -> int:
        """The FLOPs the kernels of one training step of the global batch perform under
        `layout` before any pass (TracedEntry.executed_flops): what compute time counts."""
        return self.traces.get(layout).executed_flops * layout.dp * layout.microbatches

    def most_shared(self, layouts: Sequence[Layout]) -> Layout:
        """The first of `layouts` whose trace the most of them share: what to trace first
        when any trace will do (the FLOP count, the parameters an embedding reads), so
        that the search reuses it (a fork's workers inherit it), rather than a micro-batch
        size it may never cost."""
        return self.traces.most_shared(layouts)

    def counts(self) -> dict[str, int]:
        """How many traces and rewritten graphs the layouts costed so far needed."""
        return {"traces": len(self.traces), "rewrites": len(self.rewrites)}

    def traced(self, layout: Layout) -> TrainGraph:
        """The traced graph of one rank's micro-batch under `layout`, without AMP."""
        return self.traces.joint(layout)

    def traced_in_precision(self, layout: Layout) -> TrainGraph:
        """The traced graph of one rank's micro-batch in `layout`'s precision
        (Traces.in_precision: after AMP, the first trace where that was one); with the
        caller's own passes, the plain trace."""
        return self.traces.in_precision(layout, self.cluster) if self.passes is None \
            else self.traced(layout)

    def rewritten_summary(self, layout: Layout) -> GraphSummary | None:
        """The summary of the unpipelined `layout`'s rewritten graph if an earlier call
        rewrote it, else None: nothing is traced or rewritten here."""
        if is_pipelined(layout) or self.traces.key(layout) not in self.traces:
            return None
        key = self.rewrites.key(layout)
        return self.rewrites.entry(key).summary if key in self.rewrites else None

    def tp_placements(self, layout: Layout) -> dict | None:
        """The tensor-parallel placement table of `layout`'s rewritten graph (tp > 1)."""
        return self.rewrites.table(self.rewrite(layout))

    def layer_rows(self, layout: Layout) -> list[dict[str, Any]]:
        """cost_model.layer_costs of `layout`'s traced graph in its precision (after AMP:
        an fp16 matmul costed at the fp16 rate; with the caller's own passes, the plain
        trace), from the worker that traced it."""
        worker = self.workers.alive(self.group_of(layout))
        if worker is not None:
            status, data = worker.result("layers", layout)
            if status == "ok":
                return data
        return layer_costs(self.traced_in_precision(layout), self.cluster, self.efficiency)

    def blocks_per_stage(self, template: Template, layout: Layout) -> tuple[int, ...]:
        """Blocks of each stage of `layout`'s pipeline replicated from `template`, cut as
        AssignStages cuts the whole model (replicated.Template.blocks_per_stage)."""
        return template.blocks_per_stage(stages_of(layout), layout, self.optimizer,
                                         self.stage_budget)

    def rewritten(self, layout: Layout, timing: bool = False
                  ) -> tuple[GraphSummary, StageSummary | None, int]:
        """(summary of the rewritten graph, its stages when pipelined, model FLOPs of
        one rank's micro-batch) for `layout`. `timing`: a pipeline replicated from a
        template has the ops of one stage per kind only (replicate's `representatives`:
        its step time, not its memory)."""
        key = self.rewrite(layout)  # before the trace: a worker's entry brings its FLOPs
        model_flops = self.traces.get(layout).model_flops
        entry = self.rewrites.entry(key)
        if entry.template is None:
            return entry.summary, entry.stages, model_flops
        check_stage_count(layout, entry.template.blocks)
        counts = self.blocks_per_stage(entry.template, layout)
        summary, stages = self.replicas.summaries(key, entry.template, counts, timing)
        return summary, stages, model_flops

    # -- rewriting, here or in a worker process ---------------------------------------------

    def rewrite(self, layout: Layout) -> RewriteKey:
        """The key of `layout`'s rewritten entry, rewritten if new (by the worker when its
        group is a worker's)."""
        remote = self.workers.fetch(self, layout)
        if remote is not None:
            return remote
        key = self.rewrites.key(layout)
        if key not in self.rewrites:
            entry = self.rewrites.rewrite(layout)
            if entry.template is not None:
                self.floors.keep(layout, entry.template, self.traces.micro_batch(layout))
        return key

    def group_of(self, layout: Layout) -> Group:
        """The layouts that share a trace and the forward-level passes' costly part (tensor
        parallelism's solve and AMP's re-trace; recomputation's variants rewrite the graph
        after it): what a worker rewrites together. Known without tracing."""
        return self.rewrites.group_of(layout)

    def start_workers(self, count: int, order: Sequence[Layout],
                      bound: Callable[[Layout], float]) -> None:
        """Fork `count` RewriteWorkers for the groups of `order` (WorkerPool.start)."""
        self.workers.start(self, count, order, bound)

    def close_workers(self) -> None:
        self.workers.close()

    def export_entry(self, layout: Layout) -> ExportedEntry:
        """What `adopt` takes in another process: `layout`'s rewritten entry as plain
        data (its trace's FLOPs and scaling, not the graphs)."""
        return self.rewrites.export(self.rewrite(layout))

    def adopt(self, layout: Layout, exported: ExportedEntry) -> RewriteKey:
        """Keep an entry that a worker rewrote, as `rewrite` keeps its own."""
        self.traces.keep(exported.trace)
        if self.rewrites.keep(exported) and exported.entry.template is not None:
            self.floors.keep(layout, exported.entry.template, self.traces.micro_batch(layout))
        return exported.key

    # -- helpers ----------------------------------------------------------------------------

    def _where(self, layout: Layout) -> tuple:
        """(rewrite key, stage count): what ScheduleTimes shares a schedule by."""
        return self.rewrites.key(layout), stages_of(layout)

    def _step_times(self, layout: Layout, summary: GraphSummary, stages: StageSummary | None):
        where = None if stages is None else self._where(layout)
        return self.schedules.step_times(layout, where, summary, stages)

    def _pipeline_memory(self, layout, summary, stages) -> MemoryPrediction | None:
        """The fullest pipeline rank's memory, each rank's schedule replayed (None: the
        unpipelined step's)."""
        if stages is None:
            return None
        key = self.rewrites.key(layout)
        entry = self.rewrites.entry(key)
        if entry.template is not None:  # planner/replicated.py: the stages' summaries replayed
            counts = self.blocks_per_stage(entry.template, layout)
            programs, replays = self.replicas.programs(key, counts, summary, stages)
            ranks = pipeline_memory_from_summary(summary, stages, layout, self.optimizer,
                                                 programs, replays)
        elif entry.graph is not None:
            ranks = pipeline_memory_per_rank(entry.graph, layout, self.optimizer,
                                             regions_inline=self.cluster.device.kind == "cpu")
        else:  # accumulation over a scaled trace: its one stage's programs replayed
            ranks = pipeline_memory_from_summary(summary, stages, layout, self.optimizer)
        return max(ranks, key=lambda m: m.peak_bytes)


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
