"""The rewritten graphs the planner costs: the pass list run on a trace once for every
set of layouts that its passes read alike.

What a pass reads of a layout is its own declaration (GraphPass.layout_fields and
GraphPass.reads, passes/defaults.reads_of), so a graph is shared exactly as far as
the passes allow: by every schedule and micro-batch count of one stage count, every
bucket size of a pipeline. The graph after the forward-level passes (tensor
parallelism and AMP re-trace the forward; recomputation rewrites it before the
joint-graph passes) is kept too, by what those read: every dp, ZeRO stage and bucket
size shares one solve and one re-trace.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.summary import GraphSummary, summarize
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.passes.assign_stages import AssignStages
from autopar.compiler.passes.base import GraphPass
from autopar.compiler.passes.defaults import (
    default_passes,
    forward_level_passes,
    is_pipelined,
    reads_of,
    retraces,
    run_passes,
    split_forward_level,
)
from autopar.compiler.planner.replicated import Template, template_of
from autopar.compiler.planner.scaled import split_copies
from autopar.compiler.planner.stages import StageSummary, stage_summary
from autopar.compiler.planner.traces import (
    TracedEntry,
    TraceKey,
    Traces,
    scaled_summary,
)
from autopar.layout import Layout

# (trace key, what the passes read of the layout they run under): one rewritten graph
RewriteKey = tuple


@dataclass(frozen=True)
class RewrittenEntry:
    """A rewritten graph as the cost model reads it: its summary (and stages when
    pipelined), or the pipeline template its pipelines are replicated from."""

    summary: GraphSummary | None = None
    stages: StageSummary | None = None
    graph: TrainGraph | None = None  # an exact trace's pipeline: its ranks' memory replay
    template: Template | None = None


@dataclass(frozen=True)
class ExportedEntry:
    """A rewritten entry as a worker sends it (plain data: no graphs)."""

    key: RewriteKey
    entry: RewrittenEntry
    table: dict | None  # the tensor-parallel placements (tp > 1)
    trace: TracedEntry


class Group(NamedTuple):
    """Layouts that share a trace and the re-tracing passes' graph: what a worker
    process rewrites together (planner/workers.py)."""

    trace_key: TraceKey
    retraced: tuple  # what the re-tracing forward-level passes read


def template_layout(layout: Layout) -> Layout:
    """The layout a pipeline's template is rewritten under: two stages, one per block (a
    pipeline sums its gradients flat and every step: Layout.allreduce, local_sgd, dgc)."""
    return layout.synchronous().replace(pp=2, virtual_stages=1, schedule="1f1b",
                                        allreduce="flat")


@functools.lru_cache(maxsize=1 << 15)  # asked for every bound of a pipeline: kept
def template_key(layout: Layout) -> tuple:
    """What the default passes read of `layout`'s pipeline template: the pipelines equal
    in it are costed from templates that differ only in their micro-batch size."""
    run_on = template_layout(layout)
    return reads_of(planner_passes(run_on, template=True), run_on)


def planner_passes(layout: Layout, template: bool) -> list[GraphPass]:
    """default_passes(layout); a pipeline template's AssignStages cuts on time alone (its
    cut is pinned between its two blocks, whatever the stages' bytes), so its key reads
    only the stage count: every micro-batch count and schedule shares the template."""
    passes = default_passes(layout)
    if template:
        passes = [AssignStages(weigh_memory=False) if isinstance(p, AssignStages) else p
                  for p in passes]
    return passes


class Rewrites:
    """The rewritten graphs of one model on one cluster, by `key`, with their
    tensor-parallel tables; `passes` (None: the default list) is the pass list."""

    def __init__(self, traces: Traces, cluster: ClusterSpec,
                 passes: Sequence[GraphPass | str] | None,
                 options: dict[str, Any] | None = None) -> None:
        self.traces, self.cluster, self.passes = traces, cluster, passes
        # PassOptions fields every rewrite runs with (a template's pinned cut added)
        self.options = dict(options or {})
        self._entries: dict[RewriteKey, RewrittenEntry] = {}
        self._tables: dict[RewriteKey, dict] = {}
        self._keys: dict[Layout, RewriteKey] = {}  # asked for every layout costed
        self._groups: dict[Layout, Group] = {}
        self._forward: dict[tuple, TrainGraph] = {}  # graphs after forward-level passes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: RewriteKey) -> bool:
        return key in self._entries

    def entry(self, key: RewriteKey) -> RewrittenEntry:
        return self._entries[key]

    def table(self, key: RewriteKey) -> dict | None:
        return self._tables.get(key)

    @property
    def forward_graphs(self) -> int:
        """How many graphs after the forward-level passes are kept."""
        return len(self._forward)

    def keep(self, exported: ExportedEntry) -> bool:
        """Keep an entry rewritten elsewhere (a worker's); False when one of its key is
        here already."""
        if exported.key in self._entries:
            return False
        self._entries[exported.key] = exported.entry
        if exported.table is not None:
            self._tables[exported.key] = exported.table
        return True

    def export(self, key: RewriteKey) -> ExportedEntry:
        """The entry of `key` as plain data, with its trace's FLOPs and scaling."""
        return self._exported(key, self._entries[key], self._tables.get(key))

    def _exported(self, key: RewriteKey, entry: RewrittenEntry, table: dict | None
                  ) -> ExportedEntry:
        if entry.graph is not None:
            raise RuntimeError("an exact trace's rewritten graph is not sent or set aside")
        return ExportedEntry(key, entry, table, self.traces.entry(key[0]).without_graph())

    def key(self, layout: Layout) -> RewriteKey:
        """The key of `layout`'s rewritten graph: its trace's, and what its passes read
        of the layout they run under (traces `layout` if new: a template's layout is
        not `layout`). A list of the caller's own passes reads the whole layout."""
        if layout not in self._keys:
            trace_key = self.traces.key(layout)
            run_on = self._run_on(layout)
            template = self.traces.is_template(layout)
            reads = reads_of(planner_passes(run_on, template), run_on) if self.passes is None \
                else (("layout", run_on),)
            self._keys[layout] = (trace_key, reads)
        return self._keys[layout]

    def group_of(self, layout: Layout) -> Group:
        """`layout`'s Group, known without tracing."""
        if layout not in self._groups:
            passes = [p for p in forward_level_passes(layout) if retraces(p)]
            self._groups[layout] = Group(self.traces.key(layout), reads_of(passes, layout))
        return self._groups[layout]

    def _run_on(self, layout: Layout) -> Layout:
        return template_layout(layout) if self.traces.is_template(layout) else layout

    def rewrite(self, layout: Layout) -> RewrittenEntry:
        """Rewrite `layout`'s trace and keep the entry under `key(layout)`: a template
        (two stages cut between the two traced blocks), or the summary of the graph."""
        key, entry, table = self._rewritten(layout)
        self._entries[key] = entry
        if table is not None:
            self._tables[key] = table
        return entry

    def rewrite_aside(self, layout: Layout) -> ExportedEntry:
        """`layout`'s entry rewritten as `rewrite` does but not kept: as a worker sends it
        (plain data), for the caller to keep aside until the search asks for it (what
        the search knows when it decides stays what it asked for: Estimator.adopt)."""
        return self._exported(*self._rewritten(layout))

    def _rewritten(self, layout: Layout) -> tuple[RewriteKey, RewrittenEntry, dict | None]:
        """(key, entry, tensor-parallel table or None) of `layout`, rewritten now."""
        key = self.key(layout)
        trace = self.traces.get(layout, graph=True)
        template = self.traces.is_template(layout)
        options: dict[str, Any] = dict(self.options)
        if template:
            options["pipeline_cuts"] = [f"{trace.scaling.path}.1"]
        rewritten = self.run_passes(trace, layout, self._run_on(layout), options)
        if template:
            entry = RewrittenEntry(template=template_of(rewritten, sum(trace.scaling.counts),
                                                        self.cluster))
        else:
            stages = stage_summary(rewritten) if is_pipelined(layout) else None
            summary = scaled_summary(summarize(rewritten), rewritten, trace.scaling)
            if stages is not None:  # accumulation over a scaled trace: one stage
                summary, stages = split_copies(summary, stages)
            entry = RewrittenEntry(summary, stages, None if trace.scaling else rewritten)
        return key, entry, rewritten.attrs.get("tp")

    def run_passes(self, trace: TracedEntry, asked: Layout, layout: Layout,
                   options: dict[str, Any]) -> TrainGraph:
        """run_passes of `layout` (the one `asked` is costed from) on `trace`; with the
        default pass list (`planner_passes`, for a pipeline's template where `asked` is
        costed from one), from the graph after its forward-level passes (the costly
        re-traces), kept for the layouts that those passes read alike."""
        if self.passes is not None:
            return run_passes(self.traces.joint(asked), layout, self.cluster, self.passes,
                              options=options)[0]
        first, rest = split_forward_level(planner_passes(layout, self.traces.is_template(asked)))
        if trace.forward is not None:  # the micro-batch was traced with AMP's hook
            self._forward.setdefault((trace.key, trace.forward[0], ()), trace.forward[1])
        # a pass list that re-traces first takes the trace still pending (it traces once)
        traced = trace.graph if first and retraces(first[0]) else self.traces.joint(asked)
        start = self._forward_level(traced, trace.key, first, layout, options)
        return run_passes(start, layout, self.cluster, rest, options=options)[0]

    def _forward_level(self, traced: TrainGraph, trace_key: TraceKey, first: list[GraphPass],
                       layout: Layout, options: dict[str, Any]) -> TrainGraph:
        """`traced` after the forward-level passes `first`, kept by what they read. A
        last one that does not re-trace (recomputation) runs on the graph kept for those
        before it: its variants share their solve and re-trace."""
        # the cuts are AssignStages' option: a pipeline's template shares the graph of
        # the unpipelined layout with the same trace
        shared = tuple(sorted((k, repr(v)) for k, v in options.items() if k != "pipeline_cuts"))
        key = (trace_key, reads_of(first, layout), shared)
        if key not in self._forward:
            if len(first) > 1 and not retraces(first[-1]):
                before = self._forward_level(traced, trace_key, first[:-1], layout, options)
                self._forward[key] = run_passes(before, layout, self.cluster, first[-1:],
                                                options=options)[0]
            else:
                self._forward[key] = run_passes(traced, layout, self.cluster, first,
                                                options=options)[0]
        return self._forward[key]
