"""Where a step's time goes: autopar's compiled step and PyTorch's own peer for the same
layout, profiled side by side with torch.profiler (docs/performance.md).

Both sides train the same model on the same batch in one gloo group; each side runs
its warm-up steps, then `--steps` steps under the profiler. Rank 0 prints, per side:
the wall time of a step, the self CPU time of every op summed over the profiled steps
(the ops that differ most between the sides first), the allocations (count and bytes
per step), and the time in collectives.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/profile_step.py --layout dp --vocab 4096
    ... --layout zero3        # against FSDP2 (fully_shard per block)
    ... --layout tp           # against DTensor colwise/rowwise (Llama, as the grid runs it)
    ... --layout pp           # against torch.distributed.pipelining Schedule1F1B

`--json F` writes the per-op table of both sides for later comparison.
"""

from __future__ import annotations

import collections
import copy
import json
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import autopar
import common  # benchmarks/common.py (the script's own folder is on sys.path)

COLLECTIVE_MARKS = ("gloo:", "c10d::", "allreduce", "all_reduce", "all_gather", "allgather",
                    "reduce_scatter", "broadcast", "_c10d_functional", "wait_tensor")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def peer_step(layout: str, example, rank: int, world: int):
    """PyTorch's own implementation of `layout` for a copy of the example's model."""
    model = copy.deepcopy(example.model)
    local = lambda ids: ids.chunk(world)[rank]  # noqa: E731 - the rank's share of the batch
    if layout == "dp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        return common.eager_step(ddp, example.loss_fn, adamw(list(ddp.parameters())), local)
    if layout == "zero3":
        from zero3_vs_fsdp2 import fsdp2_step_fn

        return fsdp2_step_fn(model, example.loss_fn, rank, world)[0]
    if layout == "tp":
        from tp_vs_dtensor import dtensor_step_fn

        return dtensor_step_fn(model, example.loss_fn, world)[0]
    if layout == "pp":
        from pp_vs_pipelining import pipelining_step_fn

        return pipelining_step_fn(model, example.batch, rank)
    raise ValueError(f"--layout {layout!r}: one of {', '.join(LAYOUTS)}")


LAYOUTS = ("dp", "zero3", "tp", "pp")


def autopar_layout(layout: str, world: int) -> autopar.Layout:
    from pp_vs_pipelining import MICROBATCHES

    return {"dp": autopar.Layout(dp=world), "zero3": autopar.Layout(dp=world, zero=3),
            "tp": autopar.Layout(tp=world),
            "pp": autopar.Layout(pp=world, microbatches=MICROBATCHES)}[layout]


def profiled(step, batch, warmup: int, steps: int, op: str | None = None) -> dict:
    """The step's ops under torch.profiler: {op: [self CPU µs, calls]}, allocations,
    collective time, and the median wall time of the profiled steps. With `op`, also
    where that op's calls come from: {"parent op | input shapes": [self CPU µs, calls]}."""
    common.time_steps(step, batch, warmup)
    walls = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 record_shapes=op is not None) as prof:
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step(*batch)
            walls.append(time.perf_counter() - start)
    ops: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    callers: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    allocs, alloc_bytes = 0, 0
    for event in prof.events():
        if event.name == "[memory]":
            if event.cpu_memory_usage > 0:
                allocs += 1
                alloc_bytes += event.cpu_memory_usage
            continue
        ops[event.name][0] += event.self_cpu_time_total
        ops[event.name][1] += 1
        if event.name == op:
            parent = event.cpu_parent.name if event.cpu_parent is not None else "(top level)"
            key = f"{parent} | {event.input_shapes}"
            callers[key][0] += event.self_cpu_time_total
            callers[key][1] += 1
    comm = sum(us for name, (us, _) in ops.items()
               if any(mark in name for mark in COLLECTIVE_MARKS))
    return {"wall_s": sorted(walls)[len(walls) // 2], "ops": dict(ops),
            "allocs_per_step": allocs / steps, "alloc_mb_per_step": alloc_bytes / steps / 2**20,
            "self_cpu_s_per_step": sum(us for us, _ in ops.values()) / steps / 1e6,
            "collective_s_per_step": comm / steps / 1e6, "callers": dict(callers)}


def report(sides: dict[str, dict], steps: int, top: int, op: str | None = None) -> None:
    names = list(sides)
    for name, side in sides.items():
        print(f"{name}: wall {side['wall_s']:.3f} s/step, self CPU {side['self_cpu_s_per_step']:.3f}"
              f" s/step, collectives {side['collective_s_per_step']:.3f} s/step, "
              f"{side['allocs_per_step']:.0f} allocations ({side['alloc_mb_per_step']:.0f} MB) "
              f"per step")
    every = set().union(*(side["ops"] for side in sides.values()))

    def per_step(name: str, op: str) -> tuple[float, float]:
        us, calls = sides[name]["ops"].get(op, (0.0, 0))
        return us / steps / 1e3, calls / steps

    differ = sorted(every, key=lambda o: -abs(per_step(names[0], o)[0] - per_step(names[1], o)[0]))
    print(f"\n| op | {names[0]} ms/step (calls) | {names[1]} ms/step (calls) | difference ms |")
    print("|---|---|---|---|")
    for name in differ[:top]:
        (a, ca), (b, cb) = per_step(names[0], name), per_step(names[1], name)
        print(f"| {name} | {a:.1f} ({ca:.0f}) | {b:.1f} ({cb:.0f}) | {a - b:+.1f} |")
    if op is None:
        return
    for name, side in sides.items():
        print(f"\n{name}: {op} by caller (parent op | input shapes), ms/step (calls/step)")
        if not side["callers"]:
            print(f"  no calls of {op!r} (names as the table above spells them, e.g. aten::copy_)")
        for key, (us, calls) in sorted(side["callers"].items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {us / steps / 1e3:8.1f} ({calls / steps:.0f})  {key}")


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0], steps=3)
    parser.add_argument("--layout", default="dp", choices=LAYOUTS)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", help="write both sides' per-op tables here")
    parser.add_argument("--op", help="also break this op (e.g. aten::copy_) down by the op "
                        "that called it and its input shapes")
    # tp's peer is DTensor's colwise/rowwise plan, which names Llama's modules (as the
    # grid runs it: benchmarks/tp_vs_dtensor.py); the others run GPT-2
    parser.set_defaults(model=None)
    args = parser.parse_args()
    args.model = args.model or ("llama-small4" if args.layout == "tp" else "gpt2-small4")
    rank, world, example = common.start(args)
    ours, _ = common.compile_timed(example, autopar_layout(args.layout, world), adamw)
    theirs = peer_step(args.layout, example, rank, world)
    sides = {"autopar": profiled(ours, example.batch, args.warmup, args.steps, args.op),
             "peer": profiled(theirs, example.batch, args.warmup, args.steps, args.op)}
    if rank == 0:
        report(sides, args.steps, args.top, args.op)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"layout": args.layout, "model": args.model, "steps": args.steps,
                           "sides": sides}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
