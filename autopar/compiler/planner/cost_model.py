"""The graph cost model: the step time of one rank's graph under a layout.

Pure functions of (GraphSummary, ClusterSpec, Layout): no process groups and no clocks,
so a prediction depends only on its arguments and can be tested without a cluster.
Each op and collective is priced by the formulas of autopar/costs.py; here they are
replayed in graph order:

- overlap: the graph is replayed in order on a compute stream and one communication
  stream; a collective starts when the op before it has run and its stream is free,
  and a `wait_tensor` stalls compute until its collective is done;
- the optimizer step and, under ZeRO-1/2, the gather of the updated blocks follow.

Pipelined and micro-batched steps add the simulated schedule (pipeline_cost.py);
predict.py joins time and memory into a Prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import held_parameter_bytes, outside_graph_blocks
from autopar.compiler.analysis.summary import GraphSummary, OpRecord, summarize
from autopar.costs import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    collective_time,
    dgc_compressed,
    dgc_kept,
    dgc_select_time,
    dp_sum_time,
    kernel_time,
    mesh_dim_sizes,
    optimizer_time,
)
from autopar.layout import Layout


def _op_time(op: OpRecord, cluster: ClusterSpec, eff: Efficiency,
             first_touch: bool = True) -> float:
    if op.role == "input":
        return 0.0
    if op.members and cluster.device.kind == "cpu":  # the fallback runs the region's ops
        return op.repeat * sum(kernel_time(target, flops, nbytes, fresh, op.dtype, cluster, eff,
                                           first_touch)
                               for target, flops, nbytes, fresh in op.members)
    return op.repeat * kernel_time(op.target, op.flops, op.bytes, op.allocates, op.dtype,
                                   cluster, eff, first_touch)


MODEL_ROLES = ("forward", "loss", "backward")


def model_compute_floor(summary: GraphSummary, cluster: ClusterSpec,
                        eff: Efficiency = DEFAULT_EFFICIENCY) -> tuple[float, float]:
    """(seconds of the model's own ops, of those inside the repeated blocks) on the
    compute stream: forward, loss, backward (not the packing around collectives, not
    the optimizer), without the first touch of fresh allocations. Each term is a
    launch plus a roofline whose bytes grow at most as the batch does, so per sample
    it can only shrink as the batch grows: the same ops on a smaller batch, k times
    over, take at least as long (plan.compute_bound)."""
    total = blocks = 0.0
    for op in summary.ops:
        if op.role in MODEL_ROLES and not op.collective and op.waits_on is None:
            seconds = _op_time(op, cluster, eff, first_touch=False)
            total += seconds
            blocks += seconds if op.layer is not None else 0.0
    return total, blocks



# -- step time ------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepTime:
    compute_s: float  # every non-collective op, the packing around collectives included
    comm_s: float  # every collective, as if nothing overlapped it
    exposed_comm_s: float  # the part of comm_s that stalls the compute stream
    optimizer_s: float
    bubble_s: float = 0.0  # a whole-graph step has no pipeline bubble

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.optimizer_s


def collective_seconds(op: OpRecord, cluster: ClusterSpec, layout: Layout,
                       eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    dims = mesh_dim_sizes(layout, cluster)
    if op.group not in dims:
        raise ValueError(f"collective {op.name} names mesh dimension {op.group!r}; the cost "
                         f"model knows {sorted(dims)}")
    size, stride = dims[op.group]
    return op.repeat * collective_time(op.collective, op.comm_bytes, size, cluster, stride, eff)


def simulate_streams(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
                     eff: Efficiency = DEFAULT_EFFICIENCY) -> tuple[float, float, float]:
    """Replay the ops in graph order: (compute seconds, collective seconds, end time).

    Compute ops run back to back on one stream. Collectives queue on one communication
    stream (NCCL runs a group's collectives in issue order) and start once issued;
    a wait moves the compute stream to its collective's end. The graph returns after
    its last op, so any collective still in flight is waited for at the end.
    """
    now = comm_free = compute = comm = 0.0
    finish: dict[int, float] = {}
    for i, op in enumerate(summary.ops):
        if op.collective:
            seconds = collective_seconds(op, cluster, layout, eff)
            comm_free = max(now, comm_free) + seconds
            finish[i] = comm_free
            comm += seconds
        elif op.waits_on is not None:
            now = max(now, finish.get(op.waits_on, now))
        else:
            seconds = _op_time(op, cluster, eff)
            now += seconds
            compute += seconds
    return compute, comm, max([now, *finish.values()])


def zero_gather_time(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
                     eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """ZeRO: after the optimizer step, the all-gather over dp of each parameter a rank
    updates a block of outside the graph (runtime/executor.py `_gather_zero_blocks`: one
    collective per parameter; `param_copies` of them for a scaled summary's), overlapped
    with nothing."""
    size, stride = mesh_dim_sizes(layout)["dp"]
    blocks = outside_graph_blocks(summary, layout)
    copies = summary.param_copies or (1,) * len(blocks)
    return sum(k * collective_time("all_gather", block / k * size, size, cluster, stride, eff)
               for block, k in zip(blocks, copies) if block)


def step_time(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
              optimizer: str = "adamw", eff: Efficiency = DEFAULT_EFFICIENCY) -> StepTime:
    """One whole-graph step: the graph's streams (simulate_streams), then the optimizer
    and, under ZeRO-1/2, the gather of the updated blocks (zero_gather_time)."""
    compute, comm, end = simulate_streams(summary, cluster, layout, eff)
    updated = sum(held_parameter_bytes(summary, layout)[1])  # ZeRO: this rank's blocks
    gather = zero_gather_time(summary, cluster, layout, eff) + dgc_exchange_time(
        summary, cluster, layout, eff)
    if layout.dgc is not None:  # SGD steps the dense tensors; DGC updates the others
        update = optimizer_time(dgc_split(summary)[0], optimizer, cluster, eff) + sum(
            dgc_select_time(n, layout.dgc_topk, cluster, eff) * k
            for n, k in dgc_split(summary)[1])
    else:
        update = optimizer_time(updated, optimizer, cluster, eff)
    gather += overlapped_average(averaging_time(summary, cluster, layout, eff),
                                 end + gather + update, layout)
    return StepTime(compute_s=compute, comm_s=comm + gather, exposed_comm_s=end - compute + gather,
                    optimizer_s=update)


# Prediction.comm_bytes' key for Local SGD's parameter average, amortised per step
AVERAGE_KEY = "dp parameter average (per step)"


def comm_bytes(summary: GraphSummary, layout: Layout) -> dict[str, int]:
    """Bytes one rank's collectives carry per step of a whole-graph step, by the group
    they run over ("tp", "dp", the hierarchical "dp.local" and "dp.node"): each
    collective's full tensor, as collective_time prices it; Local SGD's parameter
    average amortised over its period (AVERAGE_KEY)."""
    out: dict[str, int] = {}
    for op in summary.ops:
        if op.collective:
            out[op.group] = out.get(op.group, 0) + op.comm_bytes * op.repeat
    if layout.local_sgd is not None:
        out[AVERAGE_KEY] = held_parameter_bytes(summary, layout)[0] // layout.local_sgd
    if layout.dgc is not None:
        dense, sparse = dgc_bytes(summary, layout)
        out["dp"] = out.get("dp", 0) + dense
        out[DGC_KEY] = sparse
    return out


def uncompressed_bytes(summary: GraphSummary, layout: Layout) -> int:
    """What a DGC or Local SGD step's gradient exchange would carry summed whole every
    step (an all-reduce of every gradient over dp, as comm_bytes counts one); 0 for
    other layouts."""
    if layout.dgc is None and layout.local_sgd is None:
        return 0
    return summary.param_bytes


# Prediction.comm_bytes' key for DGC's all-gather of values and indices (its dense sum of
# the small gradients is under "dp")
DGC_KEY = "dp sparse gradients (DGC)"


def dgc_split(summary: GraphSummary) -> tuple[int, list[tuple[int, int]]]:
    """DGC's two kinds of gradient (runtime/dgc.py): bytes of those summed dense, and
    (elements, copies) of each parameter it compresses (a scaled summary's block
    parameter stands for `copies` tensors of `elements` each)."""
    dense, compressed = 0, []
    copies = summary.param_copies or (1,) * len(summary.param_numel)
    for numel, size, k in zip(summary.param_numel, summary.param_itemsize, copies):
        if dgc_compressed(numel // k, size):
            compressed.append((numel // k, k))
        else:
            dense += numel * size
    return dense, compressed


def dgc_bytes(summary: GraphSummary, layout: Layout) -> tuple[int, int]:
    """Per steady-state step (sparsity Layout.dgc): the bytes of DGC's dense all-reduce
    (the small gradients and the loss) and of its all-gather (every rank's k fp32 values
    and k int32 indices per compressed tensor: the gathered whole, as collective_time
    prices an all-gather)."""
    dense, compressed = dgc_split(summary)
    sent = sum(2 * 4 * dgc_kept(n, layout.dgc) * k for n, k in compressed)
    return dense + 4, sent * layout.dp


def dgc_exchange_time(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
                      eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """DGC (Layout.dgc): its steady state's exchange after the backward, exposed (nothing
    runs beside it): the dense all-reduce and the sparse all-gather over dp. The dense
    warm-up and the ramp-up's lower sparsities are not in it. 0 without DGC."""
    if layout.dgc is None:
        return 0.0
    size, stride = mesh_dim_sizes(layout)["dp"]
    dense, sparse = dgc_bytes(summary, layout)
    return (collective_time("all_reduce", dense, size, cluster, stride, eff)
            + collective_time("all_gather", sparse, size, cluster, stride, eff))


def averaging_time(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
                   eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Local SGD (Layout.local_sgd = H): the all-reduce of a rank's parameters over dp
    that follows every H-th step (runtime/local_sgd.py), amortised over the H steps and
    exposed (nothing runs beside it; overlapped_average: what an overlapped one
    exposes); with Layout.allreduce="hierarchical" in the
    gradients' three levels (costs.dp_sum_time). The steady state's: the warm-up's
    synchronous steps, and an adaptive period's changes, are not in it. 0 without Local
    SGD."""
    if layout.local_sgd is None:
        return 0.0
    held = held_parameter_bytes(summary, layout)[0]
    return dp_sum_time(held, cluster, layout, eff) / layout.local_sgd


def overlapped_average(average_s: float, local_step_s: float, layout: Layout) -> float:
    """What of Local SGD's average (`average_s`: averaging_time's, amortised over the
    period H) a step exposes when it runs under the next k = Layout.local_sgd_overlap
    local steps of `local_step_s` each (runtime/local_sgd.py): max(0, T - k' s) / H for
    the whole average T = H * average_s, where k' = min(k, H) (an average due sooner
    applies the one in flight first). Nonnegative, and the step plus it never falls as
    the local step grows (k' <= H), so a floor of the local step gives a floor of both."""
    if layout.local_sgd is None or not layout.local_sgd_overlap:
        return average_s
    period = layout.local_sgd
    hidden = min(layout.local_sgd_overlap, period) * local_step_s
    return max(0.0, average_s * period - hidden) / period


def layer_costs(tg, cluster: ClusterSpec, eff: Efficiency = DEFAULT_EFFICIENCY
                ) -> list[dict[str, Any]]:
    """FLOPs and seconds (forward + backward) of each repeated block and of the rest
    (embeddings, head, loss), on one rank's micro-batch: each op's kernel time as the
    step's compute is costed (in its dtype: an fp16 matmul at the fp16 rate), without
    collectives."""
    rows: dict[str, dict[str, Any]] = {}
    for op in summarize(tg).ops:
        if op.role not in MODEL_ROLES or op.collective:
            continue
        name = f"block {op.layer}" if op.layer is not None else "outside the blocks"
        row = rows.setdefault(name, {"name": name, "flops": 0, "seconds": 0.0})
        row["flops"] += op.flops
        row["seconds"] += _op_time(op, cluster, eff)
    return list(rows.values())
