"""Planning time of autopar.plan against model size and GPU count (docs/benchmarks.md).

GPT-2-shaped models from transformers on the meta device (nothing is allocated),
global batch 32 x 512 tokens, DGX-H100 nodes. Prints one Markdown row per case:
candidates, costed, traces and rewrites the search needed, seconds, chosen layout.

    python benchmarks/plan_time.py --cases 2x256:1 4x1024:1 4x1024:4

`--trillion` plans a 1-trillion-parameter GPT (128 layers, hidden 25,600, 200 heads,
vocabulary 51,200, global batch 1,536 x 2,048) on 384 DGX-H100 nodes (3,072 GPUs)
with `trace_blocks=2`, one case per name: "fixed" (tp=8, pp=16, microbatches=32, 1F1B,
bf16), "tp8-pp16-bf16" (the search with those three fixed), "full" (unconstrained).
Seconds are the `autopar.plan` call, every trace included; in brackets, building the
model on the meta device (transformers imported). Run each case in a fresh process
for cold figures:

    python benchmarks/plan_time.py --trillion fixed --memory-gb 10000
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import autopar
from autopar.examples import causal_lm_loss


def gpt(layers: int, hidden: int, vocab: int = 50257, batch: int = 32, seq: int = 512,
        dropout: float = 0.1):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(hidden // 64, 1),
                        vocab_size=vocab, n_positions=seq, use_cache=False,
                        attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)
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


TRILLION_CASES = {
    "fixed": dict(tp=8, pp=16, microbatches=32, schedule="1f1b", amp="bf16"),
    "tp8-pp16-bf16": dict(tp=8, pp=16, amp="bf16"),
    "tp8-pp64-bf16": dict(tp=8, pp=64, amp="bf16"),  # Megatron-LM's 1T layout (SC'21)
    "full": {},
}


def run_trillion(name: str, memory_gb: float | None, dropout: float = 0.1,
                 workers: int | None = None, fraction: float | None = None) -> str:
    start = time.perf_counter()
    model, batch = gpt(128, 25600, vocab=51200, batch=1536, seq=2048, dropout=dropout)
    built = time.perf_counter() - start
    cluster = autopar.ClusterSpec.preset("dgx-h100", nodes=384)
    if memory_gb is not None:
        data = cluster.to_dict()
        data["device"] = {**data["device"], "memory_bytes": int(memory_gb * 1e9)}
        cluster = autopar.ClusterSpec.from_dict(data)
    constraints = dict(TRILLION_CASES[name])
    if fraction is not None:
        constraints["max_memory_fraction"] = fraction
    start = time.perf_counter()
    fixed = ", ".join(f"{k}={v}" for k, v in constraints.items()) or "none"
    try:
        plan = autopar.plan(model, cluster, batch, causal_lm_loss, trace_blocks=2,
                            workers=workers, **constraints)
    except autopar.PlanError as exc:  # the error is the result: say how long it took
        return (f"| {fixed} | | | | | | {time.perf_counter() - start:.1f} ({built:.1f}) | "
                f"PlanError: {exc} | | | |")
    seconds = time.perf_counter() - start
    search = plan.details["search"]
    pred = plan.predicted
    return (f"| {fixed} | {search['candidates']} | {search['pruned']} / "
            f"{search['over_memory']} / {search['bounded']} / {search['floored']} / "
            f"{search['timed']} | "
            f"{search['costed']} | {search['traces']} | {search['rewrites']} | "
            f"{seconds:.1f} ({built:.1f}) | {plan.layout} | {pred.step_time_s:.1f} s | {pred.mfu:.1%} | "
            f"{pred.peak_memory_bytes / 1e9:.1f} GB |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", nargs="+", default=["2x256:1", "4x1024:1", "4x1024:4"],
                   help="LAYERSxHIDDEN:NODES")
    p.add_argument("--trillion", nargs="+", choices=sorted(TRILLION_CASES),
                   help="plan the 1T-parameter GPT on 3,072 GPUs instead (cases by name)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="device memory of the 1T cases (default: the preset's 80 GB)")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="GPT-2's dropout (attention, residual, embedding) of the 1T model: "
                        "0.1 is GPT-2's default; on GPUs the planner traces it as they run "
                        "it (inside the fused attention; 1-byte masks elsewhere)")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="max_memory_fraction of the 1T cases (default: autopar.plan's 0.9)")
    p.add_argument("--workers", type=int, default=None,
                   help="autopar.plan's workers (default: one on a machine with two CPUs or "
                        "more; 0: plan in this process alone)")
    args = p.parse_args()
    # the tensor-parallel rules probe strategies on fake tensors; their refusals are noise
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    if args.trillion:
        print("| constraints | candidates | not costed: memory / memory floor / bound / floor / "
              "time | costed | traces | rewrites | seconds (build) | chosen | predicted step | "
              "MFU | peak memory |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name in args.trillion:
            print(run_trillion(name, args.memory_gb, args.dropout, args.workers,
                               args.memory_fraction), flush=True)
        return
    print("| layers x hidden | parameters | GPUs | candidates | costed | traces | rewrites "
          "| seconds | chosen |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in args.cases:
        shape, nodes = case.split(":")
        layers, hidden = map(int, shape.split("x"))
        print(run(layers, hidden, int(nodes)), flush=True)


if __name__ == "__main__":
    main()
