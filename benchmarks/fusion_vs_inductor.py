"""Fusion: kernel launches, non-matmul bytes and compile time of one training step,
unfused aten graph vs autopar's fused graph vs torch.compile (Inductor), on CPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fusion_vs_inductor.py --model gpt2-small4

- launches: ops of the traced training step that run a kernel (views, metadata ops and
  getitem run none); a fused region counts once. Compared with Inductor on the ops it
  generates code for (all but matmuls and attention, which it calls as extern kernels):
  torch._inductor.metrics.generated_kernel_count for the same forward + loss + backward;
- non-matmul bytes: bytes read + written by every kernel that is not a matmul or
  attention (autopar's per-node byte count, the cost model's);
- compile time: autopar's fusion pass + Triton source generation of every kernel (and,
  separately, with the trace), vs Inductor's first call minus an eager step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch

import autopar
from autopar.api import run_passes
from autopar.compiler.codegen.kernels import FUSED_OP
from autopar.compiler.codegen.listing import kernel_rows
from autopar.compiler.ir import meta as M
from autopar.compiler.passes.fuse_regions import clear_memo
from autopar.examples import load_example

# views that the schema does not mark as views: they move no data and launch nothing
_NO_KERNEL = {torch.ops.aten.detach.default, torch.ops.aten.alias.default,
              torch.ops.aten._unsafe_view.default}


def launches(tg, matmuls: bool = True) -> int:
    """Ops that run a kernel; without `matmuls`, only those with no matmul FLOPs (what
    Inductor generates code for: it calls matmuls and attention as extern kernels)."""
    return sum(1 for n in tg.call_nodes() if isinstance(n.target, torch._ops.OpOverload)
               and not n.target.is_view and n.target not in _NO_KERNEL
               and (matmuls or not n.meta.get(M.FLOPS, 0)))


def non_matmul_bytes(tg) -> int:
    return sum(n.meta.get(M.BYTES, 0) for n in tg.call_nodes() if not n.meta.get(M.FLOPS, 0))


def autopar_side(example, repeats: int) -> dict:
    start = time.perf_counter()
    tg = autopar.trace(example.model, example.batch, example.loss_fn)
    trace_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):  # fusion + source generation of every kernel (first: cold)
        clear_memo()  # decide afresh each time: the memo would replay the first run's regions
        start = time.perf_counter()
        fused, _ = run_passes(tg, autopar.Layout(fusion=True))
        kernel_rows(fused)
        times.append(time.perf_counter() - start)
    return {"unfused_launches": launches(tg), "fused_launches": launches(fused),
            "unfused_non_matmul_launches": launches(tg, matmuls=False),
            "fused_non_matmul_launches": launches(fused, matmuls=False),
            "fused_kernels": sum(n.target == FUSED_OP for n in fused.call_nodes()),
            "unfused_bytes": non_matmul_bytes(tg), "fused_bytes": non_matmul_bytes(fused),
            "fusion_codegen_s": statistics.median(times), "fusion_codegen_first_s": times[0],
            "trace_s": trace_s}


def inductor_side(example) -> dict:
    from torch._inductor import config, metrics

    # a cold compile: no FX graph cache (a warm cache cut GPT-2's compile from 38 s to 13 s)
    config.fx_graph_cache = False
    config.fx_graph_remote_cache = False
    model = copy.deepcopy(example.model)

    def step(*batch):
        loss = example.loss_fn(model(*batch), *batch)
        loss.backward()
        return loss.detach()

    start = time.perf_counter()
    step(*example.batch)
    eager_s = time.perf_counter() - start
    torch._dynamo.reset()
    metrics.reset()
    compiled = torch.compile(step)
    start = time.perf_counter()
    compiled(*example.batch)
    first_s = time.perf_counter() - start
    return {"inductor_kernels": metrics.generated_kernel_count,
            "inductor_bytes_accessed": metrics.num_bytes_accessed,
            "inductor_compile_s": first_s - eager_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-small4")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of fusion + codegen")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--dropout", type=float, default=None,
                   help="GPT-2's dropout probability (the examples have none)")
    args = p.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
    torch.set_num_threads(1)
    example = load_example(args.model, **({} if args.dropout is None else {"dropout": args.dropout}))
    row = autopar_side(example, args.repeats)
    if not args.no_inductor:
        row.update(inductor_side(example))
    row["launch_ratio_unfused_over_fused"] = row["unfused_launches"] / row["fused_launches"]
    row["bytes_ratio_unfused_over_fused"] = row["unfused_bytes"] / row["fused_bytes"]
    if "inductor_kernels" in row:
        row["fused_non_matmul_over_inductor"] = (row["fused_non_matmul_launches"]
                                                 / max(row["inductor_kernels"], 1))
        row["compile_ratio_ours_over_inductor"] = row["fusion_codegen_s"] / row["inductor_compile_s"]
        row["compile_ratio_with_trace"] = ((row["trace_s"] + row["fusion_codegen_first_s"])
                                           / row["inductor_compile_s"])
    for key, value in row.items():
        print(f"{key:34s} {value:.4g}" if isinstance(value, float) else f"{key:34s} {value}")


if __name__ == "__main__":
    main()
