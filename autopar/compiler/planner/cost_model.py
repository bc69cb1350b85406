"""The cost model: predicted step time and memory of one training step.

Pure functions of (GraphSummary, ClusterSpec, Layout): no process groups, no clocks
(STYLE habit 7). It costs the graph the passes produced: data parallelism with
bucketed, overlapped gradient all-reduce, and tensor parallelism's collectives where
the rewrite put them; pipelined and micro-batched steps add the simulated schedule
(pipeline_cost.py).

- compute: a roofline per op, max(flops / (peak * e_compute), bytes / (bw * e_memory));
- collectives: alpha-beta (latency + bytes / bandwidth) on the link the mesh dimension
  maps to: NVLink-class `intra_node` when the group fits in a node, else `inter_node`
  with the hierarchical all-reduce over the group's ranks on each node;
- overlap: the graph is replayed in order on a compute stream and one communication
  stream; a collective starts when the op before it has run and its stream is free,
  and a `wait_tensor` stalls compute until its collective is done;
- memory: the memory model (memory.py), liveness over the graph's order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cluster import ClusterSpec, LinkSpec
from autopar.compiler.planner.memory import (MemoryPrediction, held_parameter_bytes,
                                             outside_graph_blocks, step_memory)
from autopar.compiler.planner.summary import GraphSummary, OpRecord
from autopar.layout import Layout, Prediction


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks that real kernels reach. The defaults are
    assumptions until `autopar calibrate` fits them to measurements: large GEMMs in
    cuBLAS typically reach 60-80% of dense peak, streaming kernels 80-90% of HBM
    bandwidth, NCCL's bus bandwidth 70-90% of the link's."""

    compute: float = 0.7
    memory: float = 0.8
    link: float = 0.8

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "link"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {value!r}")


DEFAULT_EFFICIENCY = Efficiency()

# optimizer kind -> state tensors per parameter, each the size of the parameter
# (torch.optim keeps them in the parameter's dtype), and a per-tensor step counter
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}


# -- compute -------------------------------------------------------------------------------

def op_time(flops: float, nbytes: float, peak_flops: float, memory_bandwidth: float,
            eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Roofline: an op is bound by its arithmetic or by its memory traffic."""
    return max(flops / (peak_flops * eff.compute), nbytes / (memory_bandwidth * eff.memory))


# a CPU allocation above glibc's largest mmap threshold (32 MiB on 64-bit) is mapped
# fresh from the OS, so each of its pages faults and is zeroed on first touch
MMAP_THRESHOLD = 32 * 2**20


def kernel_time(target: str, flops: float, nbytes: float, allocates: int, dtype: str | None,
                cluster: ClusterSpec, eff: Efficiency = DEFAULT_EFFICIENCY,
                first_touch: bool = True) -> float:
    """One op: launch + roofline + first touch of a large fresh allocation (a CPU), times
    the device's fitted factor for the op (`autopar calibrate --model`)."""
    device = cluster.device
    seconds = device.launch_overhead_s
    if flops or nbytes:
        peak = cluster.peak_flops_for(dtype or "fp32") if flops else 1.0
        seconds += op_time(flops, nbytes, peak, device.memory_bandwidth, eff)
    if first_touch and device.first_touch_bandwidth and allocates > MMAP_THRESHOLD:
        seconds += allocates / device.first_touch_bandwidth
    return seconds * device.op_time_factors.get(target, 1.0)


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


# -- collectives ---------------------------------------------------------------------------

def ring_all_reduce(nbytes: float, p: int, link: LinkSpec, eff: float = 1.0) -> float:
    """Reduce-scatter then all-gather around a ring: 2(p-1) steps of n/p bytes."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) / p * nbytes / (link.bandwidth * eff) + 2 * (p - 1) * link.latency_s


def tree_all_reduce(nbytes: float, p: int, link: LinkSpec, eff: float = 1.0) -> float:
    """Pipelined binary tree: reduce up, broadcast down; each rank sends and receives
    the whole message once per direction, latency grows with the depth log2(p)."""
    if p <= 1:
        return 0.0
    return 2 * nbytes / (link.bandwidth * eff) + 2 * math.ceil(math.log2(p)) * link.latency_s


def ring_all_gather(nbytes: float, p: int, link: LinkSpec, eff: float = 1.0) -> float:
    """All-gather (or reduce-scatter) of an n-byte full tensor: p-1 steps of n/p bytes."""
    if p <= 1:
        return 0.0
    return (p - 1) / p * nbytes / (link.bandwidth * eff) + (p - 1) * link.latency_s


def flat_all_reduce(nbytes: float, p: int, link: LinkSpec, eff: float = 1.0) -> float:
    """NCCL chooses ring or tree per message size; the model takes the faster."""
    return min(ring_all_reduce(nbytes, p, link, eff), tree_all_reduce(nbytes, p, link, eff))


def hierarchical_all_reduce(nbytes: float, per_node: int, nodes: int, intra: LinkSpec,
                            inter: LinkSpec, eff: float = 1.0) -> float:
    """Intra-node reduce-scatter, inter-node all-reduce of each rank's n/per_node shard
    (per_node such all-reduces run at once, one per device's network port), intra-node
    all-gather."""
    return (2 * ring_all_gather(nbytes, per_node, intra, eff)
            + flat_all_reduce(nbytes / per_node, nodes, inter, eff))


def collective_time(kind: str, nbytes: float, group_size: int, cluster: ClusterSpec,
                    stride: int = 1, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds for one collective over `group_size` ranks `stride` apart (the product of
    the inner mesh dimensions); nbytes is the full tensor (the reduced one, or the
    gathered output). Ranks are numbered node-major, so a node holds
    min(group_size, devices_per_node // stride) of the group, at least one: a
    data-parallel group outside tp = 8 on 8-GPU nodes has one rank per node, and its
    all-reduce crosses the network whole (each device has its own network port)."""
    if kind not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"unknown collective {kind!r}; expected all_reduce, all_gather "
                         "or reduce_scatter")
    if group_size <= 1:
        return 0.0
    spans_nodes = group_spans_nodes(group_size, stride, cluster)
    link = cluster.inter_node if spans_nodes else cluster.intra_node
    if kind != "all_reduce":
        # a ring across nodes runs at the pace of its slowest (network) hop
        return ring_all_gather(nbytes, group_size, link, eff.link)
    if not spans_nodes:
        return flat_all_reduce(nbytes, group_size, link, eff.link)
    per_node = max(1, min(group_size, cluster.devices_per_node // stride))
    return hierarchical_all_reduce(nbytes, per_node, math.ceil(group_size / per_node),
                                   cluster.intra_node, cluster.inter_node, eff.link)


def group_spans_nodes(group_size: int, stride: int, cluster: ClusterSpec) -> bool:
    """Whether a mesh dimension's group crosses a node boundary. Its ranks are `stride`
    apart (the product of the inner mesh dimensions: 1 for dp while tp = pp = 1)."""
    return group_size * stride > cluster.devices_per_node


def mesh_dim_sizes(layout: Layout) -> dict[str, tuple[int, int]]:
    """mesh dimension -> (group size, stride), mesh order (pp, dp, tp) with tp innermost."""
    return {"tp": (layout.tp, 1), "dp": (layout.dp, layout.tp), "pp": (layout.pp, layout.tp * layout.dp)}


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
    dims = mesh_dim_sizes(layout)
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


def optimizer_traffic(param_bytes: int, optimizer: str) -> int:
    """Bytes an elementwise optimizer step streams for `param_bytes` of parameters."""
    return param_bytes * (3 + 2 * OPTIMIZER_STATES[_check_optimizer(optimizer)])


def optimizer_time(param_bytes: int, optimizer: str, cluster: ClusterSpec,
                   eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """The optimizer step over `param_bytes` of parameters: its traffic at the memory
    roofline, times the device's fitted factor "optimizer.<kind>"."""
    seconds = optimizer_traffic(param_bytes, optimizer) / (cluster.device.memory_bandwidth
                                                           * eff.memory)
    return seconds * cluster.device.op_time_factors.get(f"optimizer.{optimizer}", 1.0)


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
    gather = zero_gather_time(summary, cluster, layout, eff)
    return StepTime(compute_s=compute, comm_s=comm + gather, exposed_comm_s=end - compute + gather,
                    optimizer_s=optimizer_time(updated, optimizer, cluster, eff))


# -- memory ---------------------------------------------------------------------------------

def _check_optimizer(optimizer: str) -> str:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer kind {optimizer!r}; expected one of "
                         f"{', '.join(OPTIMIZER_STATES)}")
    return optimizer


# -- prediction -----------------------------------------------------------------------------

def predict(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
            optimizer: str = "adamw", eff: Efficiency = DEFAULT_EFFICIENCY,
            model_flops: float | None = None, stages=None,
            memory: MemoryPrediction | None = None, times=None,
            compute_dtype: str | None = None) -> Prediction:
    """The Prediction of DESIGN.md for one rank's `summary` under `layout`.

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
        memory = step_memory(summary, layout, optimizer, fallbacks=cluster.device.kind == "cpu")
    return Prediction(
        step_time_s=seconds, flops_per_step=flops, tflops_per_device=per_device / 1e12,
        mfu=per_device / peak, peak_memory_bytes=memory.peak_bytes,
        bubble_fraction=times.bubble_s / seconds if seconds > 0 else 0.0,
        breakdown={"compute": times.compute_s, "comm": times.comm_s,
                   "exposed_comm": times.exposed_comm_s, "bubble": times.bubble_s,
                   "optimizer": times.optimizer_s},
        memory=memory.by_category)


def step_times(summary: GraphSummary, cluster: ClusterSpec, layout: Layout,
               optimizer: str = "adamw", eff: Efficiency = DEFAULT_EFFICIENCY, stages=None,
               run=None):
    """The step's times without its memory: step_time of a whole-graph step,
    pipeline_cost.pipeline_time of a pipelined one (`stages` given; `run`: its
    ScheduleRun, if known)."""
    if stages is None:
        return step_time(summary, cluster, layout, optimizer, eff)
    # NOTE: imported here: the pipeline model builds on this module's functions
    from autopar.compiler.planner.pipeline_cost import pipeline_time
    return pipeline_time(summary, stages, cluster, layout, optimizer, eff, run)
