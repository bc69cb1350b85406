"""pp=2 against torch.distributed.pipelining with autopar's own cut and with a cut inside a
block, on several GPT-2 shapes (issue 33's pp cells).

For each shape the cut inside a block is the one the cost model prices fastest:
`assign_stages`'s estimated stage seconds on one micro-batch's trace, over every
block boundary and every direct child module of every block as a pinned cut
(`PassOptions.pipeline_cuts`). Each cell is `benchmarks/pp_vs_pipelining.py` under
torchrun (autopar and the peer alternating inside it); the two cuts alternate cell by
cell, and the whole list repeats `--reps` times, so both see the same host.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_cuts.py --vocab 4096 \\
        --shapes 256x4 256x8 512x4 512x8 --rounds 3 --steps 2 --reps 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "gpt2-small4"


def predicted_cuts(vocab: int, hidden: int, layers: int) -> dict[str, list[float]]:
    """{cut (module path, "" for assign_stages' own): estimated seconds of each stage}."""
    import torch

    import autopar
    from autopar.compiler.passes.assign_stages import AssignStages
    from autopar.compiler.passes.base import PassContext
    from autopar.examples import load_example

    torch.manual_seed(0)
    example = load_example(MODEL, vocab=vocab, hidden=hidden, layers=layers)
    micro = tuple(t[:len(t) // 4] for t in example.batch)  # pp_vs_pipelining: 4 micro-batches
    tg = autopar.trace(example.model, micro, example.loss_fn)
    layout, cluster = autopar.Layout(pp=2, microbatches=4), autopar.ClusterSpec.local(2)
    container, count = tg.source.blocks
    blocks = dict(example.model.named_modules())
    cuts = [""] + [f"{container}.{i}" for i in range(1, count)]
    cuts += [f"{container}.{i}.{child}" for i in range(count)
             for child, _ in blocks[f"{container}.{i}"].named_children()]
    out = {}
    for cut in cuts:
        options = {"pipeline_cuts": [cut]} if cut else {}
        try:
            stats = AssignStages().run(tg, PassContext(layout, cluster, options))[1].stats
        except ValueError:  # a child that runs no forward op, or the first block's start
            continue
        out[cut] = stats["estimated_stage_seconds"]
    return out


def run_cell(vocab: int, hidden: int, layers: int, cut: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", str(HERE / "pp_vs_pipelining.py"), "--model", MODEL,
                   "--vocab", str(vocab), "--hidden", str(hidden), "--layers", str(layers),
                   "--rounds", str(args.rounds), "--steps", str(args.steps), "--out", str(out)]
        command += ["--cut", cut] if cut else []
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent),
                                                           os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode or not out.exists():
            raise RuntimeError(f"{command} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--shapes", nargs="+", default=["256x4", "256x8", "512x4", "512x8"],
                   help="hidden x layers")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", help="write every cell's result here")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    chosen = {}
    for hidden, layers in shapes:
        predicted = predicted_cuts(args.vocab, hidden, layers)
        inside = {c: s for c, s in predicted.items() if c.count(".") > 2}
        best = min(inside, key=lambda c: max(inside[c]))
        chosen[hidden, layers] = best
        print(f"{hidden}x{layers}: own cut {predicted['']} s, fastest inside a block {best} "
              f"{predicted[best]} s", flush=True)
    cells: dict[str, list[dict]] = {}
    for _ in range(args.reps):
        for hidden, layers in shapes:
            for cut in ("", chosen[hidden, layers]):
                r = run_cell(args.vocab, hidden, layers, cut, args)
                cells.setdefault(f"h{hidden} l{layers} {cut or 'own'}", []).append(r)
                print(f"{hidden}x{layers} {cut or 'own cut'}: ratio {r['ratio']:.3f} peak ratio "
                      f"{r['peak_ratio']:.3f} medians {r['median_step_s']}", flush=True)
    print("| hidden x layers | cut | time / pipelining (median of reps) | autopar s | "
          "peak / pipelining |")
    print("|---|---|---|---|---|")
    for key, runs in cells.items():
        hidden, layers, cut = key.split()
        print(f"| {hidden[1:]} x {layers[1:]} | {cut} | "
              f"{statistics.median(r['ratio'] for r in runs):.3f} | "
              f"{statistics.median(r['median_step_s']['autopar'] for r in runs):.3f} | "
              f"{runs[0]['peak_ratio']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cells": cells,
                                               "chosen": {f"{h}x{n}": c for (h, n), c
                                                          in chosen.items()}}, indent=1))


if __name__ == "__main__":
    main()
