"""What a checkpoint costs: autopar's `step.save` / `step.load` against
torch.distributed.checkpoint used directly on the same tensors, and the step-time
overhead of saving every N steps against not saving (2 processes, gloo, CPU).

    OMP_NUM_THREADS=1 PYTHONPATH=. torchrun --standalone --nproc-per-node 2 \\
        benchmarks/checkpoint_cost.py

The DCP side saves {"model": weights, "optim": optimizer state} of the same step (the
same DTensor views autopar writes) with `dcp.save` / `dcp.load` and nothing else; the
autopar side adds what makes a checkpoint safe to resume from: the manifest, the
optimizer record, a SHA-256 of every file (computed again on load), the atomic rename
and the per-rank RNG state. Save and load are alternated between the two sides,
`--repeat` times; medians. The overhead run trains `--steps` steps without saving and
with a save every `--every` steps, synchronous or in the background
(`save(background=True)`: DCP's async_save), alternately; medians of the whole runs.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import common  # benchmarks/common.py (the script's own folder is on sys.path)

import autopar
from autopar.examples import gpt2, llama

MODELS = {
    "gpt2 4 layers, hidden 256": lambda: gpt2(layers=4, hidden=256, heads=8, vocab=8192,
                                              batch=8, seq=64),
    "llama 4 layers, hidden 512": lambda: llama(layers=4, hidden=512, heads=8, kv_heads=4,
                                                vocab=8192, batch=8, seq=64),
}
LAYOUTS = {"dp2": autopar.Layout(dp=2), "dp2 zero2": autopar.Layout(dp=2, zero=2)}


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _shared_dir() -> Path:
    box = [tempfile.mkdtemp(prefix="autopar-ckpt-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    return Path(box[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    args = p.parse_args()
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    root = _shared_dir()
    rank0 = dist.get_rank() == 0
    for model_name, factory in MODELS.items():
        for layout_name, layout in LAYOUTS.items():
            ex = factory()
            step = autopar.compile(ex.model, None, ex.batch, ex.loss_fn,
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                   layout=layout)
            batches = ex.batches(args.steps)
            step(*batches[0])  # optimizer state exists
            times = {k: [] for k in ("autopar save", "dcp save", "autopar load", "dcp load")}
            sizes = {}
            for r in range(args.repeat):
                ours, theirs = root / f"autopar-{r}", root / f"dcp-{r}"
                flat = {"model": step._named_tensors(), "optim": step._optimizer_state()}
                times["autopar save"].append(common.timed_collective(lambda: step.save(ours)))
                times["dcp save"].append(common.timed_collective(lambda: dcp.save(
                    flat, storage_writer=dcp.FileSystemWriter(theirs))))
                times["autopar load"].append(common.timed_collective(lambda: step.load(ours)))
                times["dcp load"].append(common.timed_collective(lambda: dcp.load(
                    flat, storage_reader=dcp.FileSystemReader(theirs))))
                if rank0:
                    sizes = {"autopar": _bytes(ours), "dcp": _bytes(theirs)}
                    shutil.rmtree(ours)
                    shutil.rmtree(theirs)
            runs = {"none": [], "sync": [], "background": []}
            for r in range(max(2, args.repeat // 2)):
                for label in runs:
                    def train(label=label, r=r):
                        pending = None
                        for k, b in enumerate(batches):
                            step(*b)
                            if label != "none" and (k + 1) % args.every == 0:
                                if pending is not None:
                                    pending.wait()
                                pending = step.save(root / f"train-{r}",
                                                    background=label == "background")
                        if pending is not None:
                            pending.wait()
                    runs[label].append(common.timed_collective(train))
            if rank0:
                med = {k: statistics.median(v) for k, v in times.items()}
                base, sync, background = (statistics.median(v) / args.steps * 1e3
                                          for v in runs.values())
                print(f"| {model_name} | {layout_name} | "
                      f"{med['autopar save'] * 1e3:.0f} / {med['dcp save'] * 1e3:.0f} "
                      f"({med['autopar save'] / med['dcp save']:.2f}x) | "
                      f"{med['autopar load'] * 1e3:.0f} / {med['dcp load'] * 1e3:.0f} "
                      f"({med['autopar load'] / med['dcp load']:.2f}x) | "
                      f"{sizes['autopar'] / 2**20:.1f} / {sizes['dcp'] / 2**20:.1f} | "
                      f"{base:.1f} | {sync:.1f} (+{(sync / base - 1) * 100:.1f}%) | "
                      f"{background:.1f} (+{(background / base - 1) * 100:.1f}%) |", flush=True)
    if rank0:
        shutil.rmtree(root, ignore_errors=True)
        print(f"columns: model | layout | save ms autopar / dcp | load ms autopar / dcp | "
              f"MiB autopar / dcp | ms per step: no saves | a synchronous save every "
              f"{args.every} steps | a background save every {args.every} steps (of "
              f"{args.steps}, the last one waited for); medians of {args.repeat}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
