"""Tracing to a TrainGraph: gradients equal eager autograd, metadata, awkward models, errors."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.printing import summary
from autopar.compiler.ir.trace import TraceError, trace_train_step
from autopar.compiler.ir.verify import verify
from autopar.examples import causal_lm_loss, gpt2, llama, mlp


def run_graph(tg, model, inputs):
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    flat = [named[p.name] for p in tg.signature.params] + [named[b.name] for b in tg.signature.buffers]
    with torch.no_grad():
        return tg.gm(*flat, *inputs)


def eager_grads(model, inputs, loss_fn):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    loss = loss_fn(out, *inputs) if loss_fn else (out if isinstance(out, torch.Tensor) else out.loss)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("factory", [gpt2, llama, mlp], ids=["gpt2", "llama", "mlp"])
def test_joint_graph_matches_eager_autograd(factory):
    ex = factory()
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    verify(tg)
    outs = run_graph(tg, ex.model, ex.batch)
    loss, grads = eager_grads(ex.model, ex.batch, ex.loss_fn)
    torch.testing.assert_close(outs[0], loss, rtol=1e-6, atol=0)
    for spec, g in zip(tg.signature.params, tg.grad_nodes()):
        got = outs[tg.signature.grad_output_index(tg.signature.params.index(spec))]
        torch.testing.assert_close(got, grads[spec.name], rtol=1e-5, atol=1e-7)


def test_metadata_roles_modules_layers_flops():
    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=2, seq=16)
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    roles = collections.Counter(n.meta[M.ROLE] for n in tg.call_nodes())
    assert roles[M.Role.FORWARD] and roles[M.Role.BACKWARD] and roles[M.Role.LOSS]
    # the loss region is what follows the last parameter read: log-softmax + nll
    loss_ops = {str(n.target) for n in tg.call_nodes() if n.meta[M.ROLE] == M.Role.LOSS}
    assert any("log_softmax" in t for t in loss_ops) and any("nll_loss" in t for t in loss_ops)
    assert not any("mm" in t.split(".")[-2] for t in loss_ops if "." in t)
    # every matmul of the blocks sits in a module of that block, forward and backward
    for n in tg.call_nodes():
        if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            assert n.meta[M.MODULE_PATH] is not None, n.name
            if n.meta[M.MODULE_PATH].startswith("transformer.h."):
                assert n.meta[M.LAYER] == int(n.meta[M.MODULE_PATH].split(".")[2])
    bwd_layers = {n.meta[M.LAYER] for n in tg.call_nodes() if n.meta[M.ROLE] == M.Role.BACKWARD}
    assert {0, 1} <= bwd_layers
    # FLOPs: 2*m*n*k for each matmul; forward matmuls of a GPT-2 block + the tied head
    b, s, h, v = 2, 16, 64, 256
    tokens = b * s
    per_layer_fwd = 2 * tokens * (h * 3 * h + h * h + h * 4 * h + 4 * h * h) + 2 * 2 * b * 4 * s * s * (h // 4)
    head_fwd = 2 * tokens * h * v
    fwd = sum(n.meta[M.FLOPS] for n in tg.call_nodes() if n.meta[M.ROLE] != M.Role.BACKWARD)
    assert fwd == 2 * per_layer_fwd + head_fwd
    assert tg.total_flops() == pytest.approx(3 * fwd, rel=0.02)  # backward ~ 2x forward
    assert all(n.meta[M.SOURCE] for n in tg.call_nodes()
               if n.meta[M.ROLE] == M.Role.FORWARD and n.meta[M.MODULE_PATH])


def test_tied_weights_appear_once_with_summed_gradient():
    ex = gpt2()
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    names = tg.signature.param_names()
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    wte = tg.signature.params[names.index("transformer.wte.weight")]
    assert wte.aliases == ("lm_head.weight",)


class WithUnusedPooler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.pooler = torch.nn.Linear(8, 8)  # never called
        self.register_buffer("scale", torch.tensor(2.0))
        self.frozen = torch.nn.Parameter(torch.ones(8), requires_grad=False)

    def forward(self, x):
        return (self.body(x) * self.scale * self.frozen).pow(2).mean()


def test_unused_parameter_gets_zero_gradient_and_buffers_are_inputs():
    model = WithUnusedPooler()
    x = torch.randn(4, 8)
    tg = trace_train_step(model, (x,))
    outs = run_graph(tg, model, (x,))
    names = tg.signature.param_names()
    assert "pooler.weight" in names and "frozen" not in names
    assert [b.name for b in tg.signature.buffers] == ["frozen", "scale"]
    assert torch.count_nonzero(outs[1 + names.index("pooler.weight")]) == 0
    assert torch.count_nonzero(outs[1 + names.index("body.weight")]) > 0


def test_batchnorm_running_stats_come_back_as_outputs():
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    x = torch.randn(8, 4)
    tg = trace_train_step(model, (x,), lambda out, x: out.square().mean())
    assert set(tg.signature.mutated_buffers) >= {"1.running_mean", "1.running_var"}
    outs = run_graph(tg, model, (x,))
    expect = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    expect.load_state_dict(model.state_dict())
    expect(x)
    k = len(tg.signature.params) + 1
    new = dict(zip(tg.signature.mutated_buffers, outs[k:]))
    torch.testing.assert_close(new["1.running_mean"], expect[1].running_mean)


def test_grouped_query_attention_traces():
    ex = llama(heads=4, kv_heads=2)
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    shapes = {p.name: p.shape for p in tg.signature.params}
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (32, 64)  # 2 kv heads x 16


def test_trace_on_meta_device_allocates_nothing():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=1024, n_head=16, vocab_size=50257, use_cache=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, 50257, (4, 256))
    tg = trace_train_step(model, (ids,), causal_lm_loss)
    val = tg.loss_node().meta[M.VAL]
    assert val.shape == () and summary(tg)["parameters"] == sum(
        p.numel() for p in model.parameters())
    assert all(p.is_meta for p in model.parameters())


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # untraceable: branches on a value
            y = y * 2
        return y.mean()


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([DataDependent()])

    def forward(self, x):
        return self.blocks[0](x)


def test_untraceable_code_names_module_and_source_line():
    with pytest.raises(TraceError) as err:
        trace_train_step(Outer(), (torch.randn(2, 4),))
    text = str(err.value)
    assert "module `blocks.0`" in text
    assert "test_trace.py:" in text and "if y.sum() > 0" in text
    assert "hint:" in text and "torch.where" in text


@torch.library.custom_op("autopar_test::grouped_scale", mutates_args=())
def _grouped_scale(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x * 2


@_grouped_scale.register_fake
def _(x, offsets):
    return torch.empty_like(x)


def _grouped_scale_backward(ctx, grad):
    start, out = 0, torch.zeros_like(grad)
    for end in ctx.offsets.tolist():  # a tensor's values read in the backward
        out[start:end] = grad[start:end] * 2
        start = end
    return out, None


def _grouped_scale_setup(ctx, inputs, output):
    ctx.offsets = inputs[1]


_grouped_scale.register_autograd(_grouped_scale_backward, setup_context=_grouped_scale_setup)


class ValueReadingBackward(torch.nn.Module):
    """A custom op whose backward reads a tensor's values (as an MoE's grouped matmul
    fallback may): the forward exports, the joint trace cannot take the backward."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _grouped_scale(self.w(x), torch.tensor([1, 2])).square().mean()


def test_a_backward_that_reads_values_names_its_source_line():
    with pytest.raises(TraceError) as err:
        trace_train_step(ValueReadingBackward(), (torch.randn(2, 4),))
    text = str(err.value)
    assert "cannot trace the backward of the model" in text
    assert "test_trace.py:" in text and "ctx.offsets.tolist()" in text, text
    assert "hint:" in text and ".tolist()" in text


def test_model_without_loss_needs_loss_fn():
    with pytest.raises(TraceError, match="loss_fn"):
        trace_train_step(torch.nn.Linear(4, 4), (torch.randn(2, 4),))


ARCHITECTURES = ["gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral", "gpt_neox", "opt", "gemma",
                 "phi", "bert", "falcon", "gptj", "bloom", "starcoder2", "olmo",
                 # Gemma 2's soft-capped logits, Phi-3's fused gate/up projection, Cohere's
                 # parallel blocks and logit scale, StableLM's partial rotary, OLMo 2's q/k
                 # norms, CodeGen's interleaved rotary, MPT's ALiBi, Qwen2-MoE's shared expert
                 "gemma2", "phi3", "cohere", "stablelm", "olmo2", "codegen", "mpt", "qwen2_moe"]


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_any_transformers_architecture_traces_with_exact_gradients(model_type):
    """Tiny configs of architectures no code of ours names: the joint graph's loss and
    gradients equal eager autograd's (tied weights, MoE routing, ALiBi, partial rotary)."""
    from autopar.examples import hf_tiny

    ex = hf_tiny(model_type, batch=2, seq=16)
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    verify(tg)
    outs = run_graph(tg, ex.model, ex.batch)
    loss, grads = eager_grads(ex.model, ex.batch, ex.loss_fn)
    torch.testing.assert_close(outs[0], loss, rtol=1e-6, atol=0)
    for i, spec in enumerate(tg.signature.params):
        expected = grads[spec.name]
        expected = torch.zeros_like(outs[1 + i]) if expected is None else expected
        torch.testing.assert_close(outs[1 + i], expected, rtol=1e-5, atol=1e-6)
