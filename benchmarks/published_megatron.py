"""The cost model against published throughputs: Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21,
arXiv 2104.04473), Table 1 (docs/published_results.md has the results and caveats).

Each row is a GPT of the paper's shape (transformers' GPT-2, or with `--arch neox`
GPT-NeoX, on the meta device: nothing is allocated) on DGX A100 80GB nodes (`dgx-a100-80gb`), under the paper's
tp and pp, fp16 AMP and full recomputation. The prediction is converted to achieved
TFLOP/s per GPU the paper's way: its FLOP count of an iteration (which includes the
recomputed forward) over the predicted step time and the GPU count.

    python benchmarks/published_megatron.py                       # the default rows
    python benchmarks/published_megatron.py --rows 1.7 39.1 --attention eager
    python benchmarks/published_megatron.py --arch neox --attention eager
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import autopar
from autopar.compiler.planner.estimate import Estimator
from autopar.examples import causal_lm_loss, neox_config

SEQ = 2048
VOCAB = 51_200


@dataclass(frozen=True)
class Row:
    """One row of the paper's Table 1 (billions of parameters as the paper names it)."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # achieved teraFLOP/s per GPU, as published

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


# the reference figures, with their source and what of them was confirmed
DATA = json.loads((Path(__file__).parent / "data" / "megatron_sc21_table1.json").read_text())
TABLE_1 = [Row(**row) for row in DATA["rows"]]
DEFAULT_ROWS = [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6]


def paper_flops(batch: int, layers: int, hidden: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """FLOPs of one iteration as the paper counts them: forward, backward and the
    recomputed forward of every layer, plus the logit layer's forward and backward."""
    return 96 * batch * seq * layers * hidden**2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def layout_of(row: Row, micro_batch: int, schedule: str) -> autopar.Layout:
    """The paper's layout with `micro_batch` sequences per micro-batch. Without a
    pipeline the rank's whole share is one micro-batch: the paper gives no micro-batch
    size for those rows, and `autopar.plan`, which tries accumulation there, chooses
    none on them (docs/published_results.md). The gradient all-reduce is not overlapped
    with the backward (`overlap_comm=False`): Megatron-LM's own data parallelism of 2021
    (`DDP_impl="local"`) called `allreduce_gradients()` after the whole forward and
    backward of the step."""
    per_rank = row.batch // row.dp
    if row.pp == 1:
        micro_batch = per_rank
    if per_rank % micro_batch:
        raise ValueError(f"{row.billions}B: {per_rank} sequences per rank do not split into "
                         f"micro-batches of {micro_batch}")
    virtual = 2 if schedule == "interleaved" and row.pp > 1 else 1
    return autopar.Layout(dp=row.dp, tp=row.tp, pp=row.pp, microbatches=per_rank // micro_batch,
                          schedule=schedule if row.pp > 1 else "1f1b", virtual_stages=virtual,
                          amp="fp16", recompute="full", overlap_comm=False)


def fitting_layout(row: Row, layout: autopar.Layout, estimator: Estimator
                   ) -> tuple[autopar.Layout, autopar.Prediction]:
    """`layout` (layout_of's) and its prediction, except that a row without a pipeline
    runs its rank's share in the fewest micro-batches whose predicted peak fits the
    memory `autopar.plan` allows (`Plan.max_memory_fraction` of the device): the paper
    gives no micro-batch size for those rows, its runs fit its GPUs, and fewer, larger
    micro-batches are what a Megatron-LM user tunes toward (the faster). On the unfused
    kernels the 1.7B row's whole share (16 sequences) is predicted at 83.5 GB."""
    prediction = estimator.predict(layout)
    if row.pp > 1:
        return layout, prediction
    budget = estimator.cluster.device.memory_bytes * MEMORY_FRACTION
    per_rank = row.batch // row.dp
    for m in (m for m in range(layout.microbatches, per_rank + 1) if per_rank % m == 0):
        candidate = dataclasses.replace(layout, microbatches=m)
        prediction = prediction if m == layout.microbatches else estimator.predict(candidate)
        if prediction.peak_memory_bytes <= budget:
            return candidate, prediction
    raise ValueError(f"{row.billions}B: no micro-batch count fits {budget / 1e9:.1f} GB")


def gpt(row: Row, attention: str, arch: str = "gpt2"):
    """The row's GPT on the meta device: transformers' GPT-2, or GPT-NeoX configured as
    the same sequential pre-norm block (`use_parallel_residual=False`, GELU MLP of 4h,
    tied embeddings, dropout 0.1) whose fused q/k/v is laid out per head as
    Megatron-LM's is; it differs from the paper's model in its rotary embedding on a
    quarter of each head (elementwise work) instead of learned positions."""
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=row.layers, n_embd=row.hidden, n_head=row.heads,
                            vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
                            attn_implementation=attention)
        with torch.device("meta"):
            return GPT2LMHeadModel(config), (torch.randint(0, VOCAB, (row.batch, SEQ)),)
    from transformers import GPTNeoXForCausalLM

    config = neox_config(row.layers, row.hidden, row.heads, VOCAB, SEQ, attention,
                         dropout=0.1, tied=True)
    with torch.device("meta"):
        return GPTNeoXForCausalLM(config), (torch.empty((row.batch, SEQ), dtype=torch.long,
                                                        device="meta"),)


# the share of a device's memory a layout may use: autopar.plan's default
MEMORY_FRACTION = autopar.Plan.__dataclass_fields__["max_memory_fraction"].default

# Megatron-LM steps Adam with apex's fused kernel (one pass over parameter, gradient and
# both moments), not torch's default one pass per op
OPTIMIZER = "adamw-fused"


def cluster_of(row: Row, attention: str = "fused") -> autopar.ClusterSpec:
    """The row's DGX A100 80GB nodes; `attention` (DeviceSpec): "unfused" costs attention
    with its scores materialised, as the paper's Megatron-LM of 2021 ran it."""
    cluster = autopar.ClusterSpec.preset("dgx-a100-80gb", nodes=row.gpus // 8)
    device = cluster.device.model_copy(update={"attention": attention})
    return cluster.model_copy(update={"device": device})


def estimator(row: Row, attention: str, trace_blocks: int | None = 2, arch: str = "gpt2",
              kernels: str = "fused") -> Estimator:
    model, batch = gpt(row, attention, arch)
    return Estimator(model, cluster_of(row, kernels), batch, causal_lm_loss,
                     optimizer=OPTIMIZER, trace_blocks=trace_blocks)


def predict(row: Row, layout: autopar.Layout, attention: str,
            trace_blocks: int | None = 2, arch: str = "gpt2",
            kernels: str = "fused") -> autopar.Prediction:
    return estimator(row, attention, trace_blocks, arch, kernels).predict(layout)


def plan_row(row: Row, attention: str = "sdpa", arch: str = "gpt2", kernels: str = "fused"):
    """`autopar.plan` of the row's model on its cluster with the planner's defaults (fp16,
    as the paper trained): (plan, seconds the call took). `kernels`: the cluster's
    attention kernels (`cluster_of`), "fused" as the preset has them."""
    model, batch = gpt(row, attention, arch)
    cluster = cluster_of(row, kernels)
    start = time.perf_counter()
    plan = autopar.plan(model, cluster, batch, causal_lm_loss, amp="fp16", optimizer=OPTIMIZER)
    return plan, time.perf_counter() - start


def brief(layout: autopar.Layout) -> str:
    out = f"dp={layout.dp} tp={layout.tp} pp={layout.pp} m={layout.microbatches}"
    if layout.virtual_stages > 1:
        out += f" v={layout.virtual_stages}"
    if layout.pp > 1 and layout.schedule != "1f1b":
        out += f" {layout.schedule}"
    return out + (f" zero={layout.zero}" if layout.zero else "") + f" {layout.recompute}"


def plan_table(rows: list[Row], args) -> None:
    """One row per published row: planning time with defaults, the chosen layout and the
    paper's, and both predicted against the published time (signed)."""
    print("| row | plan s | chosen | chosen predicted TFLOP/s/GPU | paper's layout | its "
          "predicted | paper | error (paper's layout) | chosen no slower |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    for row in rows:
        flops = paper_flops(row.batch, row.layers, row.hidden)
        try:
            plan, seconds = plan_row(row, args.attention, args.arch, args.kernels)
        except Exception as exc:  # report the failing row, do not hide it
            print(f"| {row.billions}B | error: {type(exc).__name__}: {exc} | | | | | | | |",
                  flush=True)
            continue
        layout, paper = fitting_layout(row, layout_of(row, args.micro_batch, args.schedule),
                                       estimator(row, args.attention, arch=args.arch,
                                                 kernels=args.kernels))
        chosen_rate = flops / plan.predicted.step_time_s / row.gpus / 1e12
        paper_rate = flops / paper.step_time_s / row.gpus / 1e12
        error = paper_rate / row.tflops - 1
        errors.append(error)
        print(f"| {row.billions}B | {seconds:.1f} | {brief(plan.layout)} | {chosen_rate:.1f} | "
              f"{brief(layout)} | {paper_rate:.1f} | {row.tflops:.0f} | {error:+.1%} | "
              f"{'yes' if plan.predicted.step_time_s <= paper.step_time_s else 'no'} |",
              flush=True)
    if errors:
        print(f"median error {statistics.median(errors):+.1%}, median |error| "
              f"{statistics.median(abs(e) for e in errors):.1%}, worst |error| "
              f"{max(abs(e) for e in errors):.1%} over {len(errors)} rows")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=float, default=DEFAULT_ROWS,
                   help="rows by billions of parameters (Table 1's first column)")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"],
                   help="transformers' attention implementation of the traced GPT-2")
    p.add_argument("--micro-batch", type=int, default=1,
                   help="sequences per micro-batch of a pipelined row")
    p.add_argument("--trace-blocks", type=int, default=2,
                   help="blocks traced and scaled (0: the whole model)")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "interleaved"])
    p.add_argument("--arch", default="gpt2", choices=["gpt2", "neox"],
                   help="transformers' GPT-2, or GPT-NeoX (q/k/v laid out per head, as "
                        "Megatron-LM's)")
    p.add_argument("--kernels", default="fused", choices=["fused", "unfused"],
                   help="DeviceSpec.attention: attention costed as the fused kernel, or as "
                        "matmul, softmax, matmul with the scores materialised (the "
                        "paper's 2021 Megatron-LM)")
    p.add_argument("--plan", action="store_true",
                   help="also plan each row with autopar.plan's defaults (fp16 fixed) and "
                        "compare the chosen layout with the paper's")
    args = p.parse_args()
    # the tensor-parallel rules probe strategies on fake tensors; their refusals are noise
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    rows = {row.billions: row for row in TABLE_1}
    if args.plan:
        print(f"arch={args.arch} attention={args.attention} kernels={args.kernels}")
        plan_table([rows[b] for b in args.rows], args)
        return
    print(f"arch={args.arch} attention={args.attention} micro_batch={args.micro_batch} "
          f"schedule={args.schedule} kernels={args.kernels}")
    print("| row | layout | paper TFLOP/s/GPU | predicted (paper's FLOPs) | error | autopar "
          "TFLOP/s/GPU | MFU | bubble | step s | estimate s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for billions in args.rows:
        row = rows[billions]
        layout = layout_of(row, args.micro_batch, args.schedule)
        start = time.perf_counter()
        try:
            layout, pred = fitting_layout(row, layout, estimator(
                row, args.attention, args.trace_blocks or None, args.arch, args.kernels))
        except Exception as exc:  # report the failing layout, do not hide it
            print(f"| {billions}B | {brief(layout)} | {row.tflops:.0f} | error: "
                  f"{type(exc).__name__}: {exc} | | | | | | |", flush=True)
            continue
        seconds = time.perf_counter() - start
        achieved = paper_flops(row.batch, row.layers, row.hidden) / pred.step_time_s / row.gpus / 1e12
        error = achieved / row.tflops - 1
        errors.append(error)
        print(f"| {billions}B | {brief(layout)} | {row.tflops:.0f} | {achieved:.1f} | "
              f"{error:+.1%} | "
              f"{pred.tflops_per_device:.1f} | {pred.mfu:.1%} | {pred.bubble_fraction:.1%} | "
              f"{pred.step_time_s:.2f} | {seconds:.0f} |", flush=True)
    if errors:
        print(f"median error {statistics.median(errors):+.1%}, median |error| "
              f"{statistics.median(abs(e) for e in errors):.1%} over {len(errors)} rows")


if __name__ == "__main__":
    main()
