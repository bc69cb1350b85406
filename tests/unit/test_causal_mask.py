"""A causal mask a model builds from constants is given back to attention as `is_causal`
(ir/causal_mask.py), as eager PyTorch runs it; every other mask stays, with the reason."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from autopar.compiler.ir.causal_mask import SDPA, recover_causal_masks
from autopar.compiler.ir.trace import trace_train_step
from autopar.examples import gpt2, hf_tiny, llama
from tests.unit.test_trace import eager_grads, run_graph

B, H, S, D = 2, 2, 6, 4
ATTENTIONS = ("_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention_for_cpu_backward")


def attention_calls(tg):
    """(is_causal, attn_mask) of every attention op of the joint graph, forward and
    backward."""
    calls = []
    for node in tg.gm.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if name in ATTENTIONS:
            schema = [a.name for a in node.target._schema.arguments]
            args = dict(zip(schema, node.args)) | dict(node.kwargs)
            calls.append((args.get("is_causal", False), args.get("attn_mask")))
    return calls


def assert_matches_eager(tg, ex):
    outs = run_graph(tg, ex.model, ex.batch)
    loss, grads = eager_grads(ex.model, ex.batch, ex.loss_fn)
    torch.testing.assert_close(outs[0], loss, rtol=1e-6, atol=0)
    for i, spec in enumerate(tg.signature.params):
        torch.testing.assert_close(outs[1 + i], grads[spec.name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("factory", [gpt2, llama, lambda: hf_tiny("qwen2", batch=2, seq=16)],
                         ids=["gpt2", "llama", "qwen2"])
def test_transformers_causal_mask_is_attention_is_causal_as_eager_runs_it(factory):
    """Traced, transformers builds its causal mask (arange, cumsum, index, where) and
    passes it to every layer; eager passes is_causal=True and no mask. The joint graph
    runs what eager runs: no mask, no mask arithmetic, and the same loss and gradients."""
    ex = factory()
    tg = trace_train_step(ex.model, ex.batch, ex.loss_fn)
    calls = attention_calls(tg)
    layers = ex.model.config.num_hidden_layers
    assert len(calls) == 2 * layers  # a forward and a backward per layer
    assert all(causal and mask is None for causal, mask in calls)
    assert tg.attrs["causal_masks"] == {"recovered": layers, "left": []}
    ops = {getattr(n.target, "__name__", "") for n in tg.gm.graph.nodes}
    assert not {"cumsum.default", "bitwise_and.Tensor", "where.self"} & ops  # the mask's
    assert_matches_eager(tg, ex)


def test_a_padding_mask_from_the_batch_stays():
    """A mask computed from the step's input (padding) is the batch's, not a constant."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                       use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (2, 8))
    attention = torch.ones(2, 8, dtype=torch.long)
    attention[1, 5:] = 0

    def loss_fn(out, ids, attention_mask):
        return out.logits.float().mean()

    class WithMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, attention_mask):
            return self.model(ids, attention_mask=attention_mask)

    wrapped = WithMask()
    tg = trace_train_step(wrapped, (ids, attention), loss_fn)
    assert not any(causal for causal, _ in attention_calls(tg))
    left = tg.attrs["causal_masks"]["left"]
    assert tg.attrs["causal_masks"]["recovered"] == 0 and len(left) == 2
    assert all("depends on the step's input or state" in why for _, why in left)
    outs = run_graph(tg, wrapped, (ids, attention))
    loss, grads = eager_grads(wrapped, (ids, attention), loss_fn)
    torch.testing.assert_close(outs[0], loss, rtol=1e-6, atol=0)
    for i, spec in enumerate(tg.signature.params):
        torch.testing.assert_close(outs[1 + i], grads[spec.name], rtol=1e-5, atol=1e-6)


MASKS = {
    # name: (mask built from constants inside forward, is it causal)
    "bool_tril": (lambda: torch.ones(S, S, dtype=torch.bool).tril(), True),
    "float_triu_inf": (lambda: torch.full((S, S), -math.inf).triu(1), True),
    "bool_batched": (lambda: torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S), True),
    "window": (lambda: torch.ones(S, S, dtype=torch.bool).tril() & ~torch.ones(
        S, S, dtype=torch.bool).tril(-3), False),
    "strict": (lambda: torch.ones(S, S, dtype=torch.bool).tril(-1) | torch.eye(
        S, dtype=torch.bool).flip(0), False),
    "float_lowest": (lambda: torch.full((S, S), torch.finfo(torch.float32).min).triu(1), True),
    "float_finite": (lambda: torch.full((S, S), -1e9).triu(1), False),
    # batch rows computed by ops (a clone, an & with a batch of ones): alike, causal
    "batch_rows_alike": (lambda: (torch.arange(S)[None, :] <= torch.arange(S)[:, None]).expand(
        B, 1, S, S).clone() & torch.ones(B, 1, 1, 1, dtype=torch.bool), True),
    # tensors made from literals (export lifts each to an input of its own): constants
    "literal_offset": (lambda: torch.arange(S)[None, :] <= torch.arange(S)[:, None]
                       + torch.tensor(0), True),
    "literal_shifted": (lambda: torch.arange(S)[None, :] <= torch.arange(S)[:, None]
                        + torch.tensor([1]), False),
    # causal in batch row 0, row 1 without its diagonal: every row is checked
    "batch_rows_differ": (lambda: torch.ones(S, S, dtype=torch.bool).tril() & ~(
        (torch.arange(B).view(B, 1, 1, 1) == 1) & torch.eye(S, dtype=torch.bool)), False),
}


class MaskedAttention(torch.nn.Module):
    def __init__(self, make_mask):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * H * D)
        self.make_mask = make_mask

    def forward(self, x):
        q, k, v = (t.view(B, S, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask())
        return out.square().mean()


@pytest.mark.parametrize("name", list(MASKS))
def test_only_the_exact_causal_pattern_is_recovered(name):
    """Masks written as models write them: the causal ones (bool or additive -inf, any
    broadcast, -inf or the dtype's lowest value) become is_causal; a sliding window, a
    different diagonal, or another finite fill (-1e9: only the exact pattern is taken)
    stay. Either way the joint
    graph computes what eager does."""
    make, causal = MASKS[name]
    torch.manual_seed(0)
    model = MaskedAttention(make)
    x = torch.randn(B, S, D)
    tg = trace_train_step(model, (x,), None)
    calls = attention_calls(tg)
    if causal:
        assert tg.attrs["causal_masks"] == {"recovered": 1, "left": []}
        assert all(c and m is None for c, m in calls)
    else:
        assert tg.attrs["causal_masks"]["recovered"] == 0
        assert tg.attrs["causal_masks"]["left"][0][1] == "its value is not the causal pattern"
        assert all(not c and m is not None for c, m in calls)
    outs = run_graph(tg, model, (x,))
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    torch.testing.assert_close(outs[0], loss.detach(), rtol=1e-6, atol=0)
    for i, spec in enumerate(tg.signature.params):
        torch.testing.assert_close(outs[1 + i], dict(model.named_parameters())[spec.name].grad,
                                   rtol=1e-5, atol=1e-6)


def test_the_exported_graph_is_not_changed():
    """recover_causal_masks works on a copy: the exported graph other passes read stays."""
    model = MaskedAttention(MASKS["bool_tril"][0])
    ep = torch.export.export(model, (torch.randn(B, S, D),))
    before = ep.graph_module.code
    gm, result = recover_causal_masks(ep.graph_module)
    assert result.causal == 1 and gm is not ep.graph_module
    assert ep.graph_module.code == before
    (node,) = [n for n in gm.graph.nodes if n.target is SDPA]
    assert node.kwargs["is_causal"] is True and node.kwargs["attn_mask"] is None


def test_a_mask_over_the_evaluation_budget_stays_with_its_size(monkeypatch):
    """The budget is in bytes of the largest value the mask's computation allocates. A
    constant mask's batch rows are alike, so the evaluation keeps one row of each value
    that is equal along a dimension, and runs an elementwise op on one row: GPT-2's
    bool mask of batch x 1 x 32 x 32 allocates one row, 32 x 32 bytes, whatever the
    batch. Under the budget the mask is recovered; over it, the mask stays and the
    reason names the value and its size."""
    import autopar.compiler.ir.causal_mask as C

    def traced(budget: int, batch: int = 2):
        monkeypatch.setattr(C, "EVALUATION_BUDGET", budget)
        ex = gpt2(layers=1, batch=batch, seq=32)
        gm = torch.export.export(ex.model, ex.batch).graph_module
        return recover_causal_masks(gm)[1]

    assert traced(32 * 32).causal == 1
    # 64 rows: the whole mask is 64 x 32 x 32 bytes, the largest value allocated the
    # positions gathered per row (int64, 64 x 32), and the mask's ops run on one row
    assert traced(64 * 32 * 8, batch=64).causal == 1
    left = traced(32 * 32 - 1)
    assert left.causal == 0 and len(left.left) == 1
    assert "1,024 bytes (more than 1,023)" in left.left[0][1]
