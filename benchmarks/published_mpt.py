"""The cost model against a second published source: MosaicML llm-foundry's MPT
throughput table on H100 80GB (bf16, FSDP FULL_SHARD, no gradient accumulation, no
activation checkpointing, sequence 2048). The figures and their source are in
benchmarks/data/llm_foundry_mpt_h100_bf16.json; docs/published_results.md has the results.

Each row is transformers' `MptForCausalLM` of the row's shape on the meta device
(nothing is allocated), costed with `autopar.estimate` (the default per-block tracing)
on `ClusterSpec.preset("dgx-h100", nodes=GPUs/8)` under the published layout:
`Layout(dp=GPUs, zero=3, amp="bf16")`, the global batch of the row. The prediction is
compared in tokens per second per GPU, the table's own measure.

    python benchmarks/published_mpt.py
    python benchmarks/published_mpt.py --plan     # also plan each row with the defaults
    python benchmarks/published_mpt.py --cluster benchmarks/data/h100_calibrated.yaml
                                       # a calibrated H100 (autopar calibrate) for the preset
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

DATA = json.loads((Path(__file__).parent / "data" / "llm_foundry_mpt_h100_bf16.json").read_text())


def mpt(row: dict):
    """The row's MPT on the meta device, and one global batch of token ids."""
    from transformers import MptConfig, MptForCausalLM

    config = MptConfig(**DATA["shapes"][row["model"]], expansion_ratio=4,
                       max_seq_len=row["seq"], vocab_size=DATA["vocabulary"], no_bias=False,
                       use_cache=False)
    with torch.device("meta"):
        return MptForCausalLM(config), (torch.empty((row["global_batch"], row["seq"]),
                                                    dtype=torch.long, device="meta"),)


def published_layout(row: dict) -> autopar.Layout:
    return autopar.Layout(dp=row["gpus"], zero=3, amp="bf16")


def tokens_per_gpu(row: dict, step_s: float) -> float:
    return row["global_batch"] * row["seq"] / step_s / row["gpus"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="store_true",
                   help="also plan each row with autopar.plan's defaults (bf16 fixed)")
    p.add_argument("--cluster", default=None, metavar="YAML",
                   help="a ClusterSpec of 8-GPU nodes (autopar calibrate's) for dgx-h100")
    args = p.parse_args()
    base = autopar.ClusterSpec.from_yaml(args.cluster) if args.cluster else None
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    print("| model | GPUs | batch | published tokens/s/GPU | predicted | error | MFU "
          "predicted | estimate s" + (" | plan s | chosen | chosen tokens/s/GPU" if args.plan
                                      else "") + " |")
    print("|---|---|---|---|---|---|---|---" + ("|---|---|---" if args.plan else "") + "|")
    errors = []
    for row in DATA["rows"]:
        model, batch = mpt(row)
        cluster = (autopar.ClusterSpec.preset("dgx-h100", nodes=row["gpus"] // 8) if base is None
                   else autopar.ClusterSpec.from_dict({**base.to_dict(),
                                                       "nodes": row["gpus"] // 8}))
        start = time.perf_counter()
        pred = autopar.estimate(model, cluster, published_layout(row), batch, causal_lm_loss)
        seconds = time.perf_counter() - start
        rate = tokens_per_gpu(row, pred.step_time_s)
        error = rate / row["tokens_per_s_per_gpu"] - 1
        errors.append(error)
        line = (f"| {row['model']} | {row['gpus']} | {row['global_batch']} | "
                f"{row['tokens_per_s_per_gpu']} | {rate:.0f} | {error:+.1%} | {pred.mfu:.1%} | "
                f"{seconds:.1f}")
        if args.plan:
            start = time.perf_counter()
            plan = autopar.plan(model, cluster, batch, causal_lm_loss, amp="bf16")
            line += (f" | {time.perf_counter() - start:.1f} | {plan.layout} | "
                     f"{tokens_per_gpu(row, plan.predicted.step_time_s):.0f}")
        print(line + " |", flush=True)
    print(f"median error {statistics.median(errors):+.1%}, median |error| "
          f"{statistics.median(abs(e) for e in errors):.1%}, worst |error| "
          f"{max(abs(e) for e in errors):.1%} over {len(errors)} rows")


if __name__ == "__main__":
    main()
