"""Time of the tensor-parallel placement program (tp_solver.solve: building the integer
program and HiGHS solving it) on several models, for one or more checkouts of the
package, in alternating rounds; and the objective each finds, which must agree.

    python benchmarks/tp_solve_time.py [--trees . /tmp/old] [--rounds 5]

Each tree is put first on PYTHONPATH of a fresh interpreter (this one: its torch), which
traces each model once and then times `plan_tensor_parallel` (the solve, with the
parameter analysis around it) `--repeats` times; the round keeps the median. Prints a
markdown table of the median of the rounds per model, cluster and tree, and the
objective (predicted seconds of the tp=2 forward and backward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# model factory (autopar.examples) and keyword arguments: the tests' shapes and larger
MODELS = {
    "gpt2 (2 layers, hidden 64)": ("gpt2", {}),
    "llama (2 layers, hidden 64)": ("llama", {}),
    "phi3 (2 layers, hidden 64)": ("phi3", {}),
    "gpt2 (4 layers, hidden 256)": ("gpt2", {"layers": 4, "hidden": 256, "vocab": 4096}),
    "llama (4 layers, hidden 256)": ("llama", {"layers": 4, "hidden": 256, "vocab": 4096}),
}

CHILD = r"""
import json, statistics, sys, time
import torch
import autopar
from autopar import examples
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.passes.tensor_parallel import plan_tensor_parallel

specs, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
clusters = {"ClusterSpec.local(2)": autopar.ClusterSpec.local(2),
            "dgx-a100-80gb": autopar.ClusterSpec.preset("dgx-a100-80gb", nodes=1)}
out = {}
for name, (factory, kwargs) in specs.items():
    ex = examples.hf_tiny("phi3") if factory == "phi3" else getattr(examples, factory)(**kwargs)
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    for cname, cluster in clusters.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            plan, _ = plan_tensor_parallel(tg, 2, cluster, 2)
            times.append(time.perf_counter() - start)
        out[f"{name}|{cname}"] = (statistics.median(times), plan.cost_s)
print(json.dumps(out))
"""


def run(tree: Path, repeats: int) -> dict[str, tuple[float, float]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(MODELS), str(repeats)],
                          cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[tuple[str, Path], list[float]] = {}
    objective: dict[tuple[str, Path], float] = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            for key, (seconds, cost) in run(tree.resolve(), args.repeats).items():
                times.setdefault((key, tree), []).append(seconds)
                objective[key, tree] = cost
    keys = list(dict.fromkeys(key for key, _ in times))
    print("| model | cluster | " + " | ".join(f"{t} s" for t in args.trees) +
          (" | ratio" if len(args.trees) == 2 else "") + " | objective (ms) |")
    print("|---|---|" + "---|" * (len(args.trees) + (len(args.trees) == 2) + 1))
    for key in keys:
        model, cluster = key.split("|")
        med = [statistics.median(times[key, tree]) for tree in args.trees]
        cells = [f"{m:.3f}" for m in med]
        if len(args.trees) == 2:
            cells.append(f"{med[0] / med[1]:.3f}")
        costs = sorted({round(objective[key, tree] * 1e3, 6) for tree in args.trees})
        print(f"| {model} | {cluster} | " + " | ".join(cells) + " | " +
              " / ".join(f"{c:.6f}" for c in costs) + " |")


if __name__ == "__main__":
    main()
