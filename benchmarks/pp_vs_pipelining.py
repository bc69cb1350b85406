"""autopar pp=2 (1F1B, 4 micro-batches) against torch.distributed.pipelining, side by side.

Same GPT-2 (transformers; 4 layers, hidden 256, 8 heads, vocabulary 50,257), same
global batch (16 x 128 tokens), AdamW, same gloo process group of 2 processes, one
thread each. torch.distributed.pipelining: `pipeline()` split at the middle layer
(`transformer.h.2`), `Schedule1F1B` with 4 micro-batches. Rounds alternate; prints
the median step time of each and the ratio autopar / pipelining (target <= 0.95).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/pp_vs_pipelining.py --rounds 5 --steps 4
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

import autopar
import common  # benchmarks/common.py (the script's own folder is on sys.path)
from autopar.api import build_step
from autopar.compiler.ir.batch import Objective
from autopar.examples import causal_lm_loss
from autopar.compiler.ir.schedule import simulate

MICROBATCHES = 4


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


class Logits(torch.nn.Module):
    """pipelining passes tensors between stages: return the logits, not a ModelOutput."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


def pipelining_step_fn(model, batch, rank):
    ids = batch[0]
    micro = ids.chunk(MICROBATCHES)[0]
    middle = f"model.transformer.h.{model.config.n_layer // 2}"
    pipe = pipeline(Logits(model), mb_args=(micro,), split_spec={middle: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES,
                            loss_fn=lambda logits, target: causal_lm_loss(logits, target))
    opt = adamw(stage.submod.parameters())

    def step(ids):
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=[])
        opt.step()
    step.stage, step.opt = stage, opt  # for the memory count
    return step


def recv_buffers(stage) -> list:
    """The buffers a pipelining stage receives each micro-batch's activations and
    gradients into: made at its first step (one per micro-batch and input) and kept
    between steps, so they count with what it holds (PipelineStage's `args_recv_info`
    and `grad_recv_info` in the torch this benchmark pins). A stage that receives
    nothing (the first one's activations, the last one's gradients) has none there."""
    out = []
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        out += [info.buffer for info in infos if getattr(info, "buffer", None) is not None
                and not getattr(info, "is_root_arg", False)]
    if not out:
        raise RuntimeError("found no receive buffer on a stage of two: PipelineStage's "
                           "attributes changed in this torch; the peak would leave them out")
    return out


def measured_vs_simulated_bubble(step) -> dict:
    """Idle fraction of each rank over the last step's schedule: measured (compute
    spans from the step's start, sends and receives counted as idle), against the
    schedule simulated with each stage's measured mean F and B times. Collective."""
    spans, _ = step.last_timeline
    mine = {"busy": sum(end - begin for _, begin, end in spans), "end": spans[-1][2],
            "cost": {(a.stage, a.kind): [] for a, _, _ in spans}}
    for a, begin, end in spans:
        mine["cost"][(a.stage, a.kind)].append(end - begin)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    cost = {key: statistics.mean(v) for r in everyone for key, v in r["cost"].items()}
    timeline = simulate(step.program.schedule, cost)
    makespan = max(r["end"] for r in everyone)
    return [{"rank": rank, "measured": round(1 - r["busy"] / makespan, 3),
             "simulated": round(timeline.bubble_fraction(rank), 3)}
            for rank, r in enumerate(everyone)]




def main() -> None:
    parser = common.parser(__doc__.splitlines()[0], steps=4)
    parser.add_argument("--cut", default=None,
                        help="autopar's stage cut, as a module path (transformer.h.2: the "
                             "peer's middle cut on 4 blocks); default: assign_stages's own")
    parser.add_argument("--memory-budget", type=float, default=None,
                        help="bytes each stage's cut must fit (PassOptions.memory_budget); "
                             "default: the device's memory")
    args = parser.parse_args()
    rank, _, example = common.start(args)
    batch = example.batch
    start = time.perf_counter()
    layout = autopar.Layout(pp=2, microbatches=MICROBATCHES, schedule="1f1b")
    if args.cut is None and args.memory_budget is None:
        ours = autopar.compile(copy.deepcopy(example.model), None, batch, example.loss_fn,
                               optimizer=adamw, layout=layout)
    else:
        objective, flat = Objective.from_example(batch, None, example.loss_fn)
        options = {"pipeline_cuts": [args.cut]} if args.cut else {}
        if args.memory_budget is not None:
            options["memory_budget"] = int(args.memory_budget)
        ours = build_step(copy.deepcopy(example.model), None, flat, objective, adamw, layout,
                          pass_options=options)
    compile_s = time.perf_counter() - start
    theirs = pipelining_step_fn(copy.deepcopy(example.model), batch, rank)
    medians = common.alternate({"autopar": ours, "pipelining": theirs}, batch, args.rounds,
                               args.steps, args.warmup)
    bubble = measured_vs_simulated_bubble(ours)
    theirs.opt.zero_grad(set_to_none=True)
    peaks = {"autopar": common.autopar_peak(ours, batch),
             "pipelining": common.peak_bytes(theirs, batch, [
                 *theirs.stage.submod.parameters(), *theirs.stage.submod.buffers(),
                 *recv_buffers(theirs.stage), *common.optimizer_state(theirs.opt)])}
    every = [None] * dist.get_world_size()  # each stage holds its own: compare per rank
    dist.all_gather_object(every, peaks)
    if rank == 0:
        common.report(args, {
            "benchmark": "pp_vs_pipelining", "model": args.model, "cut": args.cut,
            "memory_budget": args.memory_budget,
            "shape": common.shape_overrides(args),
            "microbatches": MICROBATCHES, "rounds": args.rounds,
            "steps_per_round": args.steps, "median_step_s": medians,
            "ratio": medians["autopar"] / medians["pipelining"],
            "autopar_compile_s": compile_s,
            "bubble_per_rank_measured_vs_simulated": bubble,
            "bubble_1f1b_equal_stages": (2 - 1) / (MICROBATCHES + 2 - 1),
            "first_block_of_stage": {r.name: r.stats for r in ours.pass_results}[
                "assign_stages"]["first_block_of_stage"],
            "weighed_stage_bytes": {r.name: r.stats for r in ours.pass_results}[
                "assign_stages"].get("weighed_stage_bytes"),
            "peak_bytes_per_rank": every,
            # the peak of the busiest rank on each side
            "peak_ratio": max(p["autopar"]["peak"] for p in every)
            / max(p["pipelining"]["peak"] for p in every)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
