"""autopar zero=3 (dp=2) against FSDP2 (`fully_shard` per transformer block), side by side.

Same GPT-2 (transformers; 4 layers, hidden 256, 8 heads, vocabulary 50,257, tied
embeddings), same global batch (16 x 128 tokens, each rank its half), AdamW, same
gloo process group, one thread per process. FSDP2: `fully_shard` on every block and
on the root. Rounds alternate between the two. Prints the median step time of each
and the ratio autopar / FSDP2 (target <= 1.0), the bytes each rank holds between
steps (parameters, gradients and optimizer state), and the peak of a step: those plus
the most storage the step had alive at once (target <= FSDP2's).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/zero3_vs_fsdp2.py --rounds 5 --steps 3

`--model zero3_vs_fsdp2:gradient_heavy --bucket-mb 1` runs a model whose gradients
outweigh its activations (8 blocks of hidden 256, vocabulary 256, 4 x 32 tokens), in
autopar's buckets of 1 MiB: where the peak is the gradient buckets a ZeRO step holds.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import autopar
from autopar.examples import Example, gpt2
import common  # benchmarks/common.py (the script's own folder is on sys.path)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def fsdp2_step_fn(model, loss_fn, rank, world):
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    return common.eager_step(model, loss_fn, opt, lambda ids: ids.chunk(world)[rank]), model, opt


def fsdp2_unsharded(model) -> list:
    """The tensors whose storage FSDP2 allocates for each unsharded parameter before its
    module runs and frees after it (`UntypedStorage.resize_`, which no op reports):
    each parameter's all-gather outputs and unsharded inner tensors (FSDPParam's
    attributes in the torch this benchmark pins)."""
    out = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", lambda: None)()
        group = getattr(state, "_fsdp_param_group", None)
        for param in (group.fsdp_params if group is not None else ()):
            out += [*param.all_gather_outputs, *param._unsharded_inner_tensors]
    if not out:
        raise RuntimeError("found no FSDP2 parameter storage: FSDPParam's attributes "
                           "changed in this torch; the peak would leave them out")
    return out


def held_bytes(tensors) -> int:
    return common.held(tensors, nbytes=True)


def state_bytes(opt) -> int:
    return held_bytes(common.optimizer_state(opt))


def gradient_heavy() -> Example:
    """GPT-2 of 8 blocks, hidden 256, vocabulary 256, 4 x 32 tokens: 25 MB of fp32
    gradients against well under 1 MB of activations."""
    return gpt2(layers=8, hidden=256, heads=8, vocab=256, batch=4, seq=32)


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0], steps=3)
    parser.add_argument("--bucket-mb", type=float, default=autopar.Layout().bucket_mb,
                        help="autopar's gradient bucket size (Layout.bucket_mb)")
    args = parser.parse_args()
    rank, world, example = common.start(args)
    batch = example.batch
    ours, compile_s = common.compile_timed(
        example, autopar.Layout(dp=world, zero=3, bucket_mb=args.bucket_mb), adamw)
    theirs, fsdp_model, fsdp_opt = fsdp2_step_fn(copy.deepcopy(example.model), example.loss_fn,
                                                 rank, world)
    medians = common.alternate({"autopar": ours, "fsdp2": theirs}, batch, args.rounds,
                               args.steps, args.warmup)
    # between steps: autopar holds its parameter blocks (+ whole parameters it could not
    # split) and AdamW's state of its blocks; gradients are dropped after each step.
    # FSDP2 holds its sharded parameters, their sharded gradients (zero_grad comes before
    # the next backward) and AdamW's state.
    ours_bytes = {"params": held_bytes(ours.graph_params) + held_bytes(
                      u for u, g in zip(ours.updated, ours.graph_params) if u is not g),
                  "grads": 0, "optimizer": state_bytes(ours.optimizer)}
    fsdp_params = [p for p in fsdp_model.parameters()]
    theirs_bytes = {"params": held_bytes(fsdp_params),
                    "grads": held_bytes(p.grad for p in fsdp_params if p.grad is not None),
                    "optimizer": state_bytes(fsdp_opt)}
    # the peak of a step: what is held before it plus the most storage the step itself
    # had alive at once. FSDP2's old gradients are dropped (zero_grad) before its
    # backward, so they are released first and the new ones counted as the step makes them
    fsdp_opt.zero_grad(set_to_none=True)
    peaks = {"autopar": common.autopar_peak(ours, batch),
             "fsdp2": common.peak_bytes(theirs, batch, [
                 *fsdp_params, *fsdp_model.buffers(), *common.optimizer_state(fsdp_opt)],
                 resizable=fsdp2_unsharded(fsdp_model))}
    if rank == 0:
        common.report(args, {
            "benchmark": "zero3_vs_fsdp2", "model": args.model, "world": world,
            "shape": common.shape_overrides(args), "bucket_mb": args.bucket_mb,
            "rounds": args.rounds, "steps_per_round": args.steps,
            "median_step_s": medians,
            "ratio": medians["autopar"] / medians["fsdp2"],
            "bytes_held_between_steps_rank0": {"autopar": ours_bytes, "fsdp2": theirs_bytes},
            "peak_bytes_rank0": peaks,
            "peak_ratio": peaks["autopar"]["peak"] / peaks["fsdp2"]["peak"],
            "autopar_compile_s": compile_s, "torch": torch.__version__})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
