"""The step times the search asks for, with a pipeline's simulated schedule shared by
the layouts that differ only in their ZeRO stage (it acts before the first action or
after the last: pipeline_cost.ScheduleRun)."""

from __future__ import annotations

from typing import Any, NamedTuple

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.summary import GraphSummary
from autopar.compiler.planner.pipeline_cost import (
    ScheduleRun,
    StagePhases,
    run_schedule,
    schedule_floor,
    stage_phases,
)
from autopar.compiler.planner.predict import step_times
from autopar.compiler.planner.stages import StageSummary
from autopar.costs import Efficiency
from autopar.layout import Layout

RUNS_KEPT = 64  # simulated schedules kept: the search times ZeRO siblings close together


class LastTimes(NamedTuple):
    """The step times asked last (the search asks step_time, then predict, of one
    layout; a pipeline's hold its whole timeline)."""

    layout: Layout
    times: Any  # cost_model.StepTime or pipeline_cost.PipelineTime


class ScheduleTimes:
    """Step times of one model's layouts on one cluster. `where` is the (rewrite key,
    stage count) of a layout's graph: with the layout less its ZeRO stage, what a
    schedule's phases and simulation are shared by."""

    def __init__(self, cluster: ClusterSpec, optimizer: str, efficiency: Efficiency) -> None:
        self.cluster, self.optimizer, self.efficiency = cluster, optimizer, efficiency
        self._runs: dict[tuple, ScheduleRun] = {}  # the last RUNS_KEPT
        self._phases: dict[tuple, StagePhases] = {}
        self._critical: dict[Layout, float] = {}  # compute plus bubble of the layouts timed
        self._last: LastTimes | None = None

    def step_times(self, layout: Layout, where: tuple, summary: GraphSummary,
                   stages: StageSummary | None):
        """predict.step_times of `layout` (the last one kept)."""
        if self._last is None or self._last.layout != layout:
            run = None if stages is None else self._run(layout, where, summary, stages)
            times = step_times(summary, self.cluster, layout, self.optimizer, self.efficiency,
                               stages, run)
            self._last = LastTimes(layout, times)
            self._critical[layout] = times.compute_s + times.bubble_s
        return self._last.times

    def critical(self, layout: Layout) -> float | None:
        """The critical rank's compute plus bubble of `layout` if it was timed, else None."""
        return self._critical.get(layout)

    def floor(self, layout: Layout, where: tuple, summary: GraphSummary,
              stages: StageSummary) -> float:
        """pipeline_cost.schedule_floor of a pipelined `layout`."""
        return schedule_floor(summary, stages, self.cluster, layout, self.optimizer,
                              self.efficiency, self._stage_phases(layout, where, summary, stages))

    def _run(self, layout: Layout, where: tuple, summary: GraphSummary,
             stages: StageSummary) -> ScheduleRun:
        key = (*where, layout.replace(zero=0))
        if key not in self._runs:
            if len(self._runs) >= RUNS_KEPT:
                del self._runs[next(iter(self._runs))]
            self._runs[key] = run_schedule(summary, stages, self.cluster, layout,
                                           self.efficiency,
                                           self._stage_phases(layout, where, summary, stages))
        return self._runs[key]

    def _stage_phases(self, layout: Layout, where: tuple, summary: GraphSummary,
                      stages: StageSummary) -> StagePhases:
        key = (*where, layout.replace(zero=0))
        if key not in self._phases:
            self._phases[key] = stage_phases(summary, stages, self.cluster, layout,
                                             self.efficiency)
        return self._phases[key]
