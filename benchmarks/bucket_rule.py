"""Pass-level research: a bucketing rule of our own, predicted and measured against
the default (docs/planner.md, "Scoring your own pass").

`BucketPerBlock` sizes the data-parallel gradient buckets to one repeated block's
gradients (the default is a fixed Layout.bucket_mb, 25 MiB): each block's
all-reduce starts as soon as that block's backward is done. The script prints
`autopar.estimate` of both pipelines on the given cluster spec, then (under
torchrun) measures both, alternating rounds.

    python benchmarks/bucket_rule.py --predict-only --cluster local.yaml
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bucket_rule.py \\
        --cluster local.yaml --rounds 4 --steps 3
"""

from __future__ import annotations

import dataclasses

import torch

import autopar
from autopar.compiler.ir import meta as M
from autopar.compiler.passes.insert_allreduce import InsertAllReduce

MIB = 2**20


class BucketPerBlock(autopar.GraphPass):
    """InsertAllReduce with bucket_mb = the largest repeated block's gradient bytes."""

    name = "bucket_per_block"
    requires = frozenset({"traced"})
    provides = frozenset({"dp_grad_sync"})

    def run(self, tg, ctx):
        per_block: dict[int, int] = {}
        for spec, node in zip(tg.signature.params, tg.placeholders()):
            layers = {u.meta.get(M.LAYER) for u in node.users} - {None}
            if len(layers) == 1:
                layer = layers.pop()
                per_block[layer] = per_block.get(layer, 0) + spec.nbytes
        if not per_block:
            return tg, autopar.PassResult(self.name, changed=False,
                                          declined=[("per-block buckets", "no repeated blocks")])
        layout = ctx.layout.replace(bucket_mb=max(per_block.values()) / MIB)
        new, result = InsertAllReduce().run(tg, dataclasses.replace(ctx, layout=layout))
        return new, dataclasses.replace(result, name=self.name,
                                        stats={**result.stats, "bucket_mb": layout.bucket_mb})


def pipelines(layout: autopar.Layout) -> dict[str, list]:
    return {"default (25 MiB)": autopar.default_passes(layout), "per block": [BucketPerBlock()]}


def predict(model_name: str, cluster: autopar.ClusterSpec) -> dict[str, float]:
    from autopar.examples import load_model_spec

    layout = autopar.Layout(dp=2)
    with torch.device("meta"):
        ex = load_model_spec(model_name)
    return {name: autopar.estimate(ex.model, cluster, layout, ex.batch, ex.loss_fn,
                                   passes=passes).step_time_s
            for name, passes in pipelines(layout).items()}


def main() -> None:
    from benchmarks.common import alternate, parser

    p = parser("per-block gradient buckets vs the default", steps=3)
    p.add_argument("--cluster", default=None, help="ClusterSpec YAML (autopar calibrate)")
    p.add_argument("--predict-only", action="store_true")
    args = p.parse_args()
    cluster = (autopar.ClusterSpec.from_yaml(args.cluster) if args.cluster
               else autopar.ClusterSpec.local(nprocs=2))
    cluster = autopar.ClusterSpec.from_dict({**cluster.to_dict(), "devices_per_node": 2})
    predicted = predict(args.model, cluster)
    if args.predict_only:
        print({k: round(v, 4) for k, v in predicted.items()})
        return
    from autopar.examples import load_model_spec

    torch.set_num_threads(1)
    layout = autopar.Layout(dp=2)
    sides = {}
    for name, passes in pipelines(layout).items():
        ex = load_model_spec(args.model)
        sides[name] = autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=layout,
                                      passes=passes)
    measured = alternate(sides, ex.batch, args.rounds, args.steps, args.warmup)
    if torch.distributed.get_rank() == 0:
        for name in sides:
            print(f"{name}: predicted {predicted[name]:.4f} s, measured {measured[name]:.4f} s")


if __name__ == "__main__":
    main()
