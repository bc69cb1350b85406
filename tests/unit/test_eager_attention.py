"""Attention written out op by op, taken as one scaled_dot_product_attention for a GPU
trace (ir/eager_attention.py): the rewritten graph computes what the model does, over
random chains of the ops models write; what it cannot take it leaves, saying why; a GPU
trace of transformers' eager attention costs what its sdpa attention costs."""

import math

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.cluster import ClusterSpecError, DeviceSpec
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import executed_flops
from autopar.compiler.ir.eager_attention import SDPA, fuse_eager_attention
from autopar.compiler.ir.trace import trace_train_step
from autopar.costs import causal_share
from autopar.examples import gpt2, llama, neox

B, H, S, D = 2, 3, 5, 4

# one op on the scores before the softmax, as models write them: (name, apply(x, mask))
SCORE_STEPS = {
    "mul": lambda x, m: x * 0.5,
    "rmul": lambda x, m: 0.25 * x,
    "div": lambda x, m: x / 3.0,
    "div_tensor": lambda x, m: x / torch.full([], 2.0, dtype=x.dtype),
    "add_mask": lambda x, m: x + torch.where(m, 0.0, torch.finfo(torch.float32).min),
    "mask_add": lambda x, m: torch.where(m, 0.0, -1e9).to(x.dtype) + x,
    "where": lambda x, m: torch.where(m, x, torch.finfo(torch.float32).min),
    "where_tensor": lambda x, m: torch.where(m, x, torch.full([], -1e9, dtype=x.dtype)),
    "masked_fill": lambda x, m: x.masked_fill(~m, float("-inf")),
    "float": lambda x, m: x.float(),
    "double": lambda x, m: x.to(torch.float64),
}


class Attention(torch.nn.Module):
    """q, k, v projections and an attention whose score ops are `steps`, its softmax in
    `softmax_dtype`, its probabilities cast back to v's dtype or not."""

    def __init__(self, steps, softmax_dtype, cast_back, transpose_k, native_dropout=False):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D * H)
        self.steps, self.softmax_dtype = steps, softmax_dtype
        self.cast_back, self.transpose_k = cast_back, transpose_k
        self.native_dropout = native_dropout

    def forward(self, x, mask):
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = q @ (k.transpose(-1, -2) if self.transpose_k else k.permute(0, 1, 3, 2))
        for step in self.steps:
            scores = SCORE_STEPS[step](scores, mask)
        probs = torch.softmax(scores, dim=-1, dtype=self.softmax_dtype)
        if self.cast_back:
            probs = probs.to(v.dtype)
        if self.native_dropout:  # as export records some models' dropout: (output, mask)
            probs = torch.native_dropout(probs, 0.3, False)[0]
        else:
            probs = torch.nn.functional.dropout(probs, 0.3, training=False)
        return (probs.to(v.dtype) @ v).transpose(1, 2).reshape(B, S, H * D)


def _exported(module, *inputs):
    ep = torch.export.export(module, inputs, strict=False)
    state = {**ep.state_dict, **ep.constants}
    user = iter(inputs)
    args = [state[s.target] if s.target in state else next(user)
            for s in ep.graph_signature.input_specs]
    return ep.graph_module, args


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.sampled_from(sorted(SCORE_STEPS)), max_size=4),
       softmax_dtype=st.sampled_from([None, torch.float32]),
       cast_back=st.booleans(), transpose_k=st.booleans(), native_dropout=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_rewritten_chain_computes_what_the_model_does(steps, softmax_dtype, cast_back,
                                                        transpose_k, native_dropout, seed):
    torch.manual_seed(seed)
    module = Attention(steps, softmax_dtype, cast_back, transpose_k, native_dropout)
    x = torch.randn(B, S, D)
    mask = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    gm, args = _exported(module, x, mask)
    fused, result = fuse_eager_attention(gm)
    assert result.rewritten == 1 and not result.left, result
    assert [n.target for n in fused.graph.nodes].count(SDPA) == 1
    assert not [n for n in fused.graph.nodes if "softmax" in str(n.target)]
    expected = module(x, mask)
    got = fx.Interpreter(fused).run(*args)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the same gradients flow to the projection
    grads = []
    for run in (lambda: module(x, mask), lambda: fx.Interpreter(fused).run(*args)[0]):
        module.zero_grad()
        args[0].grad = None
        out = run()
        out.square().sum().backward()
        grads.append(module.qkv.weight.grad.clone() if args[0] is not module.qkv.weight
                     else args[0].grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)
    assert gm.graph is not fused.graph and SDPA not in [n.target for n in gm.graph.nodes]


class ReturnsProbabilities(torch.nn.Module):
    """Attention whose probabilities are an output too (output_attentions=True)."""

    def forward(self, q, k, v):
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        return probs @ v, probs


class SoftmaxOverHeads(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=1) @ v


class ScoresPlusScores(torch.nn.Module):
    """Not a masking: the scores added to a function of themselves."""

    def forward(self, q, k, v):
        scores = q @ k.transpose(-1, -2)
        return torch.softmax(scores + scores.tanh(), dim=-1) @ v


@pytest.mark.parametrize("module, why", [
    (ReturnsProbabilities(), "read by more than the matmul with v"),
    (SoftmaxOverHeads(), "a softmax over a dim other than the last"),
    (ScoresPlusScores(), "read by more than the softmax"),
])
def test_a_chain_it_cannot_take_is_left_with_why(module, why):
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    gm, args = _exported(module, q, k, v)
    fused, result = fuse_eager_attention(gm)
    assert result.rewritten == 0 and len(result.left) == 1 and why in result.left[0][1], result
    expected = module(q, k, v)
    expected = expected if isinstance(expected, tuple) else (expected,)
    torch.testing.assert_close(tuple(fx.Interpreter(fused).run(*args)), expected)


class NativeDropoutAttention(torch.nn.Module):
    """Attention whose dropout in training is `native_dropout` (export records
    transformers' dropout so in some versions), its mask returned too or not."""

    def __init__(self, returns_mask: bool):
        super().__init__()
        self.returns_mask = returns_mask

    def forward(self, q, k, v):
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        dropped, mask = torch.native_dropout(probs, 0.1, True)
        return (dropped @ v, mask) if self.returns_mask else dropped @ v


def test_a_native_dropout_in_training_is_the_kernels_dropout_unless_its_mask_is_read():
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    gm, _ = _exported(NativeDropoutAttention(False), q, k, v)
    fused, result = fuse_eager_attention(gm)
    assert result.rewritten == 1 and not result.left, result
    (sdpa,) = [n for n in fused.graph.nodes if n.target is SDPA]
    assert sdpa.kwargs["dropout_p"] == 0.1
    assert not [n for n in fused.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    gm, _ = _exported(NativeDropoutAttention(True), q, k, v)
    fused, result = fuse_eager_attention(gm)
    assert result.rewritten == 0 and "its dropout's mask is read" in result.left[0][1], result


def test_a_causal_kernel_computes_the_scores_on_and_below_the_diagonal():
    """costs.causal_share counts, row by row, the keys query i sees under torch's
    is_causal (aligned top-left): min(i + 1, s_k)."""
    for s_q, s_k in [(1, 1), (4, 4), (2, 4), (4, 2), (7, 3), (2048, 2048)]:
        kept = sum(min(i + 1, s_k) for i in range(s_q))
        assert causal_share(s_q, s_k) == kept / (s_q * s_k)
    assert causal_share(2048, 2048) == pytest.approx(0.5, abs=3e-4)


def _attention_nodes(tg):
    return [n for n in tg.call_nodes()
            if n.target == torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]


@pytest.mark.parametrize("build", [
    lambda attention: gpt2(layers=2, dropout=0.1, attention=attention),
    lambda attention: neox(layers=2, dropout=0.1, attention=attention),
])
def test_a_gpu_trace_takes_eager_attention_as_the_fused_kernel(build):
    """transformers' eager and sdpa attention of one model trace, for a GPU, to the same
    fused kernels with the same dropout, and the same FLOPs; a CPU trace keeps eager's
    decomposition (what a CPU runs)."""
    traces = {}
    for attention in ("sdpa", "eager"):
        ex = build(attention)
        traces[attention] = trace_train_step(ex.model, ex.batch, ex.loss_fn, kernels="gpu")
    flops = {a: sum(n.meta[M.FLOPS] for n in tg.call_nodes()) for a, tg in traces.items()}
    assert flops["eager"] == flops["sdpa"] > 0
    # both causal (eager's constant mask given back as is_causal): each kernel's time
    # counts the scores on and below the diagonal, its model FLOPs all of them
    executed = {a: sum(map(executed_flops, tg.call_nodes())) for a, tg in traces.items()}
    assert executed["eager"] == executed["sdpa"] < flops["sdpa"]
    for tg in traces.values():
        attention = _attention_nodes(tg)
        assert len(attention) == 2 and all(n.args[3] == 0.1 for n in attention)
        seq = attention[0].args[0].meta[M.VAL].shape[-2]
        assert all(n.args[4] is True for n in attention)
        assert all(executed_flops(n) == int(n.meta[M.FLOPS] * (seq + 1) / (2 * seq))
                   for n in attention)
    ex = build("eager")
    assert not _attention_nodes(trace_train_step(ex.model, ex.batch, ex.loss_fn))


def test_llama_eager_attention_is_fused_under_tensor_parallelism_and_amp():
    """Grouped-query attention (k and v repeated to every head before the matmul) in
    bf16: split by heads on 2 ranks, the FLOPs and memory of the sdpa model; on one, its
    step time too (the fused kernel runs in bf16, autocast's list for sdpa). Under tp the
    step of this tiny model is collective latency, which the solver's choices for two
    slightly different graphs move by more than the attention kernel."""
    cluster = autopar.ClusterSpec.preset("dgx-a100-80gb")
    for layout in (autopar.Layout(dp=4, tp=2, amp="bf16"), autopar.Layout(dp=8, amp="bf16")):
        predictions = {}
        for attention in ("sdpa", "eager"):
            ex = llama(layers=2, seq=64)
            ex.model.config._attn_implementation = attention
            predictions[attention] = autopar.estimate(ex.model, cluster, layout, ex.batch,
                                                      ex.loss_fn)
        eager, sdpa = predictions["eager"], predictions["sdpa"]
        assert eager.flops_per_step == pytest.approx(sdpa.flops_per_step, rel=1e-6)
        assert eager.peak_memory_bytes == pytest.approx(sdpa.peak_memory_bytes, rel=0.05)
        if layout.tp == 1:
            assert eager.step_time_s == pytest.approx(sdpa.step_time_s, rel=0.05)


def _with_attention(cluster, how):
    device = cluster.device.model_copy(update={"attention": how})
    return cluster.model_copy(update={"device": device})


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_cluster_without_fused_attention_keeps_the_scores(attention):
    """`device.attention="unfused"` (Megatron-LM of 2021) costs attention, sdpa or eager,
    as matmul, softmax, dropout, matmul: more activation memory (b h s^2 scores or
    probabilities, at least two per layer in bf16) and a slower step than the fused
    kernel; the prediction says which it did."""
    cluster = autopar.ClusterSpec.preset("dgx-a100-80gb")
    layout = autopar.Layout(dp=8, amp="bf16")
    ex = gpt2(layers=2, vocab=64, seq=256, dropout=0.1, attention=attention)
    fused, unfused = (autopar.estimate(ex.model, _with_attention(cluster, how), layout,
                                       ex.batch, ex.loss_fn)
                      for how in ("fused", "unfused"))
    b, h, s, layers = 1, 4, 256, 2
    assert unfused.memory["activations"] - fused.memory["activations"] \
        >= layers * 2 * b * h * s * s * 2
    assert unfused.step_time_s > fused.step_time_s
    assert unfused.flops_per_step == pytest.approx(fused.flops_per_step, rel=1e-6)
    assert ("costed as the fused kernel" in fused.tracing) == (attention == "eager")
    assert "fused kernel" not in unfused.tracing


def test_unfused_sdpa_is_traced_as_its_matmuls_and_softmax():
    ex = gpt2(layers=2, dropout=0.1)
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn, kernels="gpu", attention="unfused")
    assert not _attention_nodes(tg)
    softmaxes = [n for n in tg.call_nodes() if n.target == torch.ops.aten._softmax.default]
    assert len(softmaxes) == 2
    masks = [n for n in tg.call_nodes() if n.target == torch.ops.aten.bernoulli_.float
             and n.meta[M.VAL].dtype == torch.bool and n.meta[M.VAL].dim() == 4]
    assert len(masks) == 2  # attention's dropout, one bool mask per block


def test_a_bad_attention_kind_names_the_field():
    device = autopar.ClusterSpec.preset("dgx-h100").device.model_dump()
    with pytest.raises(ClusterSpecError, match="attention"):
        DeviceSpec(**{**device, "attention": "flash"})


def test_the_attention_kernels_efficiency_is_the_devices_when_given():
    """`device.attention_efficiency` prices the fused attention kernels (forward and
    backward) at that fraction of peak; other ops keep Efficiency.compute; a GPT-2
    estimate's step grows by what its attention kernels take longer."""
    from autopar.costs import DEFAULT_EFFICIENCY, kernel_time

    cluster = autopar.ClusterSpec.preset("dgx-a100-80gb")
    slow = _with_attention(cluster, "fused")
    slow = slow.model_copy(update={"device": slow.device.model_copy(
        update={"attention_efficiency": DEFAULT_EFFICIENCY.compute / 2})})
    for target in ("_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_flash_attention_for_cpu_backward"):
        assert kernel_time(target, 1e15, 1.0, 0, "bf16", slow) == pytest.approx(
            2 * kernel_time(target, 1e15, 1.0, 0, "bf16", cluster))
    assert kernel_time("mm", 1e15, 1.0, 0, "bf16", slow) == \
        kernel_time("mm", 1e15, 1.0, 0, "bf16", cluster)
    ex = gpt2(layers=2, hidden=256, heads=4, vocab=64, seq=1024)
    layout = autopar.Layout(dp=8, amp="bf16")
    fast, slower = (autopar.estimate(ex.model, c, layout, ex.batch, ex.loss_fn)
                    for c in (cluster, slow))
    assert slower.step_time_s > fast.step_time_s
    with pytest.raises(ClusterSpecError, match="attention_efficiency"):
        DeviceSpec(**{**cluster.device.model_dump(), "attention_efficiency": 1.5})


def test_the_tp_solver_prices_the_scores_of_unfused_attention(monkeypatch):
    """GPT-2 on tp=8 with its fused q/k/v projection split plainly by columns (no value
    offered in pieces, so q, k and v must be gathered to split by heads): with fused
    attention the solver runs sdpa whole on every rank (gathering q, k, v costs more
    than the cheap kernel saves); on a cluster without fused attention it prices the
    b h s^2 scores too, and splits the attention by heads."""
    from autopar.compiler.passes import tp_solver

    monkeypatch.setattr(tp_solver, "strided_demand", lambda graph, tp: {})
    ex = gpt2(layers=1, hidden=256, heads=8, vocab=64, seq=1024, batch=2)
    cluster = autopar.ClusterSpec.preset("dgx-a100-80gb")
    whole = {}
    for how in ("fused", "unfused"):
        tg = trace_train_step(ex.model, ex.batch, ex.loss_fn, kernels="gpu", attention=how)
        _, results = autopar.run_passes(tg, autopar.Layout(tp=8), _with_attention(cluster, how),
                                        passes=["tensor_parallel"])
        whole[how] = [what for what, _ in results[0].declined if what.startswith("attention")]
    assert len(whole["fused"]) == 1 and not whole["unfused"]
