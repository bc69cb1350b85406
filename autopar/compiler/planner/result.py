"""What the planner returns: the Prediction of one layout, and the Plan (the chosen
layout, every alternative and why it lost, what was skipped). Plain data with a JSON
form (`to_dict` / `from_dict`), so a plan can be saved, diffed and compiled later."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autopar.compiler.planner.report import save_report
from autopar.layout import Layout


@dataclass
class Prediction:
    """What the cost model predicts for one training step (docs/planner.md)."""

    step_time_s: float
    flops_per_step: float
    tflops_per_device: float
    mfu: float
    peak_memory_bytes: int
    bubble_fraction: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    # bytes per rank by category (parameters, gradients, optimizer_states, activations,
    # ...); peak_memory_bytes is their sum
    memory: dict[str, int] = field(default_factory=dict)
    # how the step was traced: the whole model, or a few repeated blocks scaled
    # (Estimator's trace_blocks; planner/traces.py Traces.describe)
    tracing: str = ""
    # bytes one rank's communication carries per step, by group (cost_model.comm_bytes);
    # for a pipelined step its critical rank's, sends and gradient sums included
    # (pipeline_cost.rank_comm_bytes)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    # DGC and Local SGD: the bytes the same step would carry summing every gradient whole
    # each step (cost_model.uncompressed_bytes), to set against comm_bytes; else 0
    uncompressed_bytes: int = 0

    @property
    def compute_floor_s(self) -> float:
        """The step less its exposed communication (compute, optimizer and a pipeline's
        bubble): what the same layout recomputing cannot beat (search.Costing.compute_floor).
        The step itself for a Prediction without its parts."""
        return self.step_time_s - self.breakdown.get("exposed_comm", 0.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Prediction:
        return cls(**data)


@dataclass
class Plan:
    """What `autopar.plan` chose and why (see docs/planner.md).

    alternatives: every other costed layout, fitting ones fastest first, then the ones
    over memory, each with why it lost; skipped: layouts compile or the cost model
    refuse, with the reason; details: JSON-able facts for the report (the chosen
    layout's simulated schedule, tensor-parallel placements, per-layer costs);
    pass_options: the PassOptions fields `compile` rewrites the layout with, so that it
    compiles the program the plan costed (a pipeline costed from a template of two
    blocks, cut between them: {"cut_inside_blocks": False})."""

    layout: Layout
    predicted: Prediction
    alternatives: list[tuple[Layout, Prediction, str]] = field(default_factory=list)
    skipped: list[tuple[Layout, str]] = field(default_factory=list)
    cluster: dict[str, Any] = field(default_factory=dict)
    max_memory_fraction: float = 0.9
    details: dict[str, Any] = field(default_factory=dict)
    pass_options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.to_dict(), "predicted": self.predicted.to_dict(),
                "alternatives": [{"layout": lay.to_dict(), "predicted": pred.to_dict(),
                                  "why_not": why} for lay, pred, why in self.alternatives],
                "skipped": [{"layout": lay.to_dict(), "reason": why} for lay, why in self.skipped],
                "cluster": self.cluster, "max_memory_fraction": self.max_memory_fraction,
                "details": self.details, "pass_options": self.pass_options}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(layout=Layout.from_dict(data["layout"]),
                   predicted=Prediction.from_dict(data["predicted"]),
                   alternatives=[(Layout.from_dict(a["layout"]), Prediction.from_dict(a["predicted"]),
                                  a["why_not"]) for a in data["alternatives"]],
                   skipped=[(Layout.from_dict(s["layout"]), s["reason"]) for s in data["skipped"]],
                   cluster=data["cluster"], max_memory_fraction=data["max_memory_fraction"],
                   details=data["details"], pass_options=data.get("pass_options", {}))

    def save_report(self, path) -> None:
        """Write the planning report; the suffix picks the form: .html (one offline
        page, inline SVG charts), .md, or .json (reads back with `Plan.from_dict`)."""
        save_report(self, path)
