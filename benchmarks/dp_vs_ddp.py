"""autopar dp=2 against torch.nn.parallel.DistributedDataParallel, side by side.

Same GPT-2 (transformers; 4 layers, hidden 256, 8 heads, vocab 50257), same global
batch (16 x 128 tokens), AdamW, same gloo process group, one thread per process.
Rounds alternate between the two so machine noise hits both alike; each round
times `--steps` steps after the warm-up. Prints the median step time of each and
the ratio autopar / DDP (target <= 1.0), and each side's peak bytes of a step on
rank 0, counted the same way (`common.peak_bytes`; target <= DDP's).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/dp_vs_ddp.py --rounds 5 --steps 5
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import autopar
import common  # benchmarks/common.py (the script's own folder is on sys.path)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def ddp_step_fn(model, loss_fn, rank, world, bucket_mb):
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    opt = adamw([p for p in ddp.parameters() if p.requires_grad])
    return common.eager_step(ddp, loss_fn, opt, lambda ids: ids.chunk(world)[rank]), ddp, opt


def ddp_bucket_bytes(ddp) -> int:
    """Bytes of the gradient buckets DDP's reducer allocated (in C++, once: no tensor
    of the model reaches them)."""
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    return sum(int(s) for s in str(sizes).split(",") if s.strip())


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0], steps=5)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    rank, world, example = common.start(args)
    batch = example.batch
    ours, compile_s = common.compile_timed(
        example, autopar.Layout(dp=world, bucket_mb=args.bucket_mb), adamw)
    theirs, ddp, ddp_opt = ddp_step_fn(copy.deepcopy(example.model), example.loss_fn, rank,
                                       world, args.bucket_mb)
    medians = common.alternate({"autopar": ours, "ddp": theirs}, batch, args.rounds,
                               args.steps, args.warmup)
    ddp_opt.zero_grad(set_to_none=True)
    peaks = {"autopar": common.autopar_peak(ours, batch),
             "ddp": common.peak_bytes(theirs, batch,
                                      [*ddp.parameters(), *common.optimizer_state(ddp_opt)],
                                      extra_bytes=ddp_bucket_bytes(ddp))}
    if rank == 0:
        common.report(args, {
            "benchmark": "dp_vs_ddp", "model": args.model, "world": world,
            "shape": common.shape_overrides(args), "bucket_mb": args.bucket_mb,
            "rounds": args.rounds, "steps_per_round": args.steps,
            "median_step_s": medians, "ratio": medians["autopar"] / medians["ddp"],
            "peak_bytes_rank0": peaks,
            "peak_ratio": peaks["autopar"]["peak"] / peaks["ddp"]["peak"],
            "autopar_compile_s": compile_s, "torch": torch.__version__})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
