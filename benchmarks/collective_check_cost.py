"""What the pre-launch collective check costs inside `autopar.compile`: the exchange of
every rank's collectives (one all_gather_object) and their comparison
(compiler/ir/collectives.py), against the whole compile, for GPT-2 and Llama at dp=2,
tp=2 and pp=2 (2 processes, gloo, CPU).

    OMP_NUM_THREADS=1 PYTHONPATH=. torchrun --standalone --nproc-per-node 2 \\
        benchmarks/collective_check_cost.py

The check's time is the median of `--repeat` calls of the check alone on the compiled
program; the compile's is one compile (its first call, which includes the check).
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time

import torch.distributed as dist

import autopar
from autopar.api import _check_collectives_across_ranks
from autopar.compiler.ir.collectives import program_collectives
from autopar.examples import gpt2, llama

LAYOUTS = {"dp2": autopar.Layout(dp=2), "tp2": autopar.Layout(tp=2),
           "pp2": autopar.Layout(pp=2, microbatches=2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    dist.init_process_group("gloo")
    rows = []
    for name, factory in {"gpt2": lambda: gpt2(layers=4), "llama": lambda: llama(layers=4)}.items():
        for label, layout in LAYOUTS.items():
            ex = factory()
            dist.barrier()
            start = time.perf_counter()
            step = autopar.compile(copy.deepcopy(ex.model), autopar.ClusterSpec.local(2), ex.batch,
                                   ex.loss_fn, layout=layout)
            compile_s = time.perf_counter() - start
            checks = []
            for _ in range(args.repeat):
                dist.barrier()
                start = time.perf_counter()
                _check_collectives_across_ranks(step.program)
                checks.append(time.perf_counter() - start)
            count = sum(len(c) for c in program_collectives(step.program).values())
            check_s = statistics.median(checks)
            rows.append((name, label, count, check_s, compile_s))
    if dist.get_rank() == 0:
        print("| model | layout | collectives in the program | check ms (median) | compile s | "
              "check / compile |")
        print("|---|---|---|---|---|---|")
        for name, label, count, check_s, compile_s in rows:
            print(f"| {name} | {label} | {count} | {check_s * 1e3:.2f} | {compile_s:.2f} | "
                  f"{check_s / compile_s:.2%} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
