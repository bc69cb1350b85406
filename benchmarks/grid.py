"""Every layout against PyTorch's own on a grid of model shapes, one torchrun job per cell.

The grid: vocabulary {4,096, 50,257} x hidden {256, 512} x layers {4, 8}, for

- dp=2 against DDP (`dp_vs_ddp.py`, GPT-2; target <= 1.0),
- tp=2 against DTensor colwise/rowwise (`tp_vs_dtensor.py`, Llama; target <= 0.9),
- pp=2, 1F1B, 4 micro-batches against torch.distributed.pipelining
  (`pp_vs_pipelining.py`, GPT-2; target <= 0.95),
- dp=2, zero=3 against FSDP2 (`zero3_vs_fsdp2.py`, GPT-2; target <= 1.0),

batch 16 x 128 tokens, AdamW, 2 gloo processes of one thread each. Each cell's script
alternates its two sides in rounds and measures the peak bytes of a step of each side
the same way (`common.peak_bytes`). Cells run one after another, never two at once;
each finished cell is appended to --json at once, and a rerun skips the cells the
file already holds, so a long grid can be resumed. Prints the table as markdown.

    .venv/bin/python benchmarks/grid.py --json benchmarks/data/grid.json \\
        --rounds 3 --steps 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# layout -> (script, model, target ratio)
LAYOUTS = {
    "dp": ("dp_vs_ddp.py", "gpt2-small4", 1.0),
    "tp": ("tp_vs_dtensor.py", "llama-small4", 0.9),
    "pp": ("pp_vs_pipelining.py", "gpt2-small4", 0.95),
    "zero3": ("zero3_vs_fsdp2.py", "gpt2-small4", 1.0),
}
PEERS = {"dp": "DDP", "tp": "DTensor", "pp": "pipelining", "zero3": "FSDP2"}


def cell_key(layout: str, vocab: int, hidden: int, layers: int) -> str:
    return f"{layout} v{vocab} h{hidden} l{layers}"


def run_cell(layout: str, vocab: int, hidden: int, layers: int, args) -> dict:
    """One cell: its script under torchrun; the result it wrote, or the failure."""
    script, model, _ = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cell.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", str(HERE / script), "--model", model,
                   "--vocab", str(vocab), "--hidden", str(hidden), "--layers", str(layers),
                   "--rounds", str(args.rounds), "--steps", str(args.steps),
                   "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent),
                                                           os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.cell_timeout)
        if done.returncode or not out.exists():
            return {"error": f"exit {done.returncode}", "log_tail": done.stderr[-3000:]}
        return json.loads(out.read_text())


def table(results: dict) -> str:
    lines = ["| layout (peer, target) | vocab | hidden | layers | autopar s | peer s | "
             "ratio | peak ratio |", "|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        layout, vocab, hidden, layers = key.split()
        target = LAYOUTS[layout][2]
        if "error" in r:
            lines.append(f"| {layout} ({PEERS[layout]}, <= {target}) | {vocab[1:]} | "
                         f"{hidden[1:]} | {layers[1:]} | {r['error']} | | | |")
            continue
        ours, peer = r["median_step_s"]["autopar"], [
            v for k, v in r["median_step_s"].items() if k != "autopar"][0]
        miss = "" if r["ratio"] <= target else " (misses)"
        high = "" if r["peak_ratio"] <= 1.0 else " (higher)"
        lines.append(f"| {layout} ({PEERS[layout]}, <= {target}) | {vocab[1:]} | {hidden[1:]} "
                     f"| {layers[1:]} | {ours:.3f} | {peer:.3f} | {r['ratio']:.3f}{miss} | "
                     f"{r['peak_ratio']:.3f}{high} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="results file (appended to, and resumed)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--vocabs", nargs="+", type=int, default=[4096, 50257])
    p.add_argument("--hiddens", nargs="+", type=int, default=[256, 512])
    p.add_argument("--layer-counts", nargs="+", type=int, default=[4, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cell-timeout", type=int, default=1800, help="seconds per cell")
    p.add_argument("--table-only", action="store_true", help="print the file's table, run nothing")
    args = p.parse_args()
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.exists() else {}
    if not args.table_only:
        for layout, vocab, hidden, layers in itertools.product(
                args.layouts, args.vocabs, args.hiddens, args.layer_counts):
            key = cell_key(layout, vocab, hidden, layers)
            if key in results and "error" not in results[key]:
                continue
            print(f"running {key}", file=sys.stderr, flush=True)
            results[key] = run_cell(layout, vocab, hidden, layers, args)
            path.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
