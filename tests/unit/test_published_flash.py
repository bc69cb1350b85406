"""The FlashAttention-2 benchmark (benchmarks/published_flash.py,
docs/published_results.md): its layouts and its FLOP accounting against the cost
model's."""

from __future__ import annotations

import logging

import pytest

import autopar
from autopar.examples import causal_lm_loss
from benchmarks.published_flash import DATA, cluster, gpt, paper_flops, published_layout


def test_the_published_runs_accumulate_to_the_global_batch():
    for row in DATA["rows"]:
        layout = published_layout(row, row["micro_batch"])
        assert layout.dp * layout.microbatches * row["micro_batch"] == row["global_batch"]
        assert (layout.zero, layout.amp, layout.pp) == (1, "bf16", 1)


def test_the_papers_formula_is_the_cost_models_flops():
    """6 s N + 12 L h s^2 per sequence (the paper's, causal attention counted whole) is
    autopar's model FLOPs but for the position embedding, which N counts and no matmul
    multiplies (0.3% of the 1.3B model); the fused and unfused kernels count alike."""
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    row = DATA["rows"][0]  # GPT3-1.3B, 2k
    model, batch = gpt(row)
    params = sum(p.numel() for p in model.parameters())
    positions = model.transformer.wpe.weight.numel()
    layout = published_layout(row, row["micro_batch"])
    fused = autopar.estimate(model, cluster("fused"), layout, batch, causal_lm_loss)
    unfused = autopar.estimate(model, cluster("unfused"), layout, batch, causal_lm_loss)
    expected = paper_flops(row, params - positions)
    assert fused.flops_per_step == pytest.approx(expected, rel=0.002)
    assert unfused.flops_per_step == pytest.approx(expected, rel=0.002)
    # the fused causal kernel skips half the scores: less time for the same FLOPs
    assert fused.step_time_s < unfused.step_time_s
