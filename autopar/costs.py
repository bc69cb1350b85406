"""The cost formulas: seconds of one op and of one collective on a cluster's devices
and links, and of an optimizer step. Pure functions of sizes, a ClusterSpec and a Layout;
they know nothing of graphs, so passes (stage balancing, tensor-parallel placements,
recomputation) and the planner's graph cost model (compiler/planner/cost_model.py)
price with the same numbers.

- compute: a roofline per op, max(flops / (peak * e_compute), bytes / (bw * e_memory));
- collectives: alpha-beta (latency + bytes / bandwidth) on the link the mesh dimension
  maps to: NVLink-class `intra_node` when the group fits in a node, else `inter_node`
  with the hierarchical all-reduce over the group's ranks on each node.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.cluster import ClusterSpec, LinkSpec
from autopar.layout import Layout, LayoutError


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
# (torch.optim keeps them in the parameter's dtype), and a per-tensor step counter.
# A kind is torch.optim's class with its defaults; "-fused" the same with fused=True.
_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
OPTIMIZER_STATES = {**_STATES, **{f"{kind}-fused": n for kind, n in _STATES.items()}}

# parameter-sized reads + writes of one step. torch's default implementation (foreach
# on CUDA, one tensor at a time on a CPU: the same op sequence) runs one pass per op:
# AdamW's decoupled decay (p: r+w), lerp of exp_avg (m, g: 3), exp_avg_sq *= beta2 (2),
# += (1-beta2) g g (4), sqrt into a new tensor (2), / bias correction (2), + eps (2),
# p -= lr m / denom (4): 21; Adam without weight decay (its default) 19; SGD with
# momentum buf *= m (2), buf += g (3), p -= lr buf (3): 8; plain SGD p -= lr g (3).
# The fused kernels read parameter, gradient and states once and write parameter and
# states once: 3 + 2 x states. On an H100 torch's foreach AdamW took 3.1-3.15x the
# fused traffic's time (docs/benchmarks.md, "The cost model on one GPU").
OPTIMIZER_ACCESSES = {"adamw": 21, "adam": 19, "sgd-momentum": 8, "sgd": 3,
                      **{f"{kind}-fused": 3 + 2 * n for kind, n in _STATES.items()}}


def op_time(flops: float, nbytes: float, peak_flops: float, memory_bandwidth: float,
            eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Roofline: an op is bound by its arithmetic or by its memory traffic."""
    return max(flops / (peak_flops * eff.compute), nbytes / (memory_bandwidth * eff.memory))

# a CPU allocation above glibc's largest mmap threshold (32 MiB on 64-bit) is mapped
# fresh from the OS, so each of its pages faults and is zeroed on first touch
MMAP_THRESHOLD = 32 * 2**20


# the fused attention kernels a trace holds (ir/trace.py GpuKernels: the CPU's flash
# kernel stands for a GPU's), by op name: DeviceSpec.attention_efficiency prices them
ATTENTION_KERNELS = frozenset({
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
})


def causal_share(s_q: int, s_k: int) -> float:
    """The share of the s_q x s_k scores an attention kernel computes under `is_causal`
    (torch's mask, aligned top-left: query i sees keys 0..i); the fused kernels skip
    the rest, while torch.utils.flop_counter counts all s_q x s_k."""
    if s_q <= 0 or s_k <= 0:
        return 1.0
    kept = s_q * (s_q + 1) // 2 if s_q <= s_k else s_k * (s_k + 1) // 2 + (s_q - s_k) * s_k
    return kept / (s_q * s_k)


def kernel_time(target: str, flops: float, nbytes: float, allocates: int, dtype: str | None,
                cluster: ClusterSpec, eff: Efficiency = DEFAULT_EFFICIENCY,
                first_touch: bool = True) -> float:
    """One op: launch + roofline + first touch of a large fresh allocation (a CPU), times
    the device's fitted factor for the op (`autopar calibrate --model`)."""
    device = cluster.device
    if device.kind == "gpu" and not (flops or nbytes):
        # a view or other metadata op launches no kernel; its dispatch on the host runs
        # ahead of the GPU's queue (on a CPU, the dispatch is the op's cost)
        return 0.0
    seconds = device.launch_overhead_s
    if target in ATTENTION_KERNELS and device.attention_efficiency is not None:
        eff = dataclasses.replace(eff, compute=device.attention_efficiency)
    if flops or nbytes:
        peak = cluster.peak_flops_for(dtype or "fp32") if flops else 1.0
        seconds += op_time(flops, nbytes, peak, device.memory_bandwidth, eff)
    if first_touch and device.first_touch_bandwidth and allocates > MMAP_THRESHOLD:
        seconds += allocates / device.first_touch_bandwidth
    return seconds * device.op_time_factors.get(target, 1.0)


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


def pipelined_reduce(nbytes: float, p: int, link: LinkSpec, eff: float = 1.0) -> float:
    """Reduce to one rank (or broadcast from one), chunked down a chain or tree: the whole
    message crosses each link once, the latency grows with the depth log2(p)."""
    if p <= 1:
        return 0.0
    return nbytes / (link.bandwidth * eff) + math.ceil(math.log2(p)) * link.latency_s


def hierarchical_all_gather(nbytes: float, per_node: int, nodes: int, intra: LinkSpec,
                            inter: LinkSpec, eff: float = 1.0) -> float:
    """All-gather (or reduce-scatter) of an n-byte full tensor over `nodes` nodes holding
    `per_node` ranks each, as NCCL runs it over one ring per network port (rail): the
    ranks with the same place in their node gather their shards over the network
    (n / per_node bytes among `nodes` ranks, per_node rings at once), then each node's
    ranks gather among themselves over the node's links."""
    return (ring_all_gather(nbytes / per_node, nodes, inter, eff)
            + ring_all_gather(nbytes, per_node, intra, eff))


def ps_exchange_time(pull_bytes: float, push_bytes: float, trainers: int, servers: int,
                     link: LinkSpec, eff: float = 1.0) -> float:
    """One step's pull and push of a parameter-server trainer, every trainer at once:
    each trainer's bytes go out through its own port, split over the servers; each
    server's port takes 1/servers of every trainer's bytes. The slower port decides,
    plus one round trip per direction (the servers are asked in parallel)."""
    if trainers < 1 or servers < 1:
        raise ValueError(f"trainers and servers must be >= 1, got {trainers}, {servers}")
    total = pull_bytes + push_bytes
    port = max(total, trainers * total / servers)
    return port / (link.bandwidth * eff) + 2 * link.latency_s


def collective_time(kind: str, nbytes: float, group_size: int, cluster: ClusterSpec,
                    stride: int = 1, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds for one collective over `group_size` ranks `stride` apart (the product of
    the inner mesh dimensions); nbytes is the full tensor (the reduced one, or the
    gathered output). Ranks are numbered node-major, so a node holds
    min(group_size, devices_per_node // stride) of the group, at least one: a
    data-parallel group outside tp = 8 on 8-GPU nodes has one rank per node, and its
    all-reduce crosses the network whole (each device has its own network port)."""
    if kind not in ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast"):
        raise ValueError(f"unknown collective {kind!r}; expected all_reduce, all_gather, "
                         "reduce_scatter, reduce or broadcast")
    if group_size <= 1:
        return 0.0
    if cluster.backend == "gloo" and kind in ("reduce_scatter", "all_gather"):
        # gloo reduce-scatters a tensor by all-reducing it and keeping a block, and its
        # all-gather is not the ring's half of an all-reduce either: measured with 2
        # processes on a CPU, 1-16 MB, a reduce-scatter took 1.25-1.6x and an all-gather
        # 0.77-0.96x an all-reduce of the full tensor (docs/performance.md)
        kind = "all_reduce"
    spans_nodes = group_spans_nodes(group_size, stride, cluster)
    if kind in ("reduce", "broadcast"):
        link = cluster.inter_node if spans_nodes else cluster.intra_node
        return pipelined_reduce(nbytes, group_size, link, eff.link)
    if not spans_nodes:
        if kind != "all_reduce":
            return ring_all_gather(nbytes, group_size, cluster.intra_node, eff.link)
        return flat_all_reduce(nbytes, group_size, cluster.intra_node, eff.link)
    if cluster.backend == "gloo":
        # gloo's ring is not topology-aware: every one of its steps waits on the network
        if kind != "all_reduce":
            return ring_all_gather(nbytes, group_size, cluster.inter_node, eff.link)
        return ring_all_reduce(nbytes, group_size, cluster.inter_node, eff.link)
    # a node's ranks of the group each use their own network port: with one rank a node
    # the whole tensor crosses one port per node; with several, each port carries its share
    per_node = max(1, min(group_size, cluster.devices_per_node // stride))
    nodes = math.ceil(group_size / per_node)
    if kind != "all_reduce":
        return hierarchical_all_gather(nbytes, per_node, nodes, cluster.intra_node,
                                       cluster.inter_node, eff.link)
    return hierarchical_all_reduce(nbytes, per_node, nodes, cluster.intra_node,
                                   cluster.inter_node, eff.link)


def dp_sum_time(nbytes: float, cluster: ClusterSpec, layout: Layout,
                eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """The runtime's sum of `nbytes` over dp outside a graph (runtime/mesh.py
    `Mesh.sum_over_dp`: a pipeline's gradients, Local SGD's average): one all-reduce, or
    Layout.allreduce="hierarchical"'s three levels (`dp_sum_collectives`)."""
    return sum(collective_time(kind, size, group, cluster, stride, eff)
               for _, kind, size, group, stride in dp_sum_collectives(nbytes, cluster, layout))


def dp_sum_bytes(nbytes: float, cluster: ClusterSpec, layout: Layout) -> dict[str, float]:
    """The bytes of dp_sum_time's collectives by the group each runs over, each
    collective's full tensor as collective_time takes it: "dp" for one all-reduce; for
    the hierarchical form "dp.local" (the reduce and broadcast on gloo, the reduce-scatter
    and all-gather on NCCL, inside each node) and "dp.node" (the all-reduce among the
    node leaders: the whole on gloo, one shard on NCCL); a level of one rank moves
    nothing. Empty when dp is 1."""
    out: dict[str, float] = {}
    if layout.dp == 1 or not nbytes:
        return out
    for level, _, size, group, _ in dp_sum_collectives(nbytes, cluster, layout):
        if group > 1:
            out[level] = out.get(level, 0.0) + size
    return out


def dp_sum_collectives(nbytes: float, cluster: ClusterSpec, layout: Layout
                       ) -> list[tuple[str, str, float, int, int]]:
    """(level, collective, full-tensor bytes, group size, stride) of the runtime's sum of
    `nbytes` over dp, in order: one all-reduce over "dp", or for
    Layout.allreduce="hierarchical" the cluster's three levels: a reduce inside each
    node ("dp.local"), an all-reduce among the node leaders ("dp.node") and a broadcast
    inside each node on gloo; a reduce-scatter, an all-reduce of the shards and an
    all-gather on NCCL."""
    if layout.allreduce != "hierarchical":
        return [("dp", "all_reduce", nbytes, layout.dp, layout.tp)]
    local, nodes = dp_node_split(layout, cluster)
    among = layout.tp * local  # one rank of each node's run
    if cluster.backend == "nccl":
        return [("dp.local", "reduce_scatter", nbytes, local, layout.tp),
                ("dp.node", "all_reduce", nbytes / local, nodes, among),
                ("dp.local", "all_gather", nbytes, local, layout.tp)]
    return [("dp.local", "reduce", nbytes, local, layout.tp),
            ("dp.node", "all_reduce", nbytes, nodes, among),
            ("dp.local", "broadcast", nbytes, local, layout.tp)]


def group_spans_nodes(group_size: int, stride: int, cluster: ClusterSpec) -> bool:
    """Whether a mesh dimension's group crosses a node boundary. Its ranks are `stride`
    apart (the product of the inner mesh dimensions: 1 for dp while tp = pp = 1)."""
    return group_size * stride > cluster.devices_per_node


def mesh_dim_sizes(layout: Layout, cluster: ClusterSpec | None = None
                   ) -> dict[str, tuple[int, int]]:
    """mesh dimension -> (group size, stride), mesh order (pp, dp, tp) with tp innermost;
    with `cluster`, a hierarchical all-reduce's two levels of dp too: "dp.local" (a dp
    group's ranks on one node) and "dp.node" (one rank of each node)."""
    dims = {"tp": (layout.tp, 1), "dp": (layout.dp, layout.tp),
            "pp": (layout.pp, layout.tp * layout.dp)}
    if cluster is not None and layout.allreduce == "hierarchical":
        local, nodes = dp_node_split(layout, cluster)
        dims["dp.local"], dims["dp.node"] = (local, layout.tp), (nodes, layout.tp * local)
    return dims


def dp_node_split(layout: Layout, cluster: ClusterSpec) -> tuple[int, int]:
    """(ranks of each data-parallel group on one node, nodes it spans): the two levels of
    `Layout.allreduce="hierarchical"`. Ranks are numbered node-major over the mesh (pp,
    dp, tp), tp innermost, so a node holds devices_per_node / tp consecutive ranks of a
    dp group. LayoutError when that does not cut the group into whole nodes, or leaves
    one level empty."""
    per_node, where = cluster.devices_per_node, (
        f"Layout.allreduce='hierarchical' on cluster {cluster.name!r} ({cluster.nodes} "
        f"node(s) x {cluster.devices_per_node} devices)")
    if layout.world_size % per_node:
        raise LayoutError(f"{where}: the {per_node} devices per node do not divide the world "
                          f"size {layout.world_size} (dp*tp*pp), so the nodes are not whole; "
                          f"use a world size that is a multiple of {per_node}, or "
                          f"allreduce='flat'")
    if per_node % layout.tp:
        raise LayoutError(f"{where}: tp={layout.tp} does not divide the {per_node} devices "
                          f"per node, so a node's ranks are not whole tensor-parallel groups; "
                          f"use allreduce='flat' or a tp dividing {per_node}")
    span = layout.dp * layout.tp  # the consecutive ranks of one pipeline stage's dp groups
    if span > per_node and span % per_node:
        raise LayoutError(f"{where}: a pipeline stage's dp x tp = {span} ranks do not fill "
                          f"whole nodes of {per_node}; use allreduce='flat' or a dp*tp that "
                          f"is a multiple of {per_node}")
    local = per_node // layout.tp
    nodes = layout.dp // local
    if nodes <= 1 or local == 1:
        where_not = "within one node" if nodes <= 1 else "at one rank per node"
        raise LayoutError(f"{where}: each data-parallel group of dp={layout.dp} lies "
                          f"{where_not}, so there is no second level to sum over; use "
                          f"allreduce='flat'")
    return local, nodes


def optimizer_traffic(param_bytes: int, optimizer: str) -> int:
    """Bytes an elementwise optimizer step streams for `param_bytes` of parameters."""
    return param_bytes * OPTIMIZER_ACCESSES[check_optimizer(optimizer)]


def optimizer_time(param_bytes: int, optimizer: str, cluster: ClusterSpec,
                   eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """The optimizer step over `param_bytes` of parameters: its traffic at the memory
    roofline, times the device's fitted factor "optimizer.<kind>"."""
    seconds = optimizer_traffic(param_bytes, optimizer) / (cluster.device.memory_bandwidth
                                                           * eff.memory)
    return seconds * cluster.device.op_time_factors.get(f"optimizer.{optimizer}", 1.0)


def check_optimizer(optimizer: str) -> str:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer kind {optimizer!r}; expected one of "
                         f"{', '.join(OPTIMIZER_STATES)}")
    return optimizer


# -- Deep Gradient Compression (Layout.dgc; runtime/dgc.py) ------------------------------

DGC_DENSE_BELOW = 1024  # a gradient with fewer elements (or not fp32) is summed dense: the
#                         paper leaves biases, norms and other small layers uncompressed
# bytes of memory traffic per compressed element and step, at the device's bandwidth:
# momentum correction, |v|, masking and applying the summed update (about 12 fp32
# accesses), and the selection, measured on this project's 2-core CPU at 65k-4M
# elements and sparsity 0.99-0.999 at its nominal 10 GB/s (torch.topk 19-172
# bytes-equivalent per element, growing with the size; the sampled threshold 19-38:
# docs/communication.md)
DGC_ELEMENTWISE_BYTES = 48
DGC_TOPK_BYTES = {"exact": 100, "sampled": 30}


def dgc_compressed(numel: int, itemsize: int) -> bool:
    """Whether DGC compresses a gradient of `numel` elements of `itemsize` bytes (fp32,
    and not small), else it is summed dense."""
    return itemsize == 4 and numel >= DGC_DENSE_BELOW


def dgc_kept(numel: int, sparsity: float) -> int:
    """How many of `numel` values a rank sends at `sparsity`: floor(numel * (1 - s)), at
    least 1 (so 8 bytes of values and indices per k carry at most (1 - s) / 2 of the fp32
    gradient's bytes: 500 times fewer at 0.999). A thousandth of an element absorbs
    rounding: a sparsity below 1/numel sends all of it."""
    return max(1, min(numel, math.floor(numel * (1 - sparsity) + 1e-3)))


def dgc_select_time(numel: int, method: str, cluster: ClusterSpec,
                    eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """One compressed tensor's DGC work per step (correction, top-k, masking, update),
    times the device's fitted factor "dgc.<method>"."""
    nbytes = numel * (DGC_ELEMENTWISE_BYTES + DGC_TOPK_BYTES[method])
    seconds = nbytes / (cluster.device.memory_bandwidth * eff.memory)
    return seconds * cluster.device.op_time_factors.get(f"dgc.{method}", 1.0)
