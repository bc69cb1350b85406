"""`autopar calibrate`: measure this machine and write a ClusterSpec YAML for it.

Measured with one thread per process (autopar runs one process per core on CPU):
fp32 matmul throughput (square `mm`), memory bandwidth (a large copy: read + write),
the fixed cost of one eager op (a chain of one-element adds), the rate at which the
OS hands out fresh pages (a new large tensor filled, against refilling one),
and gloo all-reduce times over loopback between `nprocs` processes at several sizes,
fitted to the cost model's ring formula t = 2(p-1)/p * n / bandwidth + 2(p-1) *
latency by least squares.

The cost model multiplies peaks by Efficiency (0.7 compute, 0.8 memory and link by
default); the YAML stores measured / efficiency, so that predictions with the
default Efficiency reproduce what was measured.

On a machine with CUDA GPUs (`device="cuda"`, the default there) the same figures are
measured on the GPUs instead: matmul throughput per dtype (fp32, bf16, fp16; 8192²
`mm`), device memory bandwidth (a 1 GiB copy), the cost of one kernel launch (a chain
of one-element adds, synchronised), the fused attention kernel's throughput (causal
`scaled_dot_product_attention`, forward and backward, in bf16), and with two GPUs or
more NCCL all-reduce times between `nprocs` GPUs of this node, fitted the same way.
The spec is `nprocs` GPUs of one node with NCCL, the device's own memory size, and
the measured link for both links (the network between nodes is not measured), or,
given a `base` cluster (a preset or YAML of the cluster the GPU belongs to), that
cluster with the measured device and, where measured, the node's link. One GPU
measures no link, so it needs a base.

`fit_model` (`autopar calibrate --model MODEL`) then times one single-process step of
the user's model op by op (its traced graph run node by node, median of a few runs)
and the optimizer's step on its parameters, and stores measured / modelled time per
aten op ("mm", "_log_softmax") and per optimizer kind as DeviceSpec.op_time_factors:
what the roofline misses on this machine (a CPU's exp-heavy softmax is bound by
arithmetic the FLOP count leaves out; a GEMM of one shape runs slower than the
square one measured). Ops with no work (views) and ops that took less than
`min_seconds` in all keep the plain model.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils import flop_counter

from autopar.cluster import ClusterSpec
from autopar.costs import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    causal_share,
    kernel_time,
    optimizer_time,
)

ALL_REDUCE_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)  # bytes
NCCL_SIZES = (2**16, 2**20, 2**24, 2**26, 2**28)  # bytes: NVLink needs larger ones to fit
GPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Measurements:
    matmul_flops: float  # FLOP/s, fp32, one thread
    memory_bandwidth: float  # bytes/s, one thread
    launch_overhead_s: float  # one tiny eager op
    link_bandwidth: float | None  # bytes/s per direction (alpha-beta fit); None: one GPU
    link_latency_s: float | None
    all_reduce: tuple[tuple[int, float], ...]  # (bytes, median seconds) as measured
    first_touch_bandwidth: float | None = None  # bytes/s of fresh pages from the OS
    # a GPU's: its name and memory, and matmul FLOP/s per dtype (matmul_flops: fp32's)
    gpu: str | None = None
    gpu_memory_bytes: int = 0
    gpu_flops: tuple[tuple[str, float], ...] = ()
    # the fused attention kernel's FLOP/s in attention_dtype, counted as the cost model
    # counts them (measure_gpu_attention)
    attention_flops: float | None = None
    attention_dtype: str | None = None

    def attention_efficiency(self, eff: Efficiency = DEFAULT_EFFICIENCY) -> float | None:
        """The fraction of the spec's peak (measured matmul / eff.compute) in the
        attention's dtype that the fused attention kernel reached, at most 1."""
        if self.attention_flops is None:
            return None
        return min(1.0, self.attention_flops * eff.compute
                   / dict(self.gpu_flops)[self.attention_dtype])

    def cluster(self, nprocs: int, eff: Efficiency = DEFAULT_EFFICIENCY,
                base: ClusterSpec | None = None) -> ClusterSpec:
        """The spec for `nprocs` processes (GPUs) as measured, or `base` with the measured
        device (GPUs) and, where one was measured, the node's link."""
        link = (None if self.link_bandwidth is None else
                {"bandwidth": self.link_bandwidth / eff.link, "latency_s": self.link_latency_s})
        if self.gpu is not None:
            device = {"name": f"{self.gpu} (calibrated)", "kind": "gpu",
                      "peak_flops": {dtype: flops / eff.compute for dtype, flops in self.gpu_flops},
                      "memory_bytes": self.gpu_memory_bytes,
                      "memory_bandwidth": self.memory_bandwidth / eff.memory,
                      "launch_overhead_s": self.launch_overhead_s,
                      "attention_efficiency": self.attention_efficiency(eff)}
            if base is not None:
                data = base.to_dict()
                return ClusterSpec.from_dict(
                    {**data, "name": f"{data['name']}-calibrated",
                     "device": {**data["device"], **device},
                     "intra_node": link or data["intra_node"]},
                    source=f"autopar calibrate on {data['name']}")
            if link is None:
                raise ValueError(
                    "one GPU measures no link between GPUs: name the cluster it belongs to "
                    "(--cluster with a preset such as dgx-h100, or a YAML spec, and --nodes), "
                    "whose links the spec keeps, or calibrate two GPUs or more (--nproc)")
            # NOTE: one node measured: the network is not; both links get the node's
            return ClusterSpec.from_dict({"name": "gpu-calibrated", "nodes": 1,
                                          "devices_per_node": nprocs, "backend": "nccl",
                                          "device": device, "intra_node": link,
                                          "inter_node": link}, source="autopar calibrate")
        if base is not None:
            raise ValueError("a base cluster takes a GPU's measurements (--device cuda); "
                             "a CPU calibration describes this machine")
        base = ClusterSpec.local(nprocs=nprocs).to_dict()
        device = {**base["device"], "name": "cpu (calibrated)",
                  "peak_flops": {"fp32": self.matmul_flops / eff.compute},
                  "memory_bandwidth": self.memory_bandwidth / eff.memory,
                  "launch_overhead_s": self.launch_overhead_s,
                  "first_touch_bandwidth": self.first_touch_bandwidth}
        return ClusterSpec.from_dict({**base, "name": "local-calibrated", "device": device,
                                      "intra_node": link, "inter_node": link},
                                     source="autopar calibrate")


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul(n: int = 1024, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _median_time(lambda: torch.mm(a, b), repeats)


def measure_memory_bandwidth(nbytes: int = 2**28, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), repeats)


def measure_first_touch(nbytes: int = 2**28, repeats: int = 5) -> float:
    """Bytes/s at which fresh pages are mapped: filling a new tensor (above the
    allocator's mmap threshold, so its pages come from the OS each time) minus
    refilling one whose pages are mapped."""
    mapped = torch.empty(nbytes // 4)
    refill = _median_time(lambda: mapped.fill_(1.0), repeats)
    fresh = _median_time(lambda: torch.empty(nbytes // 4).fill_(1.0), repeats)
    if fresh <= refill:
        raise RuntimeError("a fresh tensor filled no slower than a mapped one: the machine is "
                           "too busy to calibrate; try again")
    return nbytes / (fresh - refill)


def _cuda_time(fn: Callable[[], object], repeats: int) -> float:
    """_median_time of work queued on the GPU: each run waits for it to finish."""
    def run():
        fn()
        torch.cuda.synchronize()
    return _median_time(run, repeats)


def measure_gpu_matmul(dtype: str, n: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of a square `mm` in `dtype` on the current GPU (fp32 without TF32, as
    torch's default)."""
    a = torch.randn(n, n, device="cuda", dtype=GPU_DTYPES[dtype])
    b = torch.randn(n, n, device="cuda", dtype=GPU_DTYPES[dtype])
    return 2 * n**3 / _cuda_time(lambda: torch.mm(a, b), repeats)


def measure_gpu_memory_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _cuda_time(lambda: dst.copy_(src), repeats)


def measure_gpu_attention(batch: int = 4, heads: int = 16, seq: int = 2048,
                          head_dim: int = 128, repeats: int = 5) -> tuple[float, str]:
    """FLOP/s and dtype of causal `scaled_dot_product_attention`, forward and backward,
    in bf16 (fp16 where the GPU has no bf16) on the current GPU: the fused kernel torch
    picks (FlashAttention on recent GPUs). The FLOPs are those the kernel performs, as
    the cost model counts a causal attention's time (torch.utils.flop_counter's whole
    s x s times costs.causal_share), so the rate is the one `kernel_time` needs."""
    dtype = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=GPU_DTYPES[dtype], requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def forward_backward():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)
    flops = (flop_counter.sdpa_flop_count(shape, shape, shape)
             + flop_counter.sdpa_backward_flop_count(shape, shape, shape, shape)
             ) * causal_share(seq, seq)
    return flops / _cuda_time(forward_backward, repeats), dtype


def _all_reduce_worker(rank: int, nprocs: int, store_path: str, sizes, repeats, out,
                       backend: str = "gloo") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, nprocs)
    dist.init_process_group(backend, store=store, rank=rank, world_size=nprocs)
    timed = _cuda_time if backend == "nccl" else _median_time
    try:
        for nbytes in sizes:
            t = torch.ones(nbytes // 4, device="cuda" if backend == "nccl" else "cpu")
            dist.barrier()
            seconds = timed(lambda: dist.all_reduce(t), repeats)
            if rank == 0:
                out.put((nbytes, seconds))
    finally:
        dist.destroy_process_group()


def measure_launch_overhead(ops: int = 2000, repeats: int = 5, device: str = "cpu") -> float:
    """Seconds per op of a chain of tiny adds: eager dispatch, no arithmetic to speak of
    (on "cuda": per kernel, the chain waited for at the end)."""
    x = torch.ones(1, device=device)

    def chain():
        y = x
        for _ in range(ops):
            y = torch.add(y, x)
        return y
    return (_cuda_time if device == "cuda" else _median_time)(chain, repeats) / ops


def measure_all_reduce(nprocs: int = 2, sizes=ALL_REDUCE_SIZES, repeats: int = 7,
                       backend: str = "gloo") -> list[tuple[int, float]]:
    """Median seconds of an all-reduce of each size (bytes) over `nprocs` processes:
    gloo on CPU tensors, or NCCL on one GPU each."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_all_reduce_worker,
                             args=(r, nprocs, store, sizes, repeats, out, backend))
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        results = [_next_result(out, procs) for _ in sizes]
        for p in procs:
            p.join(timeout=60)
    return sorted(results)


def _next_result(out, procs, poll_s: float = 2.0):
    import queue

    while True:
        try:
            return out.get(timeout=poll_s)
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a calibration process failed (exit codes {failed})") from None


def fit_ring(samples: list[tuple[int, float]], nprocs: int) -> tuple[float, float]:
    """(bandwidth, latency) of t = 2(p-1)/p * n / bw + 2(p-1) * latency, least squares."""
    xs = [2 * (nprocs - 1) / nprocs * n for n, _ in samples]
    ys = [t for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if slope <= 0:
        raise RuntimeError(f"all-reduce time did not grow with size ({samples}): the machine is "
                           "too busy to calibrate; try again")
    return 1 / slope, max(intercept, 1e-7) / (2 * (nprocs - 1))


def default_device() -> str:
    """What `calibrate` measures unless told: the GPUs where CUDA is available."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def calibrate(nprocs: int = 2, device: str | None = None) -> Measurements:
    """This machine's figures: its CPU processes over gloo, or (`device="cuda"`, the
    default where CUDA is available) `nprocs` of its GPUs over NCCL."""
    device = device or default_device()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"calibrate's device is 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        return calibrate_gpu(nprocs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops, bandwidth = measure_matmul(), measure_memory_bandwidth()
        launch, touch = measure_launch_overhead(), measure_first_touch()
    finally:
        torch.set_num_threads(threads)
    samples = measure_all_reduce(nprocs)
    link_bw, latency = fit_ring(samples, nprocs)
    return Measurements(flops, bandwidth, launch, link_bw, latency, tuple(samples), touch)


def calibrate_gpu(nprocs: int = 2) -> Measurements:
    """The first GPU's matmul (per dtype), memory bandwidth, launch cost and attention
    kernel, and (nprocs >= 2) NCCL all-reduces over GPUs 0 .. nprocs-1."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < nprocs or count == 0:
        instead = (f"use --nproc {count}" if count >= 1 else "use --device cpu to calibrate "
                   "this machine's CPU")
        raise RuntimeError(f"calibrating {nprocs} GPUs needs {nprocs} on this machine "
                           f"(--nproc {nprocs}); it has {count}: {instead}")
    flops = {dtype: measure_gpu_matmul(dtype) for dtype in GPU_DTYPES
             if dtype != "bf16" or torch.cuda.is_bf16_supported()}
    attention, attention_dtype = measure_gpu_attention()
    samples, link_bw, latency = (), None, None
    if nprocs >= 2:
        samples = tuple(measure_all_reduce(nprocs, NCCL_SIZES, backend="nccl"))
        link_bw, latency = fit_ring(list(samples), nprocs)
    props = torch.cuda.get_device_properties(0)
    return Measurements(flops["fp32"], measure_gpu_memory_bandwidth(),
                        measure_launch_overhead(device="cuda"), link_bw, latency, samples,
                        gpu=props.name, gpu_memory_bytes=props.total_memory,
                        gpu_flops=tuple(flops.items()), attention_flops=attention,
                        attention_dtype=attention_dtype)


# -- fitting the cost model to one model's step ----------------------------------------------

class _TimedInterpreter(fx.Interpreter):
    """Runs a graph node by node, recording each call node's seconds."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.seconds: dict[fx.Node, list[float]] = {}

    def run_node(self, n: fx.Node):
        start = time.perf_counter()
        out = super().run_node(n)
        if n.op == "call_function":
            self.seconds.setdefault(n, []).append(time.perf_counter() - start)
        return out


def time_nodes(tg, args: list[torch.Tensor], repeats: int = 3) -> dict[fx.Node, float]:
    """Median seconds of each call node of `tg` run on `args` (after one warm-up run)."""
    timed = _TimedInterpreter(tg.gm)
    with torch.no_grad():
        for _ in range(repeats + 1):
            timed.run(*args)
    return {n: statistics.median(t[1:]) for n, t in timed.seconds.items()}


def _optimizers(params: list[torch.nn.Parameter]) -> dict[str, torch.optim.Optimizer]:
    """torch's optimizer of each kind the cost model knows (costs.OPTIMIZER_STATES)."""
    out = {}
    for fused in (False, True):
        suffix = "-fused" if fused else ""
        out |= {"adamw" + suffix: torch.optim.AdamW(params, lr=1e-3, fused=fused),
                "adam" + suffix: torch.optim.Adam(params, lr=1e-3, fused=fused),
                "sgd-momentum" + suffix: torch.optim.SGD(params, lr=1e-3, momentum=0.9,
                                                         fused=fused),
                "sgd" + suffix: torch.optim.SGD(params, lr=1e-3, fused=fused)}
    return out


def fit_model(model: torch.nn.Module, example_inputs: tuple, loss_fn, cluster: ClusterSpec,
              repeats: int = 3, min_seconds: float = 5e-4) -> dict[str, float]:
    """Measured / modelled seconds per aten op of one step of `model` on
    `example_inputs` (one process, one thread), and per optimizer kind ("optimizer.adamw")
    on its parameters: the DeviceSpec.op_time_factors of `cluster`'s device."""
    from autopar.compiler.analysis.summary import summarize
    from autopar.compiler.ir.trace import trace_train_step

    data = cluster.to_dict()
    cluster = ClusterSpec.from_dict({**data, "device": {**data["device"], "op_time_factors": {}}})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tg = trace_train_step(model, example_inputs, loss_fn)
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        args = [state[s.name].detach() for s in (*tg.signature.params, *tg.signature.buffers)]
        measured = time_nodes(tg, args + list(example_inputs), repeats)
        factors = _op_factors(tg, summarize(tg), measured, cluster, min_seconds)
        factors.update(_optimizer_factors(model, cluster, repeats))
    finally:
        torch.set_num_threads(threads)
    return factors


def _op_factors(tg, summary, measured: dict[fx.Node, float], cluster: ClusterSpec,
                min_seconds: float) -> dict[str, float]:
    records = summary.ops[len(summary.ops) - len(tg.call_nodes()):]  # inputs come first
    totals: dict[str, list[float]] = {}
    for node, op in zip(tg.call_nodes(), records):
        if not (op.flops or op.bytes) or op.collective:
            continue
        modelled = kernel_time(op.target, op.flops, op.bytes, op.allocates, op.dtype, cluster)
        total = totals.setdefault(op.target, [0.0, 0.0])
        total[0] += measured[node]
        total[1] += modelled
    return {target: seconds / modelled for target, (seconds, modelled) in sorted(totals.items())
            if seconds >= min_seconds and modelled > 0}


def _optimizer_factors(model: torch.nn.Module, cluster: ClusterSpec,
                       repeats: int) -> dict[str, float]:
    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p in params:
        p.grad = torch.ones_like(p)
    nbytes = sum(p.nbytes for p in params)
    out = {}
    for kind, opt in _optimizers(params).items():
        seconds = _median_time(opt.step, repeats)
        out[f"optimizer.{kind}"] = seconds / optimizer_time(nbytes, kind, cluster)
    return out
