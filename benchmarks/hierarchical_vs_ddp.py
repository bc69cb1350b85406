"""autopar's hierarchical all-reduce against its flat one and DDP, over a slow link.

Run by benchmarks/slow_link.py, which puts two "nodes" of 2 processes each in network
namespaces joined by a veth pair shaped with `tc` (1 Gbit/s by default): the
processes of one node talk over their namespace's local routes, the nodes over the
shaped link. Same GPT-2 (4 layers, hidden 256), SGD with momentum, same batch on every
side; rounds alternate between the sides. Prints, per side, the median step time and
the bytes node 0 sent over the link per step (its veth's tx counter).

    python benchmarks/slow_link.py --rate 1gbit -- benchmarks/hierarchical_vs_ddp.py \\
        --vocab 4096 --rounds 3 --steps 3
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from pathlib import Path

import common  # benchmarks/common.py (the script's own folder is on sys.path)
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import autopar
from autopar.examples import gpt2


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def two_nodes(rate_bytes: float) -> autopar.ClusterSpec:
    spec = autopar.ClusterSpec.local(4).to_dict()
    spec.update(name="two-namespaces", nodes=2, devices_per_node=2,
                inter_node={"bandwidth": rate_bytes, "latency_s": 1e-4})
    return autopar.ClusterSpec.from_dict(spec)


def tx_bytes() -> int:
    """Bytes this node sent over the shaped link so far (0 outside slow_link.py)."""
    path = Path(f"/sys/class/net/{os.environ.get('AUTOPAR_BENCH_LINK', '-')}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else 0


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0], steps=3)
    parser.set_defaults(vocab=4096)
    parser.add_argument("--rate-bytes", type=float, default=125e6,
                        help="the link's rate, for the ClusterSpec the planner costs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    example = gpt2(layers=4, hidden=256, heads=8, vocab=args.vocab, batch=16, seq=128)
    cluster = two_nodes(args.rate_bytes)
    sides = {}
    for name, allreduce in (("autopar flat", "flat"), ("autopar hierarchical", "hierarchical")):
        sides[name] = autopar.compile(copy.deepcopy(example.model), cluster, example.batch,
                                      example.loss_fn, optimizer=sgd,
                                      layout=autopar.Layout(dp=world, allreduce=allreduce))
    ddp = DDP(copy.deepcopy(example.model))
    sides["DDP"] = common.eager_step(ddp, example.loss_fn, sgd(list(ddp.parameters())),
                                     lambda ids: ids.chunk(world)[rank])
    for step in sides.values():
        common.time_steps(step, example.batch, args.warmup)
    times = {name: [] for name in sides}
    sent = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, step in sides.items():
            dist.barrier()
            before = tx_bytes()
            times[name] += common.time_steps(step, example.batch, args.steps)
            dist.barrier()
            time.sleep(0.2)  # the counter settles
            sent[name].append((tx_bytes() - before) / args.steps)
    plan = autopar.plan(example.model, cluster, example.batch, example.loss_fn,
                        optimizer="sgd-momentum", tp=1, pp=1, zero=0, amp="off")
    if rank == 0:
        medians = {n: statistics.median(v) for n, v in times.items()}
        result = {"benchmark": "hierarchical_vs_ddp", "vocab": args.vocab, "world": world,
                  "rounds": args.rounds, "steps_per_round": args.steps,
                  "link": os.environ.get("AUTOPAR_BENCH_RATE", "unshaped"),
                  "median_step_s": medians,
                  "node0_link_bytes_per_step": {n: statistics.median(v) for n, v in sent.items()},
                  "ratio_hierarchical_over_ddp": medians["autopar hierarchical"] / medians["DDP"],
                  "ratio_hierarchical_over_flat":
                      medians["autopar hierarchical"] / medians["autopar flat"],
                  "planned": str(plan.layout), "torch": torch.__version__}
        print(json.dumps(result, indent=1), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
