"""Floors of a pipeline's step from the templates rewritten so far (plan.compute_bound):
what crosses a stage boundary per micro-batch, and one repeated block's work.

A template rewritten at micro-batch size b0 bounds every pipeline costed from a
template the passes treat alike (rewrites.template_key), at its own micro-batch size
b, by min(1, b / b0) of its figures: each op's and value's FLOPs and bytes are affine
in the batch with nonnegative terms (b appears once in a shape, or not at all), so
each op time, collective and transfer at b is at least that share of its time at b0,
and so is any replay of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autopar.cluster import ClusterSpec
from autopar.compiler.planner.pipeline_cost import p2p_time
from autopar.compiler.planner.replicated import Template, block_work_floor
from autopar.compiler.planner.rewrites import template_key
from autopar.costs import Efficiency
from autopar.layout import Layout


class Sends(NamedTuple):
    """(bytes, values) that cross every boundary between neighbouring stages."""

    forward: tuple[int, int]
    backward: tuple[int, int]


@dataclass(frozen=True)
class TemplateFloor:
    """What one rewritten template bounds, at its micro-batch size."""

    micro_batch: float
    sends: Sends
    block_work: float  # one block's F and B (or F, I and W) per micro-batch, any stage
    block_forward: float  # its F alone


class PipelineFloors(NamedTuple):
    """Seconds per micro-batch below: one stage boundary's receives, one repeated
    block's work on any stage, that block's forward alone."""

    received: float
    work: float
    forward: float


NO_FLOORS = PipelineFloors(0.0, 0.0, 0.0)


class TemplateFloors:
    """The floors of the templates rewritten so far, by their template_key."""

    def __init__(self, cluster: ClusterSpec, efficiency: Efficiency) -> None:
        self.cluster, self.efficiency = cluster, efficiency
        self._by_key: dict[tuple, list[TemplateFloor]] = {}

    def keep(self, layout: Layout, t: Template, micro_batch: float) -> None:
        """Keep the floors of `layout`'s template `t` (the layout fixes the
        tensor-parallel group its block work is costed on)."""
        work, forward = block_work_floor(t, self.cluster, layout, self.efficiency)
        self._by_key.setdefault(template_key(layout), []).append(
            TemplateFloor(micro_batch, boundary_sends(t), work, forward))

    def has(self, layout: Layout) -> bool:
        """Whether a template of `layout`'s key was rewritten."""
        return template_key(layout) in self._by_key

    def floors(self, layout: Layout, micro_batch: float) -> PipelineFloors:
        """The floors of a pipelined `layout` of that micro-batch size from the templates
        of its key (module docstring); NO_FLOORS before any was rewritten."""
        templates = self._by_key.get(template_key(layout))
        if not templates:
            return NO_FLOORS
        received = work = forward = 0.0
        for t in templates:
            share = min(1.0, micro_batch / t.micro_batch)
            received = max(received, sum(
                p2p_time(nbytes * share, values, self.cluster, layout, self.efficiency)
                for nbytes, values in t.sends))
            work = max(work, t.block_work * share)
            forward = max(forward, t.block_forward * share)
        return PipelineFloors(received, work, forward)


def boundary_sends(t: Template) -> Sends:
    """What crosses every boundary between neighbouring stages of a pipeline replicated
    from template `t` (replicated._messages: what a block sends on, and the gradients
    it makes or reads)."""
    out = {"F": [0, 0], "B": [0, 0]}
    for phase, from_block, to_block, nbytes in t.sends:
        if from_block or (phase == "B" and to_block):
            out[phase][0] += nbytes
            out[phase][1] += 1
    return Sends(tuple(out["F"]), tuple(out["B"]))
