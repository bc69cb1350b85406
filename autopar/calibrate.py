"""`autopar calibrate`: measure this machine and write a ClusterSpec YAML for it.

Measured with one thread per process (autopar runs one process per core on CPU):
fp32 matmul throughput (square `mm`), memory bandwidth (a large copy: read + write),
the fixed cost of one eager op (a chain of one-element adds),
and gloo all-reduce times over loopback between `nprocs` processes at several sizes,
fitted to the cost model's ring formula t = 2(p-1)/p * n / bandwidth + 2(p-1) *
latency by least squares.

The cost model multiplies peaks by Efficiency (0.7 compute, 0.8 memory and link by
default); the YAML stores measured / efficiency, so that predictions with the
default Efficiency reproduce what was measured.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.cluster import ClusterSpec
from autopar.compiler.planner.cost_model import DEFAULT_EFFICIENCY, Efficiency

ALL_REDUCE_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)  # bytes


@dataclass(frozen=True)
class Measurements:
    matmul_flops: float  # FLOP/s, fp32, one thread
    memory_bandwidth: float  # bytes/s, one thread
    launch_overhead_s: float  # one tiny eager op
    link_bandwidth: float  # bytes/s per direction (alpha-beta fit)
    link_latency_s: float
    all_reduce: tuple[tuple[int, float], ...]  # (bytes, median seconds) as measured

    def cluster(self, nprocs: int, eff: Efficiency = DEFAULT_EFFICIENCY) -> ClusterSpec:
        link = {"bandwidth": self.link_bandwidth / eff.link, "latency_s": self.link_latency_s}
        base = ClusterSpec.local(nprocs=nprocs).to_dict()
        device = {**base["device"], "name": "cpu (calibrated)",
                  "peak_flops": {"fp32": self.matmul_flops / eff.compute},
                  "memory_bandwidth": self.memory_bandwidth / eff.memory,
                  "launch_overhead_s": self.launch_overhead_s}
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


def _all_reduce_worker(rank: int, nprocs: int, store_path: str, sizes, repeats, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, nprocs)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=nprocs)
    try:
        for nbytes in sizes:
            t = torch.ones(nbytes // 4)
            dist.barrier()
            seconds = _median_time(lambda: dist.all_reduce(t), repeats)
            if rank == 0:
                out.put((nbytes, seconds))
    finally:
        dist.destroy_process_group()


def measure_launch_overhead(ops: int = 2000, repeats: int = 5) -> float:
    """Seconds per op of a chain of tiny adds: eager dispatch, no arithmetic to speak of."""
    x = torch.ones(1)

    def chain():
        y = x
        for _ in range(ops):
            y = torch.add(y, x)
        return y
    return _median_time(chain, repeats) / ops


def measure_all_reduce(nprocs: int = 2, sizes=ALL_REDUCE_SIZES,
                       repeats: int = 7) -> list[tuple[int, float]]:
    """Median seconds of a gloo all-reduce of each size (bytes) over `nprocs` processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_all_reduce_worker, args=(r, nprocs, store, sizes, repeats, out))
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


def calibrate(nprocs: int = 2) -> Measurements:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops, bandwidth = measure_matmul(), measure_memory_bandwidth()
        launch = measure_launch_overhead()
    finally:
        torch.set_num_threads(threads)
    samples = measure_all_reduce(nprocs)
    link_bw, latency = fit_ring(samples, nprocs)
    return Measurements(flops, bandwidth, launch, link_bw, latency, tuple(samples))
