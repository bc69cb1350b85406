"""The fusion pass: golden rewrite, fallback bit-identity, what fuses on GPT-2, visible
declines, and whole-model parity with the Triton kernels (interpreter) against eager."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.api import run_passes
from autopar.compiler.codegen.kernels import FUSED_OP, backend, region
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.printing import graph_text
from autopar.compiler.passes.fuse_regions import FUSED_OPS, FuseRegions
from autopar.examples import gpt2, llama
from autopar.testing import compare, reference_train

aten = torch.ops.aten


class Block(torch.nn.Module):
    """Linear -> tanh-GELU -> residual add + layer norm: two fusable chains around a matmul."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(F.gelu(self.fc(x), approximate="tanh") + x)


def _mse(out, x):
    return (out * out).mean()


def _fused(tg):
    return [n for n in tg.call_nodes() if n.target == FUSED_OP]


def _fuse(model, batch, loss_fn, **layout):
    tg = autopar.trace(model, batch, loss_fn)
    out, results = run_passes(tg, autopar.Layout(fusion=True, **layout))
    return tg, out, results[-1]


def _ops(node):
    return [str(n.target).removeprefix("aten.").removesuffix(".default").replace(
        "<built-in function getitem>", "getitem")
        for n in region(node.args[0]).gm.graph.nodes if n.op == "call_function"]


def test_golden_block():
    """Forward: GELU + residual add + layer norm + the loss's square, one kernel after the
    matmul; backward: the loss gradient, layer-norm and GELU backwards, one kernel."""
    tg, out, result = _fuse(Block(), (torch.randn(4, 8),), _mse)
    ops = [n.target for n in out.call_nodes() if n.target is not operator.getitem]
    assert ops[:3] == [aten.t.default, aten.addmm.default, FUSED_OP], ops
    forward, backward = _fused(out)
    assert _ops(forward) == ["gelu", "add.Tensor", "native_layer_norm", "getitem", "getitem",
                             "getitem", "mul.Tensor"]
    assert _ops(backward) == ["div.Scalar", "mul.Tensor", "mul.Tensor", "add.Tensor",
                              "native_layer_norm_backward", "getitem", "getitem", "getitem",
                              "gelu_backward"]
    assert result.stats["kernels"] == 2 and result.stats["ops_fused"] == 10
    # the bias gradient sums over rows (dim 0): declined, with the reason
    assert result.declined == [("1 op(s)", "reduces dims [0] of a 2-d tensor (emitted: the last "
                                "dim only)")]


def test_fallback_is_bit_identical_and_graph_verifies():
    x = torch.randn(4, 8)
    tg, out, _ = _fuse(Block(), (x,), _mse)
    params = [p.detach() for p in Block().parameters()]
    with backend("eager"):
        got = out.gm(*params, x)
    want = tg.gm(*params, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert "fused" in out.provides and out.history[-1] == "fusion"


def test_fusion_off_changes_nothing():
    tg = autopar.trace(Block(), (torch.randn(4, 8),), _mse)
    out, result = FuseRegions().run(tg, autopar.compiler.passes.base.PassContext())
    assert out is tg and not result.changed and result.declined == [("fusion", "Layout.fusion=False")]


def test_gpt2_norms_and_gelu_are_one_kernel_forward_and_backward():
    ex = gpt2(layers=2, batch=2, seq=8)
    tg, out, _ = _fuse(ex.model, ex.batch, ex.loss_fn)
    before = {n.name: n for n in tg.call_nodes()}
    kernels_of: dict[tuple[str, bool], set[str]] = {}
    for node in _fused(out):
        for name in node.meta[FUSED_OPS]:
            old = before[name]
            key = (old.meta[M.MODULE_PATH], old.meta[M.ROLE] == M.Role.BACKWARD)
            kernels_of.setdefault(key, set()).add(node.name)
    chains = [p for p in {n.meta[M.MODULE_PATH] for n in tg.call_nodes()}
              if p and (p.endswith(("ln_1", "ln_2", "ln_f")) or p.endswith("mlp.act"))]
    assert len(chains) == 2 * 3 + 1
    for path in chains:
        for backward in (False, True):
            assert len(kernels_of.get((path, backward), ())) == 1, (path, backward, kernels_of)
    left = [n for n in out.call_nodes() if n.meta[M.MODULE_PATH] in chains
            and n.target in (aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
                             aten.tanh.default, aten.tanh_backward.default, aten.pow.Tensor_Scalar)]
    assert left == []


def test_unsupported_ops_are_declined_visibly():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 6)

        def forward(self, x):  # pow 5 has no lowering; the column sum is not a row reduction
            y = self.fc(x)
            return torch.pow(y, 5).sum(0) * 2.0 + y.exp().mean(0)

    _, out, result = _fuse(Odd(), (torch.randn(3, 6),), lambda o, x: o.sum())
    reasons = " ".join(why for _, why in result.declined)
    assert "exponent 5" in reasons and "reduces dims [0]" in reasons, result.declined
    assert all(n.target != aten.pow.Tensor_Scalar or n.args[1] == 5 for n in out.call_nodes())


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_parity_with_triton_kernels(factory):
    """transformers models unmodified, kernels run by Triton's interpreter, 2 steps of SGD
    against eager PyTorch: loss and every weight."""
    ex = factory(layers=1, batch=2, seq=8)
    init = {k: v.clone() for k, v in ex.model.state_dict().items()}
    batches = ex.batches(2)
    step = autopar.compile(copy.deepcopy(ex.model), None, ex.batch, ex.loss_fn, optimizer=_sgd,
                           layout=autopar.Layout(fusion=True))
    assert step.pass_results[-1].stats["kernels"] >= 5
    with backend("triton"):
        losses = [float(step(*b)) for b in batches]
    keys = [n.args[0] for n in step.program.gm.graph.nodes if n.target == FUSED_OP]
    assert keys and all(region(k)._kernels for k in keys)  # the Triton kernels did run
    ref_losses, ref_state = reference_train(ex.model, batches, ex.loss_fn, _sgd)
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)
    assert losses != [float(step(*b)) for b in batches[:1]] * 2  # the weights did move


def test_getitem_of_an_unfused_op_is_not_fused():
    ex = gpt2(layers=1, batch=2, seq=8)
    _, out, _ = _fuse(ex.model, ex.batch, ex.loss_fn)
    for node in _fused(out):
        for inp in node.args[1]:
            if inp.target is operator.getitem:
                assert inp.args[0].target != FUSED_OP or inp.args[0] is not node
