"""Dropout traced as a GPU runs it (ir/trace.py GpuKernels) for the planner's GPU clusters:
`native_dropout` with a 1-byte mask, attention's dropout inside the fused kernel."""

import operator

import pytest
import torch

import autopar
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.ir.verify import verify
from autopar.examples import gpt2

aten = torch.ops.aten


def _targets(tg):
    return [n.target for n in tg.call_nodes()]


def _masks(tg):
    return [n for n in tg.call_nodes() if n.target is operator.getitem
            and n.args[0].target == aten.native_dropout.default and n.args[1] == 1]


def test_a_gpu_trace_takes_native_dropout_and_the_fused_attention():
    ex = gpt2(layers=2, dropout=0.1)
    cpu = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    gpu = trace_train_step(ex.model, ex.batch, ex.loss_fn, kernels="gpu")
    # the CPU: masks drawn with bernoulli_, attention on its math path (s x s probabilities)
    assert aten.bernoulli_.float in _targets(cpu) and aten._safe_softmax.default in _targets(cpu)
    assert aten.bernoulli_.float not in _targets(gpu)
    assert aten._safe_softmax.default not in _targets(gpu)
    # the embeddings' dropout and two residual dropouts per block, each with a bool mask
    assert len(_masks(gpu)) == 1 + 2 * 2
    assert all(m.meta[M.VAL].dtype == torch.bool for m in _masks(gpu))
    attention = [n for n in gpu.call_nodes()
                 if n.target == aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert len(attention) == 2 and all(n.args[3] == 0.1 for n in attention)
    # without dropout both traces are the CPU's
    plain = gpt2(layers=2)
    assert _targets(trace_train_step(plain.model, plain.batch, plain.loss_fn, kernels="gpu")) \
        == _targets(trace_train_step(plain.model, plain.batch, plain.loss_fn))


def test_full_recomputation_keeps_the_mask_and_recomputes_the_dropout_from_it():
    ex = gpt2(layers=2, dropout=0.1)
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn, kernels="gpu")
    out, results = autopar.run_passes(tg, autopar.Layout(recompute="full", fusion=False))
    verify(out)
    declined = {name for name, _ in {r.name: r for r in results}["recompute"].declined}
    masks = _masks(out)
    assert {m.name for m in masks if m.meta.get(M.LAYER) is not None} <= declined
    copies = [n for n in out.call_nodes() if n.meta.get(M.RECOMPUTED)]
    # nothing random is copied, nor a getitem of native_dropout (it would keep both outputs)
    assert aten.native_dropout.default not in {c.target for c in copies}
    assert not [c for c in copies if c.target is operator.getitem
                and c.args[0].target == aten.native_dropout.default]
    redone = [c for c in copies if c.target == aten.native_dropout_backward.default]
    assert len(redone) == 2 and all(c.args[1] in masks and c.args[2] == 1 / 0.9 for c in redone)


def test_dropout_costs_its_one_byte_masks_on_a_gpu_cluster():
    """GPT-2 (2 blocks, hidden 64, 4 heads, 8 x 256 tokens) on 8 GPUs: with dropout a rank
    keeps at most its 5 bool masks of 1 x 256 x 64 more, under every recompute policy.
    (The CPU's trace kept 4.0-6.3 MB more, 2.0-2.6x the peak: fp32 masks, and 4 x 256^2
    attention probabilities, their mask and the dropped ones per block.)"""
    cluster = autopar.ClusterSpec.preset("dgx-a100-80gb")
    masks = 5 * 1 * 256 * 64
    for recompute in ("none", "selective", "full"):
        layout = autopar.Layout(dp=8, recompute=recompute)
        peaks = [autopar.estimate(ex.model, cluster, layout, ex.batch, ex.loss_fn).peak_memory_bytes
                 for ex in (gpt2(layers=2, vocab=64, seq=256),
                            gpt2(layers=2, vocab=64, seq=256, dropout=0.1))]
        assert 0 < peaks[1] - peaks[0] <= masks, (recompute, peaks)


def test_attention_on_a_gpu_cluster_is_costed_as_the_fused_kernel():
    """GPT-2 with dropout 0.1 (transformers' defaults: sdpa attention) on a DGX A100: the
    same model FLOPs as its eager attention (two matmuls of 2 b h s^2 d each way), and
    saved memory a + b s + c s^2 where c covers only the model's causal mask (one s x s
    per step, shared by every head and sequence: 4 bytes, and 4 more for its additive
    form), not the b h s^2 scores eager attention keeps.

    Derivation: with activations A(s) = b s + c s^2, c = (A(2s) - 2 A(s)) / (2 s^2)."""
    cluster = autopar.ClusterSpec.preset("dgx-a100-80gb")
    layout = autopar.Layout(dp=8)

    def predict(attention, seq):
        ex = gpt2(layers=2, vocab=64, seq=seq, dropout=0.1, attention=attention)
        return autopar.estimate(ex.model, cluster, layout, ex.batch, ex.loss_fn)

    def quadratic(attention, s=256):
        short, long = predict(attention, s), predict(attention, 2 * s)
        assert short.flops_per_step > 0
        return (long.memory["activations"] - 2 * short.memory["activations"]) / (2 * s**2)

    for seq in (256, 512):
        assert predict("sdpa", seq).flops_per_step == \
            pytest.approx(predict("eager", seq).flops_per_step, rel=1e-6)
    fused = quadratic("sdpa")
    assert 0 <= fused <= 8
    # eager keeps s x s values per head (its probabilities, the dropout's mask)
    assert quadratic("eager") > 2 * fused
