"""The pass contract: a pass maps (TrainGraph, PassContext) to (TrainGraph, PassResult).

A pass declares what it `requires`, what it `provides` and what it `invalidates`
(property names such as "traced", "retraceable" or "dp_grad_sync"); the
PassManager refuses to run a pass whose requirements are not met. A pass never edits a graph
it does not own: it rewrites `writable(tg, ctx)`, a copy of its input unless the manager
says the input is the pass's own (`PassContext.owns_input`); it never times or logs
itself, and says in its result what it declined to do and why.

Writing one (see docs/passes.md):

    class CountMatmuls(GraphPass):
        name = "count_matmuls"
        requires = frozenset({"traced"})

        def run(self, tg, ctx):
            n = sum(1 for node in tg.call_nodes() if node.target == torch.ops.aten.mm.default)
            return tg, PassResult(self.name, changed=False, stats={"mm": n})

What a pass reads is all in its PassContext: the Layout, the ClusterSpec (or None)
and PassOptions, the typed per-process settings the Layout does not hold (tp_rank,
dp_rank, optimizer_memory, memory_budget, pipeline_cuts, cut_inside_blocks, amp_lists,
hierarchy_form; each field says which pass reads it and who sets it). A pass of your
own takes its settings in its constructor.

The deferred re-trace, a hand-off between forward-level passes. Such a pass (tensor
parallelism, AMP) changes the forward by adding a hook to `tg.source` and tracing the
joint graph again (`trace.retrace`). Two in a row would trace twice, so:

- a pass that reads nothing of its input but `tg.source` (and what of `tg.signature`
  a re-trace does not change), and re-traces from it, sets
  `GraphPass.retraces_from_source` (AMP, tensor parallelism). The manager then hands it
  its input as the previous pass left it, possibly with `tg.retrace_pending` set
  (`tg.gm` not yet traced with the newest hook): it must not read `tg.gm`. If it
  returns its input unchanged (AMP off), the pending re-trace stays for the manager.
- the manager sets `PassContext.may_defer_retrace` for the pass right before such a
  pass. That pass may then call `trace.retrace(..., deferred=True)`: the hook goes into
  `tg.source`, the trace is left to the next pass (`retrace_pending` set, `gm` still
  the input's), one trace saved. Only when nothing the pass returns (its stats, its
  `attrs`) comes from running the hook (tensor parallelism: its plan is solved before
  the re-trace).
- before every pass that does not re-trace from the source, and after the last one,
  the manager runs the pending re-trace (`trace.complete_pending_retrace`): no other
  pass, and no caller of the manager, sees a graph with `retrace_pending` set.
- a caller may hand the manager a graph whose first trace is pending
  (`trace.pending_trace`: the planner, whose layouts all start with AMP or tensor
  parallelism): it is traced like a deferred re-trace, once, with the first passes'
  hooks.

A pass that does not re-trace has nothing to do for this: it ignores
`may_defer_retrace` and leaves `retraces_from_source` False.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import OptimizerMemory, optimizer_memory
from autopar.compiler.ir.graph import TrainGraph
from autopar.layout import Layout


@dataclass(frozen=True)
class PassOptions:
    """The settings of the default passes that the Layout does not hold: what differs
    between the processes of one job (ranks), what the caller knows and the graph does
    not (the optimizer, a memory budget), pinned pipeline cuts and AMP's lists.

    `PassOptions.of` also takes a mapping of these field names (what `run_passes(...,
    options=)` and `PassContext(options=)` accept); any other name is refused."""

    # tensor_parallel: which tensor-parallel rank's blocks this process's program holds.
    # Set by autopar.compile (the launched rank % tp); 0 when planning or costing
    tp_rank: int = 0
    # insert_allreduce, with ZeRO >= 2: which block of each embedding table whose
    # gradient comes from gathered rows this data-parallel rank builds. Set by
    # autopar.compile (the launched rank's coordinate on the dp mesh dim)
    dp_rank: int = 0
    # recompute with Layout.recompute="auto": what the optimizer holds, for the step's
    # peak (an OptimizerMemory, or a name of analysis.memory.OPTIMIZERS). Set by
    # autopar.compile (profile_optimizer of the user's optimizer factory)
    optimizer_memory: OptimizerMemory | str = "adamw"
    # recompute with Layout.recompute="auto", and assign_stages (the bytes each pipeline
    # stage's cut must fit in): the bytes per device the step must fit in; None: the
    # cluster's device.memory_bytes. Set by callers who want a tighter budget
    memory_budget: int | None = None
    # assign_stages: module paths that each start a new pipeline stage, instead of the
    # balanced cuts: a repeated block, or a module inside one. Set by the planner (its
    # pipeline templates) and by autopar.compile(pass_options=)
    pipeline_cuts: tuple[str, ...] | None = None
    # assign_stages without pipeline_cuts: True lets a balanced cut between blocks move
    # to a module inside a neighbouring block where the slowest stage, its sends and
    # receives counted, is then faster; False keeps every cut between blocks. The
    # planner's pipeline templates (two blocks, cut between them) cost cuts between
    # blocks, and a Plan chosen from one compiles with False (Plan.pass_options)
    cut_inside_blocks: bool = True
    # amp: aten ops moved between AMP's lists, {"white": [...], "black": [...], "gray":
    # [...]} (an AutoMixedPrecision(amp_lists=...) of its own wins). Set by
    # autopar.compile(amp_lists=...)
    amp_lists: Mapping[str, Sequence[str]] | None = None
    # insert_allreduce with Layout.allreduce="hierarchical": "leaders" (reduce, the
    # leaders' all-reduce, broadcast), "shards" (reduce-scatter, the shards' all-reduce,
    # all-gather), or "auto": shards on NCCL, leaders on gloo (which runs
    # reduce_scatter_tensor as an all-reduce)
    hierarchy_form: str = "auto"

    def __post_init__(self) -> None:
        for name in ("tp_rank", "dp_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"pass option {name} must be an int >= 0, got {value!r}")
        if self.memory_budget is not None:
            if not isinstance(self.memory_budget, (int, float)) or self.memory_budget <= 0:
                raise ValueError(f"pass option memory_budget must be a number of bytes > 0 "
                                 f"or None, got {self.memory_budget!r}")
            object.__setattr__(self, "memory_budget", int(self.memory_budget))
        optimizer_memory(self.optimizer_memory)  # an unknown optimizer name fails here
        if self.hierarchy_form not in ("auto", "leaders", "shards"):
            raise ValueError(f"pass option hierarchy_form must be 'auto', 'leaders' or "
                             f"'shards', got {self.hierarchy_form!r}")
        if not isinstance(self.cut_inside_blocks, bool):
            raise ValueError(f"pass option cut_inside_blocks must be True or False, got "
                             f"{self.cut_inside_blocks!r}")
        if self.pipeline_cuts is not None:
            if isinstance(self.pipeline_cuts, str):
                raise ValueError(f"pass option pipeline_cuts must be a list of module paths, "
                                 f"got the string {self.pipeline_cuts!r}; write "
                                 f"[{self.pipeline_cuts!r}]")
            object.__setattr__(self, "pipeline_cuts", tuple(self.pipeline_cuts))
        if self.amp_lists is not None:  # frozen like the rest (a string stays, for amp's error)
            object.__setattr__(self, "amp_lists", MappingProxyType(
                {k: v if isinstance(v, str) else tuple(v) for k, v in self.amp_lists.items()}))

    @classmethod
    def of(cls, options: PassOptions | Mapping[str, Any] | None) -> PassOptions:
        """`options` as PassOptions: itself, the defaults for None, or a mapping of field
        names to values."""
        if options is None:
            return cls()
        if isinstance(options, PassOptions):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(f"pass options must be a PassOptions or a mapping of its field "
                            f"names, got {type(options).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown pass option(s) {unknown}; the options are {known} "
                            "(PassOptions). A pass of your own takes its settings in its "
                            "constructor")
        return cls(**options)


@dataclass(frozen=True)
class PassContext:
    """Everything a pass may read: the layout, the cluster and the pass options. A
    mapping given as `options` becomes PassOptions (`PassOptions.of`)."""

    layout: Layout = Layout()
    cluster: ClusterSpec | None = None  # None: none given (a pass that costs says what it assumes)
    options: PassOptions = PassOptions()
    # True: the pass after this one re-traces from the source (its
    # GraphPass.retraces_from_source is set), so this pass may leave its own re-trace to
    # it (trace.retrace(..., deferred=True)); set by the PassManager (module docstring)
    may_defer_retrace: bool = False
    # True: the input graph is one the pass before this one made in this run of the
    # PassManager, which nothing else holds, so the pass may rewrite it in place
    # (`writable`) instead of copying it first; set by the PassManager
    owns_input: bool = False

    def __post_init__(self) -> None:
        if self.cluster is not None and not isinstance(self.cluster, ClusterSpec):
            raise TypeError(f"the cluster must be an autopar.ClusterSpec or None, got "
                            f"{type(self.cluster).__name__} {self.cluster!r:.80}")
        if not isinstance(self.options, PassOptions):
            object.__setattr__(self, "options", PassOptions.of(self.options))


def writable(tg: TrainGraph, ctx: PassContext) -> TrainGraph:
    """The graph a pass rewrites: `tg` itself (as a new TrainGraph sharing its graph,
    with its own `attrs` dict) when the pass owns its input (`ctx.owns_input`), else a
    copy (`TrainGraph.copy`). A copy of a large joint graph costs as much as a small
    pass itself; the planner runs the passes after the forward level on every layout
    it costs, so each saves one."""
    if ctx.owns_input:
        return dataclasses.replace(tg, attrs=dict(tg.attrs))
    return tg.copy()


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
    # the Layout fields `run` reads (ctx.layout.X): the planner shares one rewritten
    # graph among the layouts each pass of the list reads alike (`reads`)
    layout_fields: ClassVar[frozenset[str]] = frozenset()
    # True for a pass that rewrites the forward and so runs before every joint-graph
    # pass (tensor parallelism, AMP, recomputation)
    forward_level: ClassVar[bool] = False

    def reads(self, layout: Layout) -> tuple:
        """What of `layout` this pass's rewrite depends on: (field, value) of each of
        `layout_fields`. A pass whose rewrite depends on less (a product of fields, a
        threshold) or more (the whole layout) overrides it. The cluster and
        PassContext.options are not in it: a planner holds them fixed."""
        return tuple((f, getattr(layout, f)) for f in sorted(self.layout_fields))

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
