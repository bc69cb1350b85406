"""The default list of passes for a Layout, in the order they run, and `run_passes`,
which runs a list of passes on a TrainGraph under the PassManager."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.trace import TraceSource, complete_pending_retrace, pending_trace
from autopar.compiler.passes.amp import AutoMixedPrecision
from autopar.compiler.passes.assign_stages import AssignStages
from autopar.compiler.passes.base import GraphPass, PassContext, PassOptions, PassResult
from autopar.compiler.passes.fuse_regions import FuseRegions
from autopar.compiler.passes.global_loss_mean import GlobalLossMean
from autopar.compiler.passes.insert_allreduce import InsertAllReduce
from autopar.compiler.passes.manager import PassManager, get_pass
from autopar.compiler.passes.recompute import Recompute
from autopar.compiler.passes.shard_parameters import ShardParameters
from autopar.compiler.passes.sync_batch_norm import SyncBatchNorm
from autopar.compiler.passes.tensor_parallel import TensorParallel
from autopar.layout import Layout


def is_pipelined(layout: Layout) -> bool:
    """Pipeline stages or micro-batches: the step runs as per-stage programs by a schedule
    (gradient accumulation is the one-stage case)."""
    return layout.pp > 1 or layout.microbatches > 1


def default_passes(layout: Layout) -> list[GraphPass]:
    """tensor_parallel -> amp -> recompute -> global_loss_mean -> pipeline stages or
    (batch norm statistics ->) data-parallel sync (-> zero-3 parameter sharding) ->
    fusion. With Layout.local_sgd,
    the steady state's program: no global loss mean, no gradient sync. With Layout.dgc,
    its compressed steps' program: each rank's share of the global loss's gradient, not
    summed (runtime/dgc.py exchanges it).

    Pipelined steps sum gradients over data-parallel ranks after the last micro-batch
    (in the pipeline runtime), so they get no all-reduce pass."""
    # forward-level passes re-trace the forward, so they come before every joint-graph
    # pass; AMP's hook wraps tensor parallelism's: it casts each op's inputs by its lists
    # before the op runs on local shards (collectives then carry half-precision values)
    first: list[GraphPass] = [TensorParallel()] if layout.tp > 1 else []
    first += [AutoMixedPrecision()] if layout.amp != "off" else []
    first += [Recompute()] if layout.recompute != "none" else []
    # the batch is cut into dp * microbatches shards: a loss over a count the batch
    # decides must divide by the whole batch's count
    # Local SGD's steady state: each rank's own mean loss and gradients, nothing summed
    # over dp (its warm-up is the layout without local_sgd: runtime/local_sgd.py)
    # (a pipeline's Local SGD runs the synchronous program: its runtime skips the dp sum)
    local = layout.local_sgd is not None and not is_pipelined(layout)
    first += [GlobalLossMean()] if layout.dp * layout.microbatches > 1 and not local else []
    last = [FuseRegions()] if layout.fusion else []
    if is_pipelined(layout):
        return first + [AssignStages()] + last
    # DGC: the gradients stay this rank's share of the global one (runtime/dgc.py sums
    # them, sparsified); its dense steps are the layout without dgc
    sync = [InsertAllReduce()] if layout.dp > 1 and not local and layout.dgc is None else []
    # a batch norm's statistics over the whole batch (Local SGD's replicas train apart)
    stats = [SyncBatchNorm()] if layout.dp > 1 and not local else []
    return first + stats + sync + ([ShardParameters()] if layout.zero == 3 else []) + last


def split_forward_level(passes: Sequence[GraphPass]) -> tuple[list[GraphPass], list[GraphPass]]:
    """(the leading forward-level passes of `passes`, the rest): the graph after the
    first part serves every layout they read alike (`reads_of`), whatever the rest read."""
    cut = next((k for k, p in enumerate(passes) if not p.forward_level), len(passes))
    return list(passes[:cut]), list(passes[cut:])


def forward_level_passes(layout: Layout) -> list[GraphPass]:
    """The forward-level passes of the default list for `layout`, in order."""
    return split_forward_level(default_passes(layout))[0]


def retraces(p: GraphPass) -> bool:
    """Whether `p` traces the forward again (tensor parallelism, AMP): it needs a graph
    that can still be re-traced from its source. Recomputation, forward-level too,
    rewrites the joint graph."""
    return "retraceable" in p.requires


def reads_of(passes: Sequence[GraphPass], layout: Layout) -> tuple:
    """What `passes` read of `layout`: (name, GraphPass.reads) of each, in order. Two
    layouts with equal reads get the same graph from the same input, given the cluster
    and the options: what a planner keys the graphs it shares by."""
    return tuple((p.name, p.reads(layout)) for p in passes)


def run_passes(tg: TrainGraph, layout: Layout, cluster: ClusterSpec | None = None,
               passes: Sequence[GraphPass | str] | None = None,
               dump_dir: str | None = None,
               options: PassOptions | Mapping[str, Any] | None = None,
               record_rewrites: bool = False) -> tuple[TrainGraph, list[PassResult]]:
    """Rewrite `tg` with the default passes for `layout` (or `passes`: pass objects or
    registered names); `options`: PassContext.options, a PassOptions or a mapping of its
    field names (e.g. {"tp_rank": 1}; another name raises TypeError listing them);
    `dump_dir`: write the IR after each pass there; `record_rewrites`: mark the nodes each
    pass changed (meta REWRITTEN_BY)."""
    chosen = pass_list(layout, passes)
    manager = PassManager(chosen, dump_dir=dump_dir, record_rewrites=record_rewrites)
    return manager.run(tg, PassContext(layout=layout, cluster=cluster,
                                       options=PassOptions.of(options)))


def pass_list(layout: Layout, passes: Sequence[GraphPass | str] | None = None
              ) -> list[GraphPass]:
    """The passes `run_passes` runs for `layout`: the default list, or `passes` (pass
    objects or registered names)."""
    return default_passes(layout) if passes is None else [
        get_pass(p) if isinstance(p, str) else p for p in passes]


def first_graph(source: TraceSource, passes: Sequence[GraphPass]) -> TrainGraph:
    """The graph `passes` start from, given the exported step: its trace left pending
    (trace.pending_trace) when the first pass re-traces from the source anyway (tensor
    parallelism, AMP), so the step is traced once, with their hooks; traced otherwise.
    Several runs of such passes on it trace it once each, as they re-trace a traced
    one."""
    pending = pending_trace(source)
    if passes and passes[0].retraces_from_source:
        return pending
    return complete_pending_retrace(pending)
