"""How long `autopar.bisect` takes on a 4-layer GPT-2 (and Llama), against what the same
job spends to compile the step and run one step of it: bisect compiles the step too,
runs it once recording every value, traces and runs the single-process reference in
fp32 and float64, gathers the values on rank 0 and compares them node by node
(2 processes, gloo, CPU).

    OMP_NUM_THREADS=1 PYTHONPATH=. torchrun --standalone --nproc-per-node 2 \\
        benchmarks/bisect_time.py

The two are run alternately, `--repeat` times each; medians.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics

import torch.distributed as dist
import common  # benchmarks/common.py (the script's own folder is on sys.path)

import autopar
from autopar.bisection import bisect
from autopar.examples import gpt2, llama

LAYOUTS = {"dp2": autopar.Layout(dp=2), "tp2": autopar.Layout(tp=2),
           "dp2 zero3": autopar.Layout(dp=2, zero=3), "pp2": autopar.Layout(pp=2, microbatches=2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    dist.init_process_group("gloo")
    rows = []
    for name, factory in {"gpt2": lambda: gpt2(layers=4), "llama": lambda: llama(layers=4)}.items():
        ex = factory()
        for label, layout in LAYOUTS.items():
            reports = []

            def compile_and_step(ex=ex, layout=layout):
                step = autopar.compile(copy.deepcopy(ex.model), autopar.ClusterSpec.local(2),
                                       ex.batch, ex.loss_fn, layout=layout)
                step(*ex.batch)

            def run_bisect(ex=ex, layout=layout, reports=reports):
                reports.append(bisect(ex.model, ex.batch, ex.loss_fn, layout))

            times = {"compile": [], "bisect": []}
            for _ in range(args.repeat):
                times["compile"].append(common.timed_collective(compile_and_step))
                times["bisect"].append(common.timed_collective(run_bisect))
            report = reports[-1]
            rows.append((name, label, report.compared, report.nodes, report.ok,
                         statistics.median(times["bisect"]), statistics.median(times["compile"])))
    if dist.get_rank() == 0:
        print("| model | layout | nodes compared / in the program | no divergence | bisect s | "
              "compile + 1 step s | ratio |")
        print("|---|---|---|---|---|---|---|")
        for name, label, compared, nodes, ok, bisect_s, compile_s in rows:
            print(f"| {name} | {label} | {compared} / {nodes} | {ok} | {bisect_s:.2f} | "
                  f"{compile_s:.2f} | {bisect_s / compile_s:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
