"""The pipelined program IR: one program per pipeline stage and the schedule that runs them.

`lower_pipeline` builds a PipelineProgram from the staged joint graph; the runtime
(runtime/pipeline.py) executes it rank by rank and the planner replays its memory
(planner/pipeline_memory.py). Values are keyed by the joint graph's node names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.compiler.ir.program import LOSS_SCALE_INPUT, TensorEntry
from autopar.compiler.ir.schedule import Schedule, send_releases


@dataclass(frozen=True)
class ValueSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class StageProgram:
    stage: int
    forward: fx.GraphModule
    f_inputs: tuple[str, ...]
    f_outputs: tuple[str, ...]
    backward: fx.GraphModule
    b_inputs: tuple[str, ...]
    b_outputs: tuple[str, ...]
    send_forward: dict[int, tuple[str, ...]] = field(default_factory=dict)  # stage -> keys
    send_backward: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # zero-bubble only: the backward split into input-gradient and weight-gradient
    # programs, each (GraphModule, input keys, output keys)
    input_grad: tuple | None = None
    weight_grad: tuple | None = None

    def uses(self) -> set[str]:
        return set(self.f_inputs) | set(self.b_inputs)


@dataclass
class PipelineProgram:
    stages: tuple[StageProgram, ...]
    schedule: Schedule
    params: tuple[TensorEntry, ...]
    buffers: tuple[TensorEntry, ...]
    inputs: tuple[TensorEntry, ...]  # one micro-batch's shapes
    batch_dims: tuple[int | None, ...]
    keys: tuple[str, ...]  # placeholder key of each param, buffer, input (in that order)
    grad_parts: tuple[tuple[str, ...], ...]  # per param: the nodes of its gradient's parts
    loss_key: str
    values: dict[str, ValueSpec]
    mesh: tuple[tuple[str, int], ...]
    layout: dict = field(default_factory=dict)
    # the summed gradients are divided by this (fp16 steps, whose backward seed is
    # d(loss * scale) and not scaled by 1/(microbatches * dp) in the graph)
    grad_divisor: int = 1
    # batch-decided counts the loss divides by (compiler/ir/batch.LossNormalizer)
    normalizers: tuple = ()

    @property
    def loss_scaled(self) -> bool:
        return bool(self.inputs) and self.inputs[-1].name == LOSS_SCALE_INPUT

    def receives(self, stage: int, kind: str) -> dict[int, tuple[str, ...]]:
        """What `stage` receives before its F ("forward") or B ("backward"), by source stage."""
        attr = "send_forward" if kind == "forward" else "send_backward"
        return {p.stage: getattr(p, attr)[stage] for p in self.stages if stage in getattr(p, attr)}

    def send_releases(self, pp_rank: int) -> dict[int, tuple[int, ...]]:
        """schedule.send_releases for this program's send and receive tables: after which
        of the rank's receives each of its sends is known to be received."""
        by_stage = {p.stage: p for p in self.stages}

        def sends_to(stage: int, phase: str):
            return list(by_stage[stage].send_forward if phase == "F"
                        else by_stage[stage].send_backward)

        def receives_from(stage: int, phase: str):
            return list(self.receives(stage, "forward" if phase == "F" else "backward"))
        return send_releases(self.schedule, pp_rank, sends_to, receives_from)

    def stages_reading(self, param_key: str, parts: tuple[str, ...]) -> set[int]:
        """Stages whose programs read the parameter or produce a part of its gradient."""
        return {p.stage for p in self.stages
                if param_key in p.uses() or set(parts) & (set(p.b_outputs) | set(p.f_outputs))}
