"""The pass contract: a pass maps (TrainGraph, PassContext) to (TrainGraph, PassResult).

A pass declares what it `requires`, what it `provides` and what it `invalidates`
(property names such as "traced", "retraceable" or "dp_grad_sync"); the
PassManager refuses to run a pass whose requirements are not met. A pass never edits its input graph (it rewrites
`tg.copy()`), never times or logs itself, and says in its result what it declined
to do and why.

Writing one (see docs/passes.md):

    class CountMatmuls(GraphPass):
        name = "count_matmuls"
        requires = frozenset({"traced"})

        def run(self, tg, ctx):
            n = sum(1 for node in tg.call_nodes() if node.target == torch.ops.aten.mm.default)
            return tg, PassResult(self.name, changed=False, stats={"mm": n})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from autopar.compiler.ir.graph import TrainGraph
from autopar.layout import Layout


@dataclass(frozen=True)
class PassContext:
    """Everything a pass may read: the layout, the cluster and free-form options."""

    layout: Layout = Layout()
    cluster: Any = None  # autopar.cluster.ClusterSpec, or None when not planning
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # set by the PassManager when the next pass re-traces from the source
    # (GraphPass.retraces_from_source): a pass may then leave its own re-trace to it
    # (trace.retrace(..., deferred=True)) if nothing it returns depends on that trace
    defer_retrace: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


@dataclass
class PassResult:
    """What a pass did: whether the graph changed, counts, and what it declined."""

    name: str
    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    declined: list[tuple[str, str]] = field(default_factory=list)  # (what, why)
    seconds: float = 0.0  # filled by the manager

    def summary(self) -> str:
        parts = [f"{self.name}: {'changed' if self.changed else 'unchanged'}"]
        parts += [f"{k}={v}" for k, v in self.stats.items()]
        parts += [f"declined {what} ({why})" for what, why in self.declined]
        return ", ".join(parts)


class GraphPass:
    """Base class of a pass. Subclasses set name/requires/provides and implement run."""

    name: ClassVar[str] = ""
    requires: ClassVar[frozenset[str]] = frozenset({"traced"})
    provides: ClassVar[frozenset[str]] = frozenset()
    # properties the pass takes away; a rewrite of the joint graph means it can no
    # longer be re-traced from the forward pass without losing that rewrite
    invalidates: ClassVar[frozenset[str]] = frozenset({"retraceable"})
    # True for a pass that reads only tg.source and re-traces (a forward-level pass
    # like AMP): a re-trace an earlier pass deferred is done by it, not before it
    retraces_from_source: ClassVar[bool] = False

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
