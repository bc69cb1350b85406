"""The Prediction of one layout: step time (cost_model.step_time for one whole-graph
step, pipeline_cost.pipeline_time for a pipelined or micro-batched one) and the memory
peak, with MFU against the compute dtype's peak."""

from __future__ import annotations

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import MemoryPrediction, step_memory
from autopar.compiler.analysis.summary import GraphSummary
from autopar.compiler.planner.cost_model import comm_bytes, step_time, uncompressed_bytes
from autopar.compiler.planner.pipeline_cost import (
    pipeline_time,
    rank_comm_bytes,
    rank_uncompressed_bytes,
)
from autopar.compiler.planner.result import Prediction
from autopar.costs import DEFAULT_EFFICIENCY, Efficiency
from autopar.layout import Layout


def predict(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
            optimizer: str = "adamw", eff: Efficiency = DEFAULT_EFFICIENCY,
            model_flops: float | None = None, stages=None,
            memory: MemoryPrediction | None = None, times=None,
            compute_dtype: str | None = None) -> Prediction:
    """The Prediction for one rank's `summary` under `layout`.

    model_flops: one rank's model FLOPs (forward + backward, no recomputation) of one
    micro-batch before any pass; default: the summary's own. Scaled by dp and
    micro-batches for the global batch. stages: the StageSummary of a pipelined or
    micro-batched step (planner/pipeline_cost.py), None for one whole-graph step.
    memory: the peak the caller predicted (a pipeline's ranks replayed); default:
    step_memory of the summary. times: step_times of the same arguments, if the caller
    has it already. compute_dtype: the dtype whose peak MFU is against (default: the
    summary's, GraphSummary.compute_dtype).
    """
    if times is None:
        times = step_times(summary, cluster, layout, optimizer, eff, stages)
    flops = ((summary.model_flops if model_flops is None else model_flops)
             * layout.dp * layout.microbatches)
    seconds = times.total_s
    devices = layout.world_size
    per_device = flops / devices / seconds if seconds > 0 else 0.0
    peak = cluster.peak_flops_for(compute_dtype or summary.compute_dtype())
    if memory is None:
        memory = step_memory(summary, layout, optimizer, regions_inline=cluster.device.kind == "cpu")
    return Prediction(
        step_time_s=seconds, flops_per_step=flops, tflops_per_device=per_device / 1e12,
        mfu=per_device / peak, peak_memory_bytes=memory.peak_bytes,
        bubble_fraction=times.bubble_s / seconds if seconds > 0 else 0.0,
        breakdown={"compute": times.compute_s, "comm": times.comm_s,
                   "exposed_comm": times.exposed_comm_s, "bubble": times.bubble_s,
                   "optimizer": times.optimizer_s},
        memory=memory.by_category,
        **_bytes(summary, cluster, layout, stages, times))


def _bytes(summary: GraphSummary, cluster: ClusterSpec, layout: Layout, stages, times
           ) -> dict:
    """Prediction's comm_bytes and uncompressed_bytes: the whole-graph step's, or a
    pipelined step's critical rank's (the rank its breakdown is of)."""
    if stages is None:
        return {"comm_bytes": comm_bytes(summary, layout),
                "uncompressed_bytes": uncompressed_bytes(summary, layout)}
    rank = times.critical_rank
    return {"comm_bytes": rank_comm_bytes(summary, stages, cluster, layout)[rank],
            "uncompressed_bytes": rank_uncompressed_bytes(summary, stages, layout)[rank]}


def step_times(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
               optimizer: str = "adamw", eff: Efficiency = DEFAULT_EFFICIENCY, stages=None,
               run=None):
    """The step's times without its memory: step_time of a whole-graph step,
    pipeline_cost.pipeline_time of a pipelined one (`stages` given; `run`: its
    ScheduleRun, if known)."""
    if stages is None:
        return step_time(summary, cluster, layout, optimizer, eff)
    return pipeline_time(summary, stages, cluster, layout, optimizer, eff, run)
