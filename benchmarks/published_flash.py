"""The cost model against a third published source, one that measures the attention
kernel itself: FlashAttention-2's end-to-end table (GPT3-1.3B and GPT3-2.7B at 2k and
8k context on 8 A100 80GB, with and without FlashAttention). The figures, the paper's
FLOP formula and the run configuration are in benchmarks/data/flashattention2_table1.json,
with what of them was confirmed; docs/published_results.md has the results.

Each row is transformers' `GPT2LMHeadModel` of the row's shape (its defaults: dropout
0.1, sdpa attention) on the meta device, costed by `autopar.estimate` (the default
per-block tracing) on one `dgx-a100-80gb` node under the published run: data parallel
over the 8 GPUs with ZeRO-1, bf16, gradient accumulation to the global batch from the
configured micro-batch. Twice: with `DeviceSpec.attention="fused"` (the cluster's fused
kernel, against the FlashAttention-2 and FlashAttention columns) and `"unfused"` (the
scores materialised, against the column without it, at the baseline's micro-batch).
The predicted throughput uses the paper's formula over the predicted step time.

    python benchmarks/published_flash.py
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

import autopar
from autopar.examples import causal_lm_loss

DATA = json.loads((Path(__file__).parent / "data" / "flashattention2_table1.json").read_text())
GPUS = 8
OPTIMIZER = "adamw-fused"  # the repo's configs step a fused (apex) AdamW


def gpt(row: dict):
    """The row's GPT on the meta device, and one global batch of token ids."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=row["layers"], n_embd=row["hidden"], n_head=row["heads"],
                        vocab_size=DATA["vocabulary"], n_positions=row["seq"], use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(config), (torch.empty((row["global_batch"], row["seq"]),
                                                     dtype=torch.long, device="meta"),)


def published_layout(row: dict, micro_batch: int) -> autopar.Layout:
    """Data parallel over the node, ZeRO-1, bf16, accumulating to the global batch."""
    return autopar.Layout(dp=GPUS, zero=1, amp="bf16",
                          microbatches=row["global_batch"] // (GPUS * micro_batch))


def paper_flops(row: dict, params: int) -> float:
    """The paper's FLOPs of one step: per sequence 6 s N + 12 L h s^2."""
    s = row["seq"]
    return row["global_batch"] * (6 * s * params + 12 * row["layers"] * row["hidden"] * s * s)


def cluster(attention: str) -> autopar.ClusterSpec:
    c = autopar.ClusterSpec.preset("dgx-a100-80gb", nodes=1)
    return c.model_copy(update={"device": c.device.model_copy(update={"attention": attention})})


def predict(row: dict, attention: str) -> tuple[autopar.Layout, float, float]:
    """(layout, predicted paper-TFLOP/s per GPU, seconds the estimate took)."""
    model, batch = gpt(row)
    micro = row["micro_batch"] if attention == "fused" else (row["micro_batch_without_flash"]
                                                             or 1)
    layout = published_layout(row, micro)
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    pred = autopar.estimate(model, cluster(attention), layout, batch, causal_lm_loss,
                            optimizer=OPTIMIZER)
    return layout, paper_flops(row, params) / pred.step_time_s / GPUS / 1e12, \
        time.perf_counter() - start


def main() -> None:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    print("| model | context | kernels | layout | published TFLOP/s/GPU | predicted | error | "
          "estimate s |")
    print("|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {"flash2": [], "flash": [], "without_flash": []}
    for row in DATA["rows"]:
        for attention, columns in (("fused", ("flash2", "flash")),
                                   ("unfused", ("without_flash",))):
            layout, rate, seconds = predict(row, attention)
            for column in columns:
                published = row["tflops"][column]
                errors[column].append(rate / published - 1)
                print(f"| {row['model']} | {row['seq'] // 1024}k | {attention} against "
                      f"{DATA['columns'][column]} | dp={layout.dp} ZeRO-1 "
                      f"m={layout.microbatches} | {published} | {rate:.1f} | "
                      f"{errors[column][-1]:+.1%} | {seconds:.1f} |", flush=True)
    for column, errs in errors.items():
        print(f"{DATA['columns'][column]}: median error {statistics.median(errs):+.1%}, "
              f"median |error| {statistics.median(abs(e) for e in errs):.1%}, worst |error| "
              f"{max(abs(e) for e in errs):.1%} over {len(errs)} rows")


if __name__ == "__main__":
    main()
