"""The traces the planner costs layouts on: one per shape of a rank's micro-batch and
number of repeated blocks kept, shared by every layout with those.

With `trace_blocks` (planner/scaled.py) a step without a pipeline traces that many of
the model's repeated blocks and scales their costs to the whole stack, and a pipeline
of several stages traces the two blocks of its template (planner/replicated.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.summary import GraphSummary, summarize
from autopar.compiler.ir.annotate import repeated_block_container
from autopar.compiler.ir.batch import LossFn
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.trace import (
    batch_size,
    complete_pending_retrace,
    local_example,
    TraceSource,
    pending_trace,
    trace_source,
)
from autopar.compiler.passes.amp import AutoMixedPrecision
from autopar.compiler.passes.defaults import is_pipelined, reads_of, run_passes
from autopar.compiler.planner.replicated import TEMPLATE_BLOCKS
from autopar.compiler.planner.scaled import multiplicities, reduced, scale_summary
from autopar.compiler.planner.search import PlanArgumentError
from autopar.layout import Layout

# (shapes of one rank's micro-batch, blocks kept or None for all): what a trace is shared by
TraceKey = tuple


class Scaling(NamedTuple):
    """How a trace of a few repeated blocks stands for the whole stack."""

    path: str  # the module path of the repeated blocks' container
    counts: tuple[int, ...]  # how many of the stack's blocks each traced block stands for


@dataclass(frozen=True)
class TracedEntry:
    """One traced micro-batch and what the planner reads of it without the graph."""

    key: TraceKey
    # None: kept from a worker, which sends no graph. Its joint graph may be pending
    # (trace.pending_trace) when `forward` holds the micro-batch's first trace
    graph: TrainGraph | None
    model_flops: int  # of the whole stack (scaled when only a few blocks were traced)
    scaling: Scaling | None  # None: every block was traced
    # the trace's attention written out op by op (trace_train_step's attrs
    # "eager_attention"): {"fused": count, "left": [(softmax node, why), ...]}, or {}
    attention: dict = field(default_factory=dict)
    # the FLOPs its kernels perform (GraphSummary.flops, scaled likewise): a causal
    # attention's scores above the diagonal skipped, the backward's recomputed ones in
    executed_flops: int = 0
    # (reads_of the AMP pass, the graph after it): the trace of the layout that asked for
    # this micro-batch first, when that runs AMP first (Traces' `cluster`): its one trace,
    # whose FLOPs the entry holds; the graph the rewrites of that precision start from
    forward: tuple[tuple, TrainGraph] | None = None

    def without_graph(self) -> TracedEntry:
        return replace(self, graph=None, forward=None)


# blocks `trace_blocks="auto"` traces of a model with more repeated blocks than that: as
# many as a pipeline's template, so a step with and without a pipeline share the size
AUTO_BLOCKS = TEMPLATE_BLOCKS


def resolve_trace_blocks(model: torch.nn.Module, trace_blocks: int | str | None) -> int | None:
    """plan's and estimate's `trace_blocks` as the planner uses it: blocks to trace, or None
    to trace the whole model (exact).

    "auto" (the default): AUTO_BLOCKS of the model's repeated blocks
    (`repeated_block_container`) when it has more, else exact. "exact" or None: the whole
    model, every layout (minutes for a model of billions of parameters: each block's ops
    are traced, rewritten and replayed). k: k blocks, scaled to the stack."""
    if trace_blocks is None or trace_blocks == "exact":
        return None
    if trace_blocks == "auto":
        found = repeated_block_container(model)
        if found is None or found[1] <= AUTO_BLOCKS or unlike_block(model, found[0]):
            return None
        return AUTO_BLOCKS
    if isinstance(trace_blocks, bool) or not isinstance(trace_blocks, int) or trace_blocks < 1:
        raise PlanArgumentError(f"trace_blocks must be 'auto', 'exact' (or None) or a positive "
                         f"number of blocks, got {trace_blocks!r}")
    found = repeated_block_container(model)
    differs = unlike_block(model, found[0]) if found is not None else None
    if differs:
        raise PlanArgumentError(f"trace_blocks={trace_blocks}: the blocks of "
                         f"{found[0] or type(model).__name__} are not alike "
                         f"({differs}), so a few cannot stand for the rest; use "
                         f"trace_blocks='exact'")
    return trace_blocks


def unlike_block(model: torch.nn.Module, path: str) -> str | None:
    """Why the blocks of the container at `path` cannot stand for one another (a block
    whose parameters and buffers differ in name, shape or dtype from the first's), or
    None when they are alike."""
    blocks = list(model.get_submodule(path))

    def state(block: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(name, tuple(t.shape), t.dtype) for name, t in
                [*block.named_parameters(), *block.named_buffers()]]

    first = state(blocks[0])
    for i, block in enumerate(blocks[1:], 1):
        if state(block) != first:
            return f"block {i}'s parameters differ from block 0's"
    return None


def stages_of(layout: Layout) -> int:
    """Pipeline stages of `layout` (pp x virtual stages; 1 without a pipeline)."""
    return layout.pp * layout.virtual_stages if is_pipelined(layout) else 1


def scaled_summary(summary: GraphSummary, tg: TrainGraph, scaling: Scaling | None
                   ) -> GraphSummary:
    """`summary` of `tg` scaled to the whole stack (itself when every block was traced)."""
    return summary if scaling is None else scale_summary(summary, tg, scaling.counts)


def _attention_clause(attention: dict) -> str:
    """What the trace did with attention written out op by op, for `Traces.describe`."""
    if not attention or not (attention["fused"] or attention["left"]):
        return ""
    out = ""
    if attention["fused"]:
        out = (f"; attention written out op by op costed as the fused kernel a GPU runs "
               f"({attention['fused']} in the trace; DeviceSpec.attention='unfused' "
               f"costs its ops)")
    if attention["left"]:
        name, why = attention["left"][0]
        more = f" and {len(attention['left']) - 1} more" if len(attention["left"]) > 1 else ""
        out += f"; a softmax costed as written, not as attention: {name} ({why}){more}"
    return out


class Traces:
    """The traces of one model's micro-batches, by `key`, and what decides how a
    layout is traced: how many blocks it keeps, and whether it is costed from a
    two-stage pipeline template."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple, loss_fn: LossFn | None,
                 trace_blocks: int | None, kernels: str = "cpu",
                 attention: str = "fused", cluster: ClusterSpec | None = None) -> None:
        self.model, self.example_inputs, self.loss_fn = model, example_inputs, loss_fn
        # the cluster the default passes run on, None for a list of the caller's own: with
        # it, a micro-batch first asked for by a layout with AMP is traced once, with AMP's
        # hook (`_first_trace`), not once without and again with it
        self.cluster = cluster
        self.trace_blocks = trace_blocks
        # whose kernels the trace takes (trace_train_step's `kernels`): the cluster's device
        # kind, so a GPU cluster's step is costed with the dropouts a GPU runs
        self.kernels, self.attention = kernels, attention
        self._stack = repeated_block_container(model)  # (path, blocks) or None: for describe
        self._entries: dict[TraceKey, TracedEntry] = {}
        self._keys: dict[Layout, TraceKey] = {}  # asked for every layout the search sees
        # (blocks kept, samples) -> the source traced here: what the batch-split analysis
        # asks of one trace at another batch size (TraceSource.resized) is taken from
        # these before a new export
        self._sources: dict[tuple[int | None, int], TraceSource] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: TraceKey) -> bool:
        return key in self._entries

    def has_graph(self, key: TraceKey) -> bool:
        """Whether the trace of `key` was made here (a worker's comes without its graph)."""
        return key in self._entries and self._entries[key].graph is not None

    def entry(self, key: TraceKey) -> TracedEntry:
        return self._entries[key]

    def keep(self, entry: TracedEntry) -> None:
        """Keep a trace made elsewhere (a worker's), unless one of its key is here."""
        self._entries.setdefault(entry.key, entry)

    def key(self, layout: Layout) -> TraceKey:
        """(shapes of one rank's micro-batch, blocks kept): known without tracing."""
        if layout not in self._keys:
            local = local_example(self.example_inputs, layout)
            self._keys[layout] = (
                tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in local),
                self._blocks_kept(layout))
        return self._keys[layout]

    def get(self, layout: Layout, graph: bool = False) -> TracedEntry:
        """The trace of `layout`'s micro-batch, traced if new, or if `graph` asks for the
        graph of one kept from a worker."""
        key = self.key(layout)
        if key not in self._entries or (graph and self._entries[key].graph is None):
            self._entries[key] = self._trace(layout, key)
        return self._entries[key]

    def _trace(self, layout: Layout, key: TraceKey) -> TracedEntry:
        keep = key[1]
        local = local_example(self.example_inputs, layout)
        with reduced(self.model, keep) as stack:
            source = trace_source(self.model, local, self.loss_fn, kernels=self.kernels,
                                  attention=self.attention, whole=self.example_inputs,
                                  around=lambda: reduced(self.model, keep))
        size = batch_size(local)
        if source.resized is not None:
            source = replace(source, resized=self._resized(keep, source.resized))
        if size is not None:
            self._sources.setdefault((keep, size), source)
        scaling = Scaling(stack[0], multiplicities(stack[1], keep)) \
            if keep and stack and stack[1] > keep else None
        graph, forward = self._first_trace(pending_trace(source), layout)
        traced = graph if forward is None else forward[1]  # AMP adds casts, no FLOPs
        summary = scaled_summary(summarize(traced), traced, scaling)
        return TracedEntry(key, graph, summary.model_flops, scaling,
                           dict(traced.attrs.get("eager_attention", {})), summary.flops,
                           forward)

    def _first_trace(self, pending: TrainGraph, layout: Layout
                     ) -> tuple[TrainGraph, tuple[tuple, TrainGraph] | None]:
        """(the entry's graph, its `forward`): the joint graph traced, or, when the
        default passes of `layout` start with AMP, left pending and traced with AMP's
        hook: every rewrite of the micro-batch re-traces from the source (AMP, tensor
        parallelism), so the trace without hooks would serve none of them."""
        if self.cluster is None or layout.amp == "off":
            return complete_pending_retrace(pending), None
        amp = [AutoMixedPrecision()]
        return pending, (reads_of(amp, layout), run_passes(pending, layout, self.cluster, amp)[0])

    def in_precision(self, layout: Layout, cluster: ClusterSpec) -> TrainGraph:
        """The joint graph of `layout`'s micro-batch in `layout.amp`'s precision: the
        trace after the AMP pass (the one traced first when it was, else AMP run now on
        `cluster`), the plain trace with AMP off."""
        if layout.amp == "off":
            return self.joint(layout)
        amp = [AutoMixedPrecision()]
        entry = self.get(layout, graph=True)
        if entry.forward is not None and entry.forward[0] == reads_of(amp, layout):
            return entry.forward[1]
        return run_passes(entry.graph, layout, cluster, amp)[0]

    def joint(self, layout: Layout) -> TrainGraph:
        """The joint graph of `layout`'s micro-batch, without AMP (traced now if it was
        left pending)."""
        entry = self.get(layout, graph=True)
        if entry.graph.retrace_pending:
            entry = replace(entry, graph=complete_pending_retrace(entry.graph))
            self._entries[entry.key] = entry
        return entry.graph

    def _blocks_kept(self, layout: Layout) -> int | None:
        """Blocks to trace (None: all): a pipeline of several stages traces the two of its
        template (planner/replicated.py); accumulation without a pipeline, like an
        unpipelined step, `trace_blocks` of them, its one stage's programs replayed over
        the scaled summary (estimate._pipeline_memory)."""
        if self.trace_blocks is None:
            return None
        return TEMPLATE_BLOCKS if stages_of(layout) > 1 else self.trace_blocks

    def describe(self, layout: Layout) -> str:
        """How `layout` is traced, in a sentence for the plan and the prediction."""
        keep = self._blocks_kept(layout)
        found = self._stack
        entry = self._entries.get(self.key(layout))
        attention = _attention_clause(entry.attention) if entry is not None else ""
        if keep is None or found is None or found[1] <= keep:
            return "exact: the whole model traced" + attention
        path, count = found
        if stages_of(layout) > 1:
            return (f"per block: a two-stage template of {keep} of the {count} blocks of "
                    f"{path}, replicated to {stages_of(layout)} stages, cut between blocks "
                    f"(PassOptions.cut_inside_blocks=False; trace_blocks='exact' traces "
                    f"every block){attention}")
        return (f"per block: {keep} of the {count} blocks of {path} traced, their costs "
                f"scaled to the stack (trace_blocks='exact' traces every block){attention}")

    def is_template(self, layout: Layout) -> bool:
        """Whether `layout` is costed from a two-stage template (a scaled trace, several
        stages); traces it if new."""
        return self.get(layout).scaling is not None and stages_of(layout) > 1

    def templated(self, layout: Layout) -> bool:
        """Whether `layout` would be costed from a template, without tracing it."""
        return self.trace_blocks is not None and stages_of(layout) > 1

    def _resized(self, keep: int | None, export: Callable[[frozenset[int]], TraceSource]
                 ) -> Callable[[frozenset[int]], TraceSource]:
        """TraceSource.resized of a trace keeping `keep` blocks: a source already traced
        here at a size not excluded, else `export`'s."""
        def resized(exclude: frozenset[int]) -> TraceSource:
            found = [src for (k, n), src in self._sources.items()
                     if k == keep and n >= 2 and n not in exclude]
            return found[0] if found else export(exclude)
        return resized

    def micro_batch(self, layout: Layout) -> float:
        """One rank's micro-batch size (the example's batch when it has no batch dim)."""
        batch = batch_size(self.example_inputs)
        return 1.0 if batch is None else batch / (layout.dp * layout.microbatches)

    def most_shared(self, layouts: Sequence[Layout]) -> Layout:
        """The first of `layouts` whose trace the most of them share."""
        counts = Counter(self.key(layout) for layout in layouts)
        return max(layouts, key=lambda layout: counts[self.key(layout)])

