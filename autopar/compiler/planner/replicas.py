"""Pipelines replicated from their two-stage templates (planner/replicated.py), kept by
template and depth, with the stage programs their memory replays read."""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.compiler.analysis.summary import GraphSummary
from autopar.compiler.planner.replicated import Template, replicate, stage_programs
from autopar.compiler.planner.stages import StageSummary


@dataclass(frozen=True)
class Replica:
    """A template replicated to every stage, and what its ranks' memory replays read."""

    summary: GraphSummary
    stages: StageSummary
    programs: dict  # replicated.stage_programs
    replays: dict = field(default_factory=dict)  # the replays kept between ranks


class Replicas:
    """Replicas by (rewrite key of the template, depth): whole, or with one stage of
    each kind (`representatives`: a step's time, and the end ranks' memory floor)."""

    def __init__(self) -> None:
        self._whole: dict[tuple, Replica] = {}
        self._timing: dict[tuple, tuple[GraphSummary, StageSummary]] = {}
        self._timing_programs: dict[tuple, tuple[dict, dict]] = {}
        self._kind_programs: dict[tuple, dict] = {}  # stage_programs' `shared`, per template

    def summaries(self, key: tuple, t: Template, depth: int, timing: bool
                  ) -> tuple[GraphSummary, StageSummary]:
        """(summary, stages) of `t` replicated `depth` stages deep: the whole replica if it
        was built, else, for `timing`, one with a stage of each kind only."""
        if (key, depth) in self._whole:
            whole = self._whole[key, depth]
            return whole.summary, whole.stages
        if timing:
            if (key, depth) not in self._timing:
                self._timing[key, depth] = replicate(t, depth, representatives=True)
            return self._timing[key, depth]
        summary, stages = replicate(t, depth)
        self._whole[key, depth] = Replica(summary, stages, stage_programs(
            summary, stages, self._kind_programs.setdefault(key, {})))
        return summary, stages

    def programs(self, key: tuple, depth: int, summary: GraphSummary, stages: StageSummary
                 ) -> tuple[dict, dict]:
        """(stage_programs, the replays kept) of the replica `depth` stages deep: the whole
        replica's if it was built, else those of the one `summaries(timing=True)` gives
        (the same programs: a stage runs its kind's)."""
        if (key, depth) in self._whole:
            whole = self._whole[key, depth]
            return whole.programs, whole.replays
        if (key, depth) not in self._timing_programs:
            self._timing_programs[key, depth] = (
                stage_programs(summary, stages, self._kind_programs.setdefault(key, {})), {})
        return self._timing_programs[key, depth]
