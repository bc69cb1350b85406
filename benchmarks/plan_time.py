"""Planning time of autopar.plan against model size and GPU count (docs/benchmarks.md).

GPT-2-shaped models from transformers on the meta device (nothing is allocated),
global batch 32 x 512 tokens, DGX-H100 nodes. Prints one Markdown row per case:
candidates, costed, traces and rewrites the search needed, seconds, chosen layout.

    python benchmarks/plan_time.py --cases 2x256:1 4x1024:1 4x1024:4
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import autopar
from autopar.examples import causal_lm_loss


def gpt(layers: int, hidden: int, vocab: int = 50257, batch: int = 32, seq: int = 512):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(hidden // 64, 1),
                        vocab_size=vocab, n_positions=seq, use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(config), (torch.randint(0, vocab, (batch, seq)),)


def run(layers: int, hidden: int, nodes: int) -> str:
    model, batch = gpt(layers, hidden)
    params = sum(p.numel() for p in model.parameters())
    cluster = autopar.ClusterSpec.preset("dgx-h100", nodes=nodes)
    start = time.perf_counter()
    plan = autopar.plan(model, cluster, batch, causal_lm_loss)
    seconds = time.perf_counter() - start
    search = plan.details["search"]
    return (f"| {layers} x {hidden} | {params / 1e6:.0f} M | {cluster.world_size} | "
            f"{search['candidates']} | {len(plan.alternatives) + 1} | {search['traces']} | "
            f"{search['rewrites']} | {seconds:.1f} | {plan.layout} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", nargs="+", default=["2x256:1", "4x1024:1", "4x1024:4"],
                   help="LAYERSxHIDDEN:NODES")
    args = p.parse_args()
    # the tensor-parallel rules probe strategies on fake tensors; their refusals are noise
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    print("| layers x hidden | parameters | GPUs | candidates | costed | traces | rewrites "
          "| seconds | chosen |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        shape, nodes = case.split(":")
        layers, hidden = map(int, shape.split("x"))
        print(run(layers, hidden, int(nodes)), flush=True)


if __name__ == "__main__":
    main()
