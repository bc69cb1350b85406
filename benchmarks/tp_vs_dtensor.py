"""autopar tp=2 against torch.distributed.tensor.parallel (DTensor), side by side.

Same Llama (transformers; 4 layers, hidden 256, 8 heads, 4 key/value heads, vocab
32000), same batch (16 x 128 tokens) on both tensor-parallel ranks, AdamW, same gloo
process group, one thread per process. DTensor gets the standard plan:
ColwiseParallel on q/k/v/gate/up and RowwiseParallel on o/down in every layer
(embedding and head replicated); autopar gets Layout(tp=2) and its solver's plan.
`--model neox-small4`: GPT-NeoX with eager attention (same sizes), DTensor's plan
ColwiseParallel on query_key_value/dense_h_to_4h, RowwiseParallel on
dense/dense_4h_to_h.
Rounds alternate between the two. Prints the median step time of each, the ratio
autopar / DTensor (target <= 0.9), and the parameter + optimizer-state elements one
rank holds against the unsharded model's (target <= 0.55).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/tp_vs_dtensor.py --rounds 5 --steps 3 [--model neox-small4]
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import autopar
import common  # benchmarks/common.py (the script's own folder is on sys.path)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def dtensor_step_fn(model, loss_fn, world):
    mesh = init_device_mesh("cpu", (world,))
    if hasattr(model, "gpt_neox"):  # per-head fused q/k/v: column-parallel as it is
        layers = model.gpt_neox.layers
        column = ("attention.query_key_value", "mlp.dense_h_to_4h")
        row = ("attention.dense", "mlp.dense_4h_to_h")
    else:
        layers = model.model.layers
        column = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                  "mlp.up_proj")
        row = ("self_attn.o_proj", "mlp.down_proj")
    for layer in layers:
        plan = {name: ColwiseParallel() for name in column}
        plan.update({name: RowwiseParallel() for name in row})
        parallelize_module(layer, mesh, plan)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    return common.eager_step(model, loss_fn, opt), model, opt


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0], steps=3)
    parser.set_defaults(model="llama-small4")
    args = parser.parse_args()
    rank, world, example = common.start(args)
    batch = example.batch
    ours, compile_s = common.compile_timed(example, autopar.Layout(tp=world), adamw)
    theirs, dt_model, dt_opt = dtensor_step_fn(copy.deepcopy(example.model), example.loss_fn, world)
    medians = common.alternate({"autopar": ours, "dtensor": theirs}, batch, args.rounds,
                               args.steps, args.warmup)
    whole = sum(p.numel() for p in example.model.parameters())
    ours_held = common.held(ours.params) + common.held(common.optimizer_state(ours.optimizer))
    theirs_held = common.held(dt_model.parameters()) + common.held(common.optimizer_state(dt_opt))
    dt_opt.zero_grad(set_to_none=True)
    peaks = {"autopar": common.autopar_peak(ours, batch),
             "dtensor": common.peak_bytes(theirs, batch, [
                 *dt_model.parameters(), *dt_model.buffers(), *common.optimizer_state(dt_opt)])}
    if rank == 0:
        common.report(args, {
            "benchmark": "tp_vs_dtensor", "model": args.model, "world": world,
            "shape": common.shape_overrides(args),
            "rounds": args.rounds, "steps_per_round": args.steps,
            "median_step_s": medians,
            "ratio": medians["autopar"] / medians["dtensor"],
            "params_and_adam_state_per_rank_over_unsharded": {
                "autopar": ours_held / (3 * whole), "dtensor": theirs_held / (3 * whole)},
            "peak_bytes_rank0": peaks,
            "peak_ratio": peaks["autopar"]["peak"] / peaks["dtensor"]["peak"],
            "autopar_compile_s": compile_s,
            "autopar_params": ours.pass_results[0].stats["params"],
            "torch": torch.__version__})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
