"""autopar tp=2 on GPT-2 with its fused q/k/v projection split in pieces, against the
plan without that placement, side by side.

GPT-2's `c_attn` is a `Conv1D` to 3 x hidden, cut by `split` into q, k and v. With
the pieces placement (`S(1)x3`, docs/tensor_parallel.md) each rank holds its block of
q, k and v, and attention runs by heads; without it the solver splits the projection
plainly and gathers its output every layer, or keeps attention whole. The second
side is the same compile with `tp_rules.strided_demand` answering nothing: the plan
the solver makes when no value may take pieces. torch.distributed.tensor has no peer
here: its ColwiseParallel takes `nn.Linear` and `nn.Embedding`, not `Conv1D`, and a
plain column split of a fused projection is wrong under `split`.

Same model, batch and AdamW on both sides, 2 gloo processes with one thread each,
rounds alternating. Prints each side's median step time, the ratio pieces / plain,
each side's collectives per step and its c_attn placement.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/tp_pieces.py --rounds 5 --steps 3 --hidden 256 --vocab 4096
"""

from __future__ import annotations

from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist

import autopar
import common  # benchmarks/common.py (the script's own folder is on sys.path)
from autopar.compiler.passes import tp_solver


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def collectives(step) -> dict[str, int]:
    """The tp collectives of the step's program, by kind."""
    names = Counter(n.target._opname for n in step.train_graph.call_nodes()
                    if getattr(n.target, "namespace", "") == "_c10d_functional"
                    and n.target._opname != "wait_tensor")
    return dict(sorted(names.items()))


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0], steps=3)
    args = parser.parse_args()
    rank, world, example = common.start(args)
    layout = autopar.Layout(tp=world)
    pieces, _ = common.compile_timed(example, layout, adamw)
    with mock.patch.object(tp_solver, "strided_demand", lambda graph, tp: {}):
        plain, _ = common.compile_timed(example, layout, adamw)
    medians = common.alternate({"pieces": pieces, "plain": plain}, example.batch, args.rounds,
                               args.steps, args.warmup)
    placed = {name: s.train_graph.attrs["tp"]["params"]["transformer.h.0.attn.c_attn.weight"]
              for name, s in (("pieces", pieces), ("plain", plain))}
    if rank == 0:
        common.report(args, {
            "benchmark": "tp_pieces", "model": args.model, "world": world,
            "shape": common.shape_overrides(args),
            "rounds": args.rounds, "steps_per_round": args.steps,
            "median_step_s": medians,
            "ratio": medians["pieces"] / medians["plain"],
            "collectives": {"pieces": collectives(pieces), "plain": collectives(plain)},
            "c_attn_weight": placed,
            "torch": torch.__version__})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
