"""Gradient communication per step with and without Layout(grad_comm_dtype="bf16").

GPT-2 (transformers; 4 layers, hidden 256, vocab 50257), global batch 16 x 128,
dp=2, AMP bf16, SGD, gloo, one thread per process. The bytes are *measured*: a
TorchDispatchMode counts the tensors handed to `_c10d_functional.all_reduce` and
`all_gather_into_tensor` during one step (the pass's `allreduce_bytes` statistic is
printed next to it). Expected: the gradient all-reduce bytes halve. Step times are
medians over alternating rounds (noise hits both alike).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/amp_grad_comm.py --rounds 3 --steps 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.examples import gpt2, llama

c10d = torch.ops._c10d_functional
COUNTED = {c10d.all_reduce.default: "all_reduce", c10d.all_gather_into_tensor.default: "all_gather"}


class CommBytes(TorchDispatchMode):
    """Bytes of the tensors passed to collectives, by collective and dtype."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in COUNTED:
            t = args[0]
            self.bytes[(COUNTED[func], str(t.dtype).removeprefix("torch."))] += t.numel() * t.element_size()
        return func(*args, **(kwargs or {}))


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    factory = {"gpt2": gpt2, "llama": llama}[args.model]
    example = factory(layers=4, hidden=256, heads=8, vocab=50257, batch=16, seq=128)
    steps, times = {}, {}
    for wire in (None, "bf16"):
        layout = autopar.Layout(dp=2, amp="bf16", grad_comm_dtype=wire)
        steps[wire] = autopar.compile(copy.deepcopy(example.model), autopar.ClusterSpec.local(2),
                                      example.batch, example.loss_fn, optimizer=sgd, layout=layout)
        times[wire] = []
    counted = {}
    for wire, step in steps.items():
        with CommBytes() as mode:
            step(*example.batch)
        counted[wire] = mode.bytes
    for _ in range(args.rounds):
        for wire, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(*example.batch)
            times[wire].append((time.perf_counter() - start) / args.steps)
    if dist.get_rank() == 0:
        for wire, step in steps.items():
            stats = next(r.stats for r in step.pass_results if r.name == "insert_allreduce")
            grad_bytes = sum(b for (kind, dtype), b in counted[wire].items() if kind == "all_reduce")
            print(f"grad_comm_dtype={wire!s:5}  measured all-reduce bytes/step {grad_bytes:>12,}  "
                  f"(pass stat {stats['allreduce_bytes']:,}; by dtype {dict(counted[wire])})  "
                  f"step {statistics.median(times[wire]):.3f} s")
        full = sum(b for (k, _), b in counted[None].items() if k == "all_reduce")
        half = sum(b for (k, _), b in counted["bf16"].items() if k == "all_reduce")
        print(f"ratio bf16 / fp32 all-reduce bytes: {half / full:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
