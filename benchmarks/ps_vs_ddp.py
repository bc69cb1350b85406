"""Parameter servers against DDP on a CTR model (docs/parameter_server.md).

Sides, on the built-in CTR example (EmbeddingBag tables of >= 10^6 rows, an MLP,
synthetic Criteo-like batches; Adagrad, lr 0.05; the same per-trainer batch):

- ps-sync: autopar, Layout(dp=W, ps=PSLayout(servers=2)): 2 server processes + W
  trainers, the tables on the meta device in the trainers' model;
- ddp-dense: torch DDP over W processes, every table replicated, its whole gradient
  all-reduced every step;
- ddp-sparse: the same with EmbeddingBag(sparse=True): DDP all-gathers each rank's
  sparse gradient rows;
- TorchRec's EmbeddingBagCollection: not run. fbgemm-gpu-cpu 1.9.0 (the newest on the
  package index) does not load on torch 2.13 (an undefined symbol in
  fbgemm_gpu_tbe_index_select.so), and TorchRec needs it.

Each (shape, trainers, side) is one job; the jobs of a round run one after another,
sides alternating, for --rounds rounds. Per job: the median step time after two
warm-up steps (each trainer's own clock; the job's median over trainers), the tables'
bytes per trainer and step (ps: ids and rows pulled and pushed, counted; ddp-dense: the
tables' gradient, which the all-reduce moves 2(W-1)/W times; ddp-sparse: the sparse
gradient's rows and ids this rank contributes), and the peak RSS of a trainer. Then,
with W=2 and trainer 1 slowed 2x on purpose (it sleeps as long as each step took),
ps-sync against ps-async: examples per second, each trainer's rate after the warm-up
summed (DDP: the global batch over the slowest rank's median step).

    python benchmarks/ps_vs_ddp.py --rounds 2 --steps 12 --out benchmarks/data/ps_vs_ddp.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

SHAPES = {
    "2 x 1M x 16": {"fields": 2, "rows": 1_000_000, "dim": 16},
    "4 x 1M x 32": {"fields": 4, "rows": 1_000_000, "dim": 32},
}
PER_TRAINER = 256
HOT = 3


def run_ps(shape: dict, trainers: int, steps: int, mode: str = "sync",
           slow: int | None = None) -> dict:
    from autopar.ps_worker import PSJob

    model_args = {**shape, "batch": PER_TRAINER * trainers, "hot": HOT, "tables_on": "meta"}
    args = ["ctr", "--steps", str(steps), "--mode", mode, "--optimizer", "adagrad",
            "--lr", "0.05", "--model-args", json.dumps(model_args)]
    if slow is not None:
        args += ["--slow", str(slow)]
    job = PSJob(args, servers=2, trainers=trainers, mode=mode).start()
    times, done, first, last = [], [], {}, {}
    for event in job.events():
        if event["event"] == "failed":
            raise RuntimeError(event)
        if event["event"] == "step":
            if event["step"] > 2:
                times.append(event["seconds"])
            if event["step"] == 2:
                first[event["trainer"]] = time.perf_counter()
            last[event["trainer"]] = time.perf_counter()
        elif event["event"] == "trainer_done":
            done.append(event)
    # each trainer's own rate over its steps after the warm-up, summed: what the job
    # trains per second while every trainer runs
    rate = sum(PER_TRAINER * (steps - 2) / (last[j] - first[j]) for j in first)
    return {"step_s": statistics.median(times),
            "bytes_per_step": statistics.mean((d["pushed_bytes"] + d["pulled_bytes"]) / steps
                                              for d in done),
            "rss_mib": max(d["rss_mib"] for d in done),
            "examples_per_s": rate}


def run_ddp(shape: dict, trainers: int, steps: int, sparse: bool) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={trainers}", __file__, "--ddp-worker", "--shape",
           json.dumps(shape), "--steps", str(steps)] + (["--sparse"] if sparse else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                             timeout=600)
    except subprocess.TimeoutExpired as exc:  # a gloo job that hung: say so, go on
        print(f"DDP job timed out: {' '.join(cmd)}\n{(exc.stderr or b'')[-3000:]!r}",
              flush=True)
        return None
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-4000:])
    return json.loads(lines[-1])


def ddp_worker(shape: dict, steps: int, sparse: bool) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar.examples import CTR, criteo_like, ctr_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = CTR(shape["fields"], shape["rows"], shape["dim"])
    for table in model.tables:
        table.sparse = sparse
    ddp = DDP(model)
    opt = torch.optim.Adagrad(ddp.parameters(), lr=0.05)
    times, table_bytes = [], []
    for k in range(steps):
        batch = criteo_like(PER_TRAINER * world, shape["fields"], shape["rows"], HOT, 1 + k)
        mine = tuple(x.chunk(world)[rank] for x in batch)
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        loss = ctr_loss(ddp(*mine), *mine)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        if sparse:  # this rank's share of the gathered rows: its own looked-up ids
            sent = sum(mine[0][:, f].numel() * (8 + shape["dim"] * 4)
                       for f in range(shape["fields"]))
        else:
            sent = sum(t.weight.numel() * 4 for t in model.tables)
        table_bytes.append(sent)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    step = torch.tensor([statistics.median(times[2:])])
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, step)
    if rank == 0:
        step_s = statistics.median(float(g) for g in gathered)
        print(json.dumps({"step_s": step_s, "bytes_per_step": statistics.mean(table_bytes),
                          "rss_mib": float(rss), "examples_per_s":
                          world * PER_TRAINER / max(float(g) for g in gathered)}), flush=True)
    dist.barrier()
    # skip the interpreter's teardown: there, DDP's reducer can deadlock destroying its
    # gloo group (the GIL against the group's mutex; seen with 4 ranks)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--trainers", default="1,2,4")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out")
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--sparse", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ddp_worker:
        ddp_worker(json.loads(args.shape), args.steps, args.sparse)
        return
    sides = {
        "ps-sync": lambda shape, w: run_ps(shape, w, args.steps),
        "ddp-dense": lambda shape, w: run_ddp(shape, w, args.steps, sparse=False),
        "ddp-sparse": lambda shape, w: run_ddp(shape, w, args.steps, sparse=True),
    }
    samples: dict = {}
    for r in range(args.rounds):
        for name in args.shapes.split(","):
            for w in [int(x) for x in args.trainers.split(",")]:
                for side, run in sides.items():
                    got = run(SHAPES[name], w)
                    if got is None:
                        continue
                    samples.setdefault(f"{name}|{w}|{side}", []).append(got)
                    print(f"round {r} {name} W={w} {side}: {got}", flush=True)
        for mode in ("sync", "async"):
            got = run_ps(SHAPES["2 x 1M x 16"], 2, args.steps, mode=mode, slow=1)
            samples.setdefault(f"slowed|2|ps-{mode}", []).append(got)
            print(f"round {r} slowed trainer ps-{mode}: {got}", flush=True)
    result = {key: {m: statistics.median(s[m] for s in runs) for m in runs[0]}
              for key, runs in samples.items()}
    print(f"\n{'shape':14} {'W':>2} {'side':11} {'step ms':>9} {'MiB/step':>9} "
          f"{'RSS MiB':>8} {'examples/s':>11}")
    for key, m in result.items():
        name, w, side = key.split("|")
        print(f"{name:14} {w:>2} {side:11} {m['step_s'] * 1e3:9.1f} "
              f"{m['bytes_per_step'] / 2**20:9.3f} {m['rss_mib']:8.0f} "
              f"{m['examples_per_s']:11.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "per_trainer_batch": PER_TRAINER,
                       "result": result, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
