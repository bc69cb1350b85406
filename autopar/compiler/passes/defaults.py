"""The default list of passes for a Layout, in the order they run, and `run_passes`,
which runs a list of passes on a TrainGraph under the PassManager."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.passes.amp import AutoMixedPrecision
from autopar.compiler.passes.assign_stages import AssignStages
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.fuse_regions import FuseRegions
from autopar.compiler.passes.global_loss_mean import GlobalLossMean
from autopar.compiler.passes.insert_allreduce import InsertAllReduce
from autopar.compiler.passes.manager import PassManager, get_pass
from autopar.compiler.passes.recompute import Recompute
from autopar.compiler.passes.shard_parameters import ShardParameters
from autopar.compiler.passes.tensor_parallel import TensorParallel
from autopar.layout import Layout


def is_pipelined(layout: Layout) -> bool:
    """Pipeline stages or micro-batches: the step runs as per-stage programs by a schedule
    (gradient accumulation is the one-stage case)."""
    return layout.pp > 1 or layout.microbatches > 1


def forward_level_passes(layout: Layout) -> list[GraphPass]:
    """The passes of the default list that re-trace the forward, in order. They read
    only `forward_level_fields` of the layout: layouts equal in those share their graph
    (the planner rewrites it once for every dp, ZeRO stage and bucket size)."""
    first: list[GraphPass] = [TensorParallel()] if layout.tp > 1 else []
    first += [AutoMixedPrecision()] if layout.amp != "off" else []
    first += [Recompute()] if layout.recompute != "none" else []
    return first


def retrace_fields(layout: Layout) -> tuple:
    """What the forward-level passes that re-trace (tensor parallelism, AMP) read of a
    layout, given a cluster: each names its own pass (tensor parallelism costs its
    placements on the cluster's devices, not on dp or pp; without a cluster it would
    read world_size)."""
    return layout.tp, layout.sequence_parallel, layout.amp


def forward_level_fields(layout: Layout) -> tuple:
    """What the forward-level passes read of a layout, given a cluster: `retrace_fields`
    and the recomputation policy; recompute="auto" reads the whole layout (its memory
    budget is the step's peak under the layout)."""
    fields = (*retrace_fields(layout), layout.recompute)
    return fields + (layout,) if layout.recompute == "auto" else fields


def default_passes(layout: Layout) -> list[GraphPass]:
    """tensor_parallel -> amp -> recompute -> global_loss_mean -> pipeline stages or
    data-parallel sync (-> zero-3 parameter sharding) -> fusion.

    Pipelined steps sum gradients over data-parallel ranks after the last micro-batch
    (in the pipeline runtime), so they get no all-reduce pass."""
    # forward-level passes re-trace the forward, so they come before every joint-graph
    # pass; AMP's hook wraps tensor parallelism's: it casts each op's inputs by its lists
    # before the op runs on local shards (collectives then carry half-precision values)
    first = forward_level_passes(layout)
    # the batch is cut into dp * microbatches shards: a loss over a count the batch
    # decides must divide by the whole batch's count
    first += [GlobalLossMean()] if layout.dp * layout.microbatches > 1 else []
    last = [FuseRegions()] if layout.fusion else []
    if is_pipelined(layout):
        return first + [AssignStages()] + last
    sync = [InsertAllReduce()] if layout.dp > 1 else []
    return first + sync + ([ShardParameters()] if layout.zero == 3 else []) + last


def run_passes(tg: TrainGraph, layout: Layout, cluster: Any = None,
               passes: Sequence[GraphPass | str] | None = None,
               dump_dir: str | None = None,
               options: dict[str, Any] | None = None) -> tuple[TrainGraph, list[PassResult]]:
    """Rewrite `tg` with the default passes for `layout` (or `passes`: pass objects or
    registered names); `options` become PassContext.options (e.g. "amp_lists");
    `dump_dir`: write the IR after each pass there."""
    chosen = default_passes(layout) if passes is None else [
        get_pass(p) if isinstance(p, str) else p for p in passes]
    manager = PassManager(chosen, dump_dir=dump_dir)
    return manager.run(tg, PassContext(layout=layout, cluster=cluster, options=options or {}))
