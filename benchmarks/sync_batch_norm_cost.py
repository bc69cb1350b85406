"""What the whole batch's statistics cost a step with batch norms: autopar dp=2 with and
without the `sync_batch_norm` pass, and DDP, side by side on transformers' ResNet.

PyTorch's own answer, `nn.SyncBatchNorm`, refuses CPU tensors ("expected input tensor
to be on GPU"), so on gloo the peer is DDP with the model's BatchNorm2d as it is: each
rank normalises by its shard's statistics, as autopar without the pass does. The JSON
gives each side's median step, the ratios, and how far each side's first loss is from
one process's on the whole batch (the pass's point: 0 up to rounding). Same model and
batch, SGD with momentum, one gloo process group, one thread per process; rounds
alternate between the three sides, in an order rotated every round.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/sync_batch_norm_cost.py --rounds 5 --steps 3 --shape small
"""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist

import autopar
import common  # benchmarks/common.py (the script's own folder is on sys.path)

# (hidden sizes, depths, image side, batch): ResNet-18-like stages, scaled to a CPU
SHAPES = {
    "small": ([16, 32, 64], [1, 1, 1], 32, 16),
    "wide": ([32, 64, 128, 256], [2, 2, 2, 2], 64, 16),
}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def resnet(shape: str):
    from transformers import ResNetConfig, ResNetForImageClassification

    hidden, depths, side, batch = SHAPES[shape]
    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=hidden[0], hidden_sizes=hidden,
                          depths=depths, num_labels=10, layer_type="basic")
    pixels = torch.randn(batch, 3, side, side)
    labels = torch.randint(0, 10, (batch,))
    return ResNetForImageClassification(config), pixels, labels


def loss_fn(out, labels):
    return torch.nn.functional.cross_entropy(out.logits, labels)


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], steps=3)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, pixels, labels = resnet(args.shape)
    batch = (pixels, labels)
    layout = autopar.Layout(dp=world)

    def compiled(passes):
        return autopar.compile(copy.deepcopy(model), None, example_inputs=(pixels,),
                               example_targets=(labels,), loss_fn=loss_fn, optimizer=sgd,
                               layout=layout, passes=passes)

    reference = loss_fn(copy.deepcopy(model)(pixels), labels).item()
    medians, first = common.pass_cost(compiled, "sync_batch_norm", layout, model, sgd, loss_fn,
                                      batch, args)
    if rank == 0:
        result = {
            "shape": args.shape, "hidden_sizes": SHAPES[args.shape][0],
            "depths": SHAPES[args.shape][1], "image": SHAPES[args.shape][2],
            "batch": SHAPES[args.shape][3], "rounds": args.rounds, "steps": args.steps,
            "median_step_s": medians,
            "ratio_with_over_without": medians["with_pass"] / medians["without_pass"],
            "ratio_with_over_ddp": medians["with_pass"] / medians["ddp"],
            "first_loss_rel_err_vs_one_process": {
                k: abs(v - reference) / abs(reference) for k, v in first.items()},
        }
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
