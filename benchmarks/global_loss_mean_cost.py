"""What the global loss mean costs a step: autopar dp=2 with and without the
`global_loss_mean` pass, and DDP, side by side on a padded causal-LM batch.

The batch's rows are right-padded to different lengths with labels -100 on the padding,
so the two ranks hold different numbers of real tokens: with the pass autopar trains as
one process on the whole batch; without it (and with DDP) each rank's mean counts its
own tokens. Same model, AdamW, one gloo process group, one thread per process; rounds
alternate between the three sides, in an order rotated every round (common.rotated).
Prints the median step time of each and the ratios, and how far each side's first loss
is from the single-process loss.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/global_loss_mean_cost.py --rounds 5 --steps 3 --model llama-small4
"""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
import common  # benchmarks/common.py (the script's own folder is on sys.path)
from autopar.examples import load_model_spec


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def padded_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels of the ids with -100 on a suffix of a different length per row (up to
    three quarters of it)."""
    labels = ids.clone()
    rows, seq = ids.shape
    for r in range(rows):
        labels[r, seq - (r * 3 * seq // (4 * rows)):] = -100
    return labels


def loss_fn(out, labels):
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten())


def main() -> None:
    args = common.parser(__doc__.splitlines()[0], steps=3).parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    example = load_model_spec(args.model)
    ids = example.batch[0]
    batch = (ids, padded_labels(ids))
    layout = autopar.Layout(dp=world)

    def compiled(passes):
        return autopar.compile(copy.deepcopy(example.model), None, example_inputs=(ids,),
                               example_targets=(batch[1],), loss_fn=loss_fn,
                               optimizer=adamw, layout=layout, passes=passes)

    reference = loss_fn(example.model(ids), batch[1]).item()
    medians, first = common.pass_cost(compiled, "global_loss_mean", layout, example.model, adamw, loss_fn,
                                      batch, args)
    if rank == 0:
        print(json.dumps({
            "model": args.model, "rounds": args.rounds, "steps": args.steps,
            "median_step_s": medians,
            "ratio_with_over_without": medians["with_pass"] / medians["without_pass"],
            "ratio_with_over_ddp": medians["with_pass"] / medians["ddp"],
            "first_loss_rel_err_vs_one_process": {
                k: abs(v - reference) / abs(reference) for k, v in first.items()},
        }, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
