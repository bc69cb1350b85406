"""Pipelines replicated from their two-stage templates (planner/replicated.py), kept by
template and blocks per stage, with the stage programs their memory replays read."""

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
    """Replicas by (rewrite key of the template, blocks per stage): whole, or with one
    stage of each kind (`representatives`: a step's time, and the end ranks' memory
    floor)."""

    def __init__(self) -> None:
        self._whole: dict[tuple, Replica] = {}
        self._timing: dict[tuple, tuple[GraphSummary, StageSummary]] = {}
        self._timing_programs: dict[tuple, tuple[dict, dict]] = {}
        self._kind_programs: dict[tuple, dict] = {}  # stage_programs' `shared`, per template

    def summaries(self, key: tuple, t: Template, counts: tuple[int, ...], timing: bool
                  ) -> tuple[GraphSummary, StageSummary]:
        """(summary, stages) of `t` replicated with `counts` blocks per stage
        (Template.blocks_per_stage): the whole replica if it was built, else, for `timing`,
        one with a stage of each kind only."""
        if (key, counts) in self._whole:
            whole = self._whole[key, counts]
            return whole.summary, whole.stages
        if timing:
            if (key, counts) not in self._timing:
                self._timing[key, counts] = replicate(t, counts, representatives=True)
            return self._timing[key, counts]
        summary, stages = replicate(t, counts)
        self._whole[key, counts] = Replica(summary, stages, stage_programs(
            summary, stages, self._kind_programs.setdefault(key, {})))
        return summary, stages

    def programs(self, key: tuple, counts: tuple[int, ...], summary: GraphSummary,
                 stages: StageSummary) -> tuple[dict, dict]:
        """(stage_programs, the replays kept) of the replica of `counts` blocks per stage:
        the whole replica's if it was built, else those of the one
        `summaries(timing=True)` gives (the same programs: a stage runs its kind's)."""
        if (key, counts) in self._whole:
            whole = self._whole[key, counts]
            return whole.programs, whole.replays
        if (key, counts) not in self._timing_programs:
            self._timing_programs[key, counts] = (
                stage_programs(summary, stages, self._kind_programs.setdefault(key, {})), {})
        return self._timing_programs[key, counts]
