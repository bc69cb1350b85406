"""Grouped-query attention without a mask takes its grouped keys and values
(`enable_gqa=True`), as eager transformers calls it, instead of the repeat the traced
model makes (ir/grouped_kv.py)."""

from __future__ import annotations

import pytest
import torch

from autopar.compiler.ir.causal_mask import bound
from autopar.compiler.ir.grouped_kv import SDPA, group_repeated_kv
from autopar.compiler.ir.trace import forward_module, trace_source, trace_train_step
from autopar.examples import gpt2, hf_tiny, llama
from tests.unit.test_causal_mask import assert_matches_eager

CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def attentions(gm):
    return [bound(n) for n in gm.graph.nodes if n.target is SDPA]


@pytest.mark.parametrize("factory, kv_heads", [
    (lambda: llama(layers=2, hidden=64, heads=8, kv_heads=4, vocab=256, batch=2, seq=16), 4),
    (lambda: llama(layers=2, hidden=64, heads=8, kv_heads=1, vocab=256, batch=2, seq=16), 1),
    (lambda: hf_tiny("qwen2", batch=2, seq=16), None),
], ids=["llama-gqa", "llama-mqa", "qwen2"])
def test_grouped_attention_takes_grouped_kv_and_keeps_the_step(factory, kv_heads):
    ex = factory()
    config = ex.model.config
    kv_heads = kv_heads or config.num_key_value_heads
    forward = forward_module(trace_source(ex.model, ex.batch, ex.loss_fn))
    calls = attentions(forward)
    assert len(calls) == config.num_hidden_layers
    for q, k, v, mask, _, causal, _, gqa in calls:
        assert gqa and causal and mask is None
        assert k.meta["val"].shape[1] == v.meta["val"].shape[1] == kv_heads
        assert q.meta["val"].shape[1] == config.num_attention_heads
    ops = {n.target for n in forward.graph.nodes}
    assert torch.ops.aten.expand.default not in ops  # no repeat left
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    assert tg.attrs["grouped_kv"] == config.num_hidden_layers
    # the backward keeps the grouped k and v: the kernel's inputs have kv_heads heads
    kernels = [n for n in tg.gm.graph.nodes if n.target is CPU_ATTENTION]
    assert kernels and all(n.args[1].meta["val"].shape[1] == kv_heads for n in kernels)
    assert_matches_eager(tg, ex)


def test_attention_with_all_heads_or_a_mask_is_left_as_it_is():
    """Without grouped heads there is no repeat; with a padding mask eager repeats too."""
    ex = gpt2(layers=1, hidden=32, heads=2, vocab=64, batch=2, seq=8)
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    assert "grouped_kv" not in tg.attrs
    ex = llama(layers=1, hidden=64, heads=8, kv_heads=4, vocab=256, batch=2, seq=16)
    ids = ex.batch[0]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: the mask depends on the batch and stays
    source = trace_source(ex.model, (ids, mask), _MaskedLoss(ex.loss_fn))
    calls = attentions(forward_module(source))
    assert calls and all(not gqa and mask is not None for _, _, _, mask, _, _, _, gqa in calls)


class _MaskedLoss:
    """Objective-less loss for a model called as model(ids, attention_mask)."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def __call__(self, out, ids, mask):
        return self.loss_fn(out, ids)


def test_the_exported_graph_is_not_changed():
    ex = llama(layers=1, hidden=64, heads=8, kv_heads=4, vocab=256, batch=2, seq=16)
    source = trace_source(ex.model, ex.batch, ex.loss_fn)
    before = [n.format_node() for n in source.exported.graph_module.graph.nodes]
    forward = forward_module(source)
    again, count = group_repeated_kv(forward)
    assert count == 0 and again is forward  # nothing left to group
    assert [n.format_node() for n in source.exported.graph_module.graph.nodes] == before
