"""Dropout traced as a GPU runs it (ir/trace.py GpuKernels) for the planner's GPU clusters:
bool masks, attention's dropout inside the fused kernel; recomputation of a GPU's
`native_dropout`."""

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
    """The dropout masks a trace draws in bool (1 byte an element)."""
    return [n for n in tg.call_nodes()
            if n.target == aten.bernoulli_.float and n.meta[M.VAL].dtype == torch.bool]


def test_a_gpu_trace_draws_bool_masks_and_takes_the_fused_attention():
    ex = gpt2(layers=2, dropout=0.1)
    cpu = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    gpu = trace_train_step(ex.model, ex.batch, ex.loss_fn, kernels="gpu")
    # the CPU: fp32 masks, attention on its math path (s x s probabilities)
    assert aten._safe_softmax.default in _targets(cpu) and not _masks(cpu)
    assert aten._safe_softmax.default not in _targets(gpu)
    # the embeddings' dropout and two residual dropouts per block, each with a bool mask
    assert len(_masks(gpu)) == 1 + 2 * 2
    assert not [n for n in gpu.call_nodes() if n.target == aten.bernoulli_.float
                and n.meta[M.VAL].dtype != torch.bool]
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
    # nothing random is copied; the dropped values are recomputed from the kept masks
    assert not {aten.bernoulli_.float, aten.empty_like.default} & {c.target for c in copies}
    redone = [c for c in copies if c.target == aten.mul.Tensor and set(c.args) & set(masks)]
    assert len(redone) == 2, [c.format_node() for c in copies]


def test_dropout_fuses_with_the_kernels_around_it():
    """The mask draw and the product join fused kernels: no draw is left a kernel of its
    own, and each mask leaves its kernel as bool."""
    ex = gpt2(layers=2, dropout=0.1, attention="eager")
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn, kernels="gpu")
    out, _ = autopar.run_passes(tg, autopar.Layout())
    assert not [n for n in out.call_nodes()
                if n.target in (aten.bernoulli_.float, aten.empty_like.default)]
    fused = [n for n in out.call_nodes() if n.target == torch.ops.autopar.fused.default]
    outputs = [g.meta[M.VAL].dtype for f in fused for g in f.users if M.VAL in g.meta]
    # the embeddings' and two residual dropouts per block: eager attention's own is drawn
    # inside the fused attention kernel a GPU runs (eager_attention.py)
    assert outputs.count(torch.bool) == 1 + 2 * 2


def test_dropout_costs_its_one_byte_masks_on_a_gpu_cluster():
    """GPT-2 (2 blocks, hidden 64, 4 heads, 8 x 256 tokens) on 8 GPUs: with dropout a rank
    keeps at most its 5 bool masks of 1 x 256 x 64 more, and one fp32 gradient of that
    size (the gradient through a dropout is a tensor of its own, beside the residual's;
    without dropout the block's output gradient is the residual's, one storage), under
    every recompute policy. (The CPU's trace kept 4.0-6.3 MB more, 2.0-2.6x the peak:
    fp32 masks, and 4 x 256^2 attention probabilities, their mask and the dropped ones
    per block.)"""
    cluster = autopar.ClusterSpec.preset("dgx-a100-80gb")
    masks = 5 * 1 * 256 * 64 + 1 * 256 * 64 * 4
    for recompute in ("none", "selective", "full"):
        layout = autopar.Layout(dp=8, recompute=recompute)
        peaks = [autopar.estimate(ex.model, cluster, layout, ex.batch, ex.loss_fn).peak_memory_bytes
                 for ex in (gpt2(layers=2, vocab=64, seq=256),
                            gpt2(layers=2, vocab=64, seq=256, dropout=0.1))]
        assert 0 < peaks[1] - peaks[0] <= masks, (recompute, peaks)


def test_attention_on_a_gpu_cluster_is_costed_as_the_fused_kernel():
    """GPT-2 with dropout 0.1 on a DGX A100, its sdpa attention (transformers' default)
    and its eager one: the same model FLOPs (two matmuls of 2 b h s^2 d each way), and
    saved memory a + b s + c s^2 where c covers only the model's causal mask (one s x s
    per step, shared by every head and sequence: 4 bytes, and 4 more for its additive
    form), not the b h s^2 scores, probabilities and dropout mask (4 b h bytes and more
    per s^2) the eager decomposition keeps on a CPU.

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
    for attention in ("sdpa", "eager"):
        assert 0 <= quadratic(attention) <= 8, attention


class _NativeDropoutBlock(torch.nn.Module):
    """An MLP block that calls the GPU's dropout op itself between its matmuls (a CUDA
    trace has it: torch's dropout runs `native_dropout` where
    `is_fused_kernel_acceptable`)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return self.down(torch.native_dropout(torch.relu(self.up(x)), 0.25, True)[0])


class _NativeDropoutMLP(torch.nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(_NativeDropoutBlock() for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_recomputation_keeps_a_native_dropout_mask_and_redoes_its_product():
    model = _NativeDropoutMLP()
    tg = trace_train_step(model, (torch.randn(4, 16),), lambda out, x: out.square().mean())
    out, results = autopar.run_passes(tg, autopar.Layout(recompute="full", fusion=False))
    verify(out)
    masks = [n for n in out.call_nodes() if n.target is operator.getitem
             and n.args[0].target == aten.native_dropout.default and n.args[1] == 1]
    assert len(masks) == 2
    copies = [n for n in out.call_nodes() if n.meta.get(M.RECOMPUTED)]
    assert aten.native_dropout.default not in {c.target for c in copies}
    redone = [c for c in copies if c.target == aten.native_dropout_backward.default]
    assert redone and all(c.args[1] in masks and c.args[2] == 1 / 0.75 for c in redone)
