"""Local SGD, DGC and the hierarchical all-reduce against torch's own peers, over a slow link.

Run by benchmarks/slow_link.py (2 nodes of 2 processes, the link between them
rate-limited). Every side trains GPT-2 (by default 4 layers, hidden 256, vocabulary 4,096) with SGD
and momentum from the same weights on the same learnable batches; the sides take their
steps in turn (step k of every side, then step k+1), so machine noise hits all alike:

- DDP;
- DDP with PowerSGD (torch's gradient compression hook, rank 1, error feedback);
- DDP with PostLocalSGDOptimizer (torch's Local SGD: PeriodicModelAverager, no gradient
  sum after the warm-up);
- autopar dp=4 (flat), autopar hierarchical, autopar Local SGD (the same H and warm-up),
  flat and hierarchical (its warm-up's gradients and its averages in two levels), and
  both with each average overlapped with the next k local steps (`--overlap`);
- autopar DGC at sparsity 0.999 after the same warm-up (dense) and a ramp-up of as many
  steps, with exact and with sampled top-k.

Prints per side: the median step time after the warm-up, the mean bytes node 0 sent over
the link per step after the warm-up (its veth's counter) and over the last quarter of
the steps (DGC's steady state, past its ramp-up), the mean loss over the ranks at
the last step, and the time to target: the wall clock (sum of step times) until the
mean loss first falls below DDP's loss at step --target-step.

`--block N`: each side takes the warm-up, then blocks of N steps, back to back (no
barrier between them; the wait at the barrier after a block counts to its last step, so
a block's time is its slowest rank's), before the next side's turn. Local SGD's ranks
meet only at an average, as in training; a barrier around every step (N = 1) charges
every local step its slowest rank. N a multiple of the period keeps an overlapped
average inside its own side's turn.

    python benchmarks/slow_link.py --rate 1gbit -- benchmarks/comm_efficient.py --steps 40

`--table FILE --targets 40 80 120` prints the Markdown table of a saved run (the JSON it
printed), the time to target read at DDP's loss at each of those steps.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import time

import common  # benchmarks/common.py
import torch
import torch.distributed as dist
from hierarchical_vs_ddp import two_nodes, tx_bytes
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import autopar
from autopar.examples import gpt2


def sgd(params, lr: float = 0.05):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def learnable(batch: int, seq: int, steps: int, vocab: int) -> list[torch.Tensor]:
    """Sequences a model can learn: each token the previous plus a per-sequence stride."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        out.append((start + stride * torch.arange(seq)) % vocab)
    return out


def ddp_side(model, loss_fn, rank, world, hook=None, local=None, lr=0.05):
    # PowerSGD issues its collectives from futures' callbacks; with several buckets, gloo
    # saw them in different orders on different ranks (a size mismatch abort, torch
    # 2.13), so its gradients travel as one bucket
    ddp = DDP(model, bucket_cap_mb=10_000) if hook == "powersgd" else DDP(model)
    opt = sgd(list(ddp.parameters()), lr)
    if hook == "powersgd":
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=local[1])
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    elif hook == "localsgd":
        period, warmup = local
        ddp.register_comm_hook(PostLocalSGDState(None, None, warmup,
                                                 post_local_gradient_allreduce=False),
                               post_localSGD_hook)
        opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period, warmup))
    return common.eager_step(ddp, loss_fn, opt, lambda ids: ids.chunk(world)[rank])


def smoothed(values: list[float], k: int) -> list[float]:
    """Each step's mean loss over its last k steps (fewer at the start)."""
    return [statistics.mean(values[max(0, i + 1 - k):i + 1]) for i in range(len(values))]


def reached(losses: list[float], target: float, k: int) -> int | None:
    """The first step (1-based) at which `losses`, smoothed over k steps, is at or below
    `target`; None if it never is."""
    return next((i + 1 for i, v in enumerate(smoothed(losses, k)) if v <= target), None)


def table(result: dict, targets: list[int]) -> str:
    """A saved run's Markdown table: per side its link bytes per step and median step
    time after the warm-up, its mean step time over the whole run, and for DDP's
    smoothed loss at each of `targets` the step a side first reaches it and its time to
    there over DDP's (the sum of its step times)."""
    sides, k = result["sides"], result["smooth"]
    ddp = sides["DDP"]
    goals = [smoothed(ddp["losses"], k)[n - 1] for n in targets]
    ddp_s = [sum(ddp["step_s"][:reached(ddp["losses"], g, k)]) for g in goals]
    named = " / ".join(map(str, targets))
    rows = [f"| side | MB per step | median / mean step s | reaches DDP's loss at step {named} "
            f"| time to target / DDP (N = {named}) |", "|---|---|---|---|---|"]
    for name, side in sides.items():
        steps = [reached(side["losses"], g, k) for g in goals]
        ratios = ["-" if n is None else f"{sum(side['step_s'][:n]) / t:.3f}"
                  for n, t in zip(steps, ddp_s)]
        rows.append(f"| {name} | {side['link_bytes_per_step'] / 1e6:.2f} | "
                    f"{side['median_step_s']:.3f} / {statistics.mean(side['step_s']):.3f} | "
                    f"{' / '.join('-' if n is None else str(n) for n in steps)} | "
                    f"{' / '.join(ratios)} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", metavar="FILE", default=None,
                        help="print the Markdown table of a saved run (its JSON, as printed) "
                             "for the --targets, and exit; nothing runs")
    parser.add_argument("--targets", type=int, nargs="+", default=[40, 80, 120],
                        help="with --table: the steps of DDP's loss to read the time to")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--target-step", type=int, default=None,
                        help="DDP's loss at this step is the target (default: the last)")
    parser.add_argument("--period", type=int, default=4, help="Local SGD's H")
    parser.add_argument("--warmup", type=int, default=8, help="synchronous steps first")
    parser.add_argument("--rate-bytes", type=float, default=125e6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate, every side")
    parser.add_argument("--dgc-sparsity", type=float, default=0.999)
    parser.add_argument("--dgc-rampup", type=int, default=None,
                        help="DGC's sparsity ramp-up in steps (default: --warmup)")
    parser.add_argument("--smooth", type=int, default=1,
                        help="the time to target reads the mean loss of the last k steps "
                             "(DDP's target too): a per-step loss on fresh batches is noisy")
    parser.add_argument("--overlap", type=int, nargs="*", default=[1],
                        help="Local SGD sides overlapped with each of these k "
                             "(Layout.local_sgd_overlap): 'autopar Local SGD [hierarchical] "
                             "overlapped k=K'")
    parser.add_argument("--block", type=int, default=1,
                        help="steps a side takes back to back before the next side's turn: "
                             "the warm-up, then blocks of this many (a multiple of --period "
                             "keeps an overlapped average inside its own side's turn); "
                             "no barrier between the steps of a block, and the wait at the "
                             "barrier after it counts to its last step (1: every step "
                             "alternates, with a barrier before and after it)")
    parser.add_argument("--sides", nargs="+", default=None,
                        help="run only these sides (names as printed; DDP always runs)")
    args = parser.parse_args()
    if args.table is not None:
        text = open(args.table).read()
        print(table(json.loads(text[text.index("{"):]), args.targets))
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    example = gpt2(layers=args.layers, hidden=args.hidden, heads=8, vocab=4096, batch=16, seq=128)
    cluster, loss_fn, local = two_nodes(args.rate_bytes), example.loss_fn, (args.period, args.warmup)

    def ours(**fields):
        return autopar.compile(copy.deepcopy(example.model), cluster, example.batch, loss_fn,
                               optimizer=functools.partial(sgd, lr=args.lr),
                               layout=autopar.Layout(dp=world, **fields))

    model, rampup = example.model, args.dgc_rampup or args.warmup
    builders = {
        "DDP": lambda: ddp_side(copy.deepcopy(model), loss_fn, rank, world, lr=args.lr),
        "DDP + PowerSGD": lambda: ddp_side(copy.deepcopy(model), loss_fn, rank, world,
                                           "powersgd", local, args.lr),
        "DDP + PostLocalSGD": lambda: ddp_side(copy.deepcopy(model), loss_fn, rank, world,
                                               "localsgd", local, args.lr),
        "autopar dp": lambda: ours(),
        "autopar hierarchical": lambda: ours(allreduce="hierarchical"),
        "autopar Local SGD": lambda: ours(local_sgd=args.period, local_sgd_warmup=args.warmup),
        # the warm-up's gradients and the averages in two levels (node, then among nodes)
        "autopar Local SGD hierarchical": lambda: ours(local_sgd=args.period,
                                                       local_sgd_warmup=args.warmup,
                                                       allreduce="hierarchical"),
        "autopar DGC exact": lambda: ours(dgc=args.dgc_sparsity, dgc_warmup=args.warmup,
                                          dgc_rampup=rampup),
        "autopar DGC sampled": lambda: ours(dgc=args.dgc_sparsity, dgc_warmup=args.warmup,
                                            dgc_rampup=rampup, dgc_topk="sampled"),
    }
    for k in args.overlap:  # the average overlapped with the next k local steps
        builders[f"autopar Local SGD overlapped k={k}"] = functools.partial(
            ours, local_sgd=args.period, local_sgd_warmup=args.warmup, local_sgd_overlap=k)
        builders[f"autopar Local SGD hierarchical overlapped k={k}"] = functools.partial(
            ours, local_sgd=args.period, local_sgd_warmup=args.warmup, local_sgd_overlap=k,
            allreduce="hierarchical")
    unknown = sorted(set(args.sides or ()) - set(builders))
    if unknown:
        raise SystemExit(f"--sides: unknown {unknown}; the sides are {sorted(builders)}")
    sides = {n: build() for n, build in builders.items()
             if args.sides is None or n == "DDP" or n in args.sides}
    batches = learnable(16, 128, args.steps, 4096)
    times = {n: [] for n in sides}
    sent = {n: [] for n in sides}
    losses = {n: [] for n in sides}
    blocks = [range(0, min(args.warmup, args.steps))] + [
        range(k, min(k + args.block, args.steps))
        for k in range(args.warmup, args.steps, args.block)]
    for block in blocks if args.block > 1 else []:
        for name, step in sides.items():
            dist.barrier()
            before = tx_bytes()
            mine = []
            for k in block:
                start = time.perf_counter()
                mine.append(step(batches[k]).detach().float().reshape(1))
                times[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            dist.barrier()  # the slowest rank's block: its wait counts to the last step
            times[name][-1] += time.perf_counter() - start
            time.sleep(0.05)  # the counter settles
            sent[name] += [(tx_bytes() - before) / len(block)] * len(block)
            mean = torch.cat(mine)
            dist.all_reduce(mean)  # untimed: the loss the ranks' models reach together
            losses[name] += (mean / world).tolist()
    for batch in batches if args.block == 1 else []:
        for name, step in sides.items():
            dist.barrier()
            before = tx_bytes()
            start = time.perf_counter()
            loss = step(batch)
            times[name].append(time.perf_counter() - start)
            dist.barrier()
            time.sleep(0.05)  # the counter settles
            sent[name].append(tx_bytes() - before)
            mean = loss.detach().clone().float()
            dist.all_reduce(mean)  # untimed: the loss the ranks' models reach together
            losses[name].append(float(mean) / world)
    target_step = (args.target_step or args.steps) - 1
    target = smoothed(losses["DDP"], args.smooth)[target_step]

    def to_target(name):
        step = reached(losses[name], target, args.smooth)
        return None if step is None else sum(times[name][:step])

    if rank == 0:
        after = slice(args.warmup, None)
        result = {"benchmark": "comm_efficient", "world": world, "steps": args.steps,
                  "layers": args.layers, "hidden": args.hidden,
                  "period": args.period, "warmup": args.warmup, "lr": args.lr,
                  "dgc_sparsity": args.dgc_sparsity, "dgc_rampup": rampup, "smooth": args.smooth,
                  "block": args.block, "overlap": args.overlap,
                  "link": os.environ.get("AUTOPAR_BENCH_RATE", "unshaped"),
                  "target_loss": target, "target_step": target_step + 1,
                  "sides": {n: {"median_step_s": statistics.median(times[n][after]),
                                "link_bytes_per_step": statistics.mean(sent[n][after]),
                                # the last quarter: DGC's final sparsity, past its ramp-up
                                "link_bytes_last_quarter": statistics.mean(
                                    sent[n][-max(1, args.steps // 4):]),
                                "final_loss": losses[n][-1],
                                "final_loss_smoothed": smoothed(losses[n], args.smooth)[-1],
                                "time_to_target_s": to_target(n),
                                "total_s": sum(times[n]),
                                # per step, to read a time to target off any other step
                                "losses": [round(v, 5) for v in losses[n]],
                                "step_s": [round(t, 5) for t in times[n]]} for n in sides},
                  "torch": torch.__version__}
        ddp_time = result["sides"]["DDP"]["time_to_target_s"]
        for side in result["sides"].values():
            side["time_to_target_over_ddp"] = (side["time_to_target_s"] / ddp_time
                                               if side["time_to_target_s"] else None)
        print(json.dumps(result, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
