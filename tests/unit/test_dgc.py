"""DGC (Layout.dgc): the ramp-up schedule, top-k (exact and the sampled threshold), the
layout's and optimizer's bad values, the compressed steps' passes, its cost and bytes,
and the planner's `allow`. The multi-process results are tests/dist/cases_dgc.py."""

import pytest
import torch

import autopar
from autopar.compiler.passes.defaults import default_passes
from autopar.compiler.planner.cost_model import DGC_KEY
from autopar.compiler.planner.plan import PlanArgumentError
from autopar.costs import DGC_DENSE_BELOW, dgc_compressed, dgc_kept
from autopar.examples import gpt2
from autopar.layout import LayoutError
from autopar.runtime.dgc import (
    check_optimizer,
    compress,
    ramp_stages,
    sparsity_at,
    top_k,
)
from tests.unit.test_local_sgd import _slow_cluster


def test_the_ramp_up_goes_through_the_papers_stages():
    assert ramp_stages(0.999) == [0.75, 0.9375, 0.984375, 1 - 0.25 ** 4]
    assert ramp_stages(0.9) == [0.75]
    assert ramp_stages(0.5) == []
    # 2 dense steps, then 8 ramp-up steps over 4 stages (2 each), then 0.999
    got = [sparsity_at(t, 0.999, 2, 8) for t in range(12)]
    assert got == [None, None, 0.75, 0.75, 0.9375, 0.9375, 0.984375, 0.984375,
                   1 - 0.25 ** 4, 1 - 0.25 ** 4, 0.999, 0.999]
    assert sparsity_at(0, 0.99, 0, 0) == 0.99  # no ramp-up: the final sparsity at once


def test_kept_counts_and_which_tensors_are_compressed():
    assert dgc_kept(1000, 0.999) == 1 and dgc_kept(4096, 0.99) == 40
    assert dgc_kept(1 << 20, 0.999) == 1048  # 8k bytes: >= 500x fewer than 4n
    assert dgc_kept(4096, 1e-9) == 4096  # under one element unsent: all of it
    assert dgc_kept(10, 0.999) == 1 and dgc_kept(4, 0.75) == 1 and dgc_kept(8, 0.75) == 2
    assert dgc_compressed(DGC_DENSE_BELOW, 4) and not dgc_compressed(DGC_DENSE_BELOW - 1, 4)
    assert not dgc_compressed(1 << 20, 2)  # bf16: summed dense


@pytest.mark.parametrize("n, sparsity", [(5000, 0.99), (1 << 16, 0.999), (300_000, 0.9)])
def test_the_sampled_threshold_selects_the_exact_top_k(n, sparsity):
    gen = torch.Generator().manual_seed(n)
    magnitude = torch.randn(n, generator=gen).abs()
    k = dgc_kept(n, sparsity)
    exact, _ = top_k(magnitude, k, "exact")
    sampled, fell_back = top_k(magnitude, k, "sampled", torch.Generator().manual_seed(1))
    assert sampled.numel() == k and sampled.unique().numel() == k
    assert set(sampled.tolist()) == set(exact.tolist())
    assert not fell_back


def test_the_sampled_threshold_falls_back_when_the_sample_misleads():
    """The sampled positions (drawn again from the same seed) hold the largest values:
    the threshold lands above the k-th value, too few pass it, and the exact top-k runs."""
    n, k = 100_000, 2_000
    sampled = torch.randint(n, (1000,), generator=torch.Generator().manual_seed(3))
    magnitude = torch.rand(n, generator=torch.Generator().manual_seed(4))
    magnitude[sampled] = 10 + torch.arange(sampled.numel(), dtype=torch.float32)
    idx, fell_back = top_k(magnitude, k, "sampled", torch.Generator().manual_seed(3))
    assert fell_back
    assert set(idx.tolist()) == set(top_k(magnitude, k, "exact")[0].tolist())


def test_error_feedback_conserves_integer_gradients_exactly():
    """With momentum 1 and integer-valued gradients every sum is exact: what was sent
    plus what stays in v equals everything u carried into v, element for element."""
    gen = torch.Generator().manual_seed(0)
    u, v = torch.zeros(3000), torch.zeros(3000)
    sent, accumulated = torch.zeros(3000), torch.zeros(3000)
    for step in range(12):
        g = torch.randint(-50, 50, (3000,), generator=gen).float()
        u_before = u.clone()
        idx, values, _ = compress(g, u, v, 1.0, 30, "sampled" if step % 2 else "exact",
                                  torch.Generator().manual_seed(step))
        accumulated += u_before + g  # u = m u + g with m = 1, before masking
        sent.index_add_(0, idx, values)
        assert torch.equal(sent + v, accumulated)
        assert torch.equal(u[idx], torch.zeros(30))  # momentum factor masking


def test_all_values_without_masking_is_the_dense_momentum_exchange():
    """k = numel, masking off: the ranks' sent values sum to the momentum buffer of SGD
    on the summed gradient (Σ u_r = m Σ u_r + Σ g_r), step after step."""
    gen = torch.Generator().manual_seed(1)
    ranks, n, m = 3, 2000, 0.9
    us, vs = [torch.zeros(n) for _ in range(ranks)], [torch.zeros(n) for _ in range(ranks)]
    buf = torch.zeros(n)
    for _ in range(5):
        gs = [torch.randn(n, generator=gen) for _ in range(ranks)]
        buf = m * buf + sum(gs)
        total = torch.zeros(n)
        for g, u, v in zip(gs, us, vs):
            idx, values, _ = compress(g, u, v, m, n, masking=False)
            total.index_add_(0, idx, values)
            assert not v.any()  # everything was sent
        torch.testing.assert_close(total, buf, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fields, words", [
    ({"dp": 2, "dgc": 1.0}, r"Layout.dgc .* must be a number in \(0, 1\)"),
    ({"dp": 2, "dgc": 0}, "must be a number in"),
    ({"dgc": 0.99}, "needs dp > 1"),
    ({"dp": 2, "dgc": 0.99, "zero": 1}, "use zero=0"),
    ({"dp": 2, "dgc": 0.99, "local_sgd": 2}, "choose one"),
    ({"dp": 2, "pp": 2, "dgc": 0.99, "dgc_clip": 1.0}, r"use dgc_clip=None, or tp=pp=1"),
    ({"dp": 2, "dgc": 0.99, "amp": "fp16"}, "use amp='bf16' or 'off'"),
    ({"dp": 2, "dgc_warmup": 3}, r"^Layout.dgc_warmup only with Layout.dgc "),
    ({"dp": 2, "dgc_rampup": 3, "dgc_clip": 1.0, "dgc_topk": "sampled"},
     r"^Layout.dgc_rampup, Layout.dgc_clip and Layout.dgc_topk only with Layout.dgc "),
    ({"dp": 2, "dgc": 0.99, "dgc_rampup": -1}, r"Layout.dgc_rampup must be an integer >= 0"),
    ({"dp": 2, "dgc": 0.99, "dgc_clip": 0}, "dgc_clip .* must be a number > 0"),
    ({"dp": 2, "dgc": 0.99, "dgc_topk": "approx"}, r"Layout.dgc_topk must be one of"),
])
def test_bad_dgc_layouts_name_the_field(fields, words):
    with pytest.raises(LayoutError, match=words):
        autopar.Layout(**fields)


@pytest.mark.parametrize("factory, words", [
    (lambda p: torch.optim.AdamW(p), "built AdamW"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "momentum=0"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "nesterov=True"),
])
def test_dgc_refuses_an_optimizer_it_cannot_correct(factory, words):
    with pytest.raises(LayoutError, match=words):
        check_optimizer(factory([torch.nn.Parameter(torch.zeros(2))]))


def test_the_compressed_program_keeps_the_global_loss_mean_and_sums_nothing():
    names = [p.name for p in default_passes(autopar.Layout(dp=2, dgc=0.999))]
    assert "insert_allreduce" not in names and "global_loss_mean" in names
    assert autopar.Layout(dp=2, dgc=0.99, dgc_warmup=3).synchronous() == autopar.Layout(dp=2)


def test_the_cost_prices_the_sparse_bytes_and_the_selection():
    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    cluster = _slow_cluster()
    kw = {"optimizer": "sgd-momentum"}
    flat = autopar.estimate(ex.model, cluster, autopar.Layout(dp=4), ex.batch, ex.loss_fn, **kw)
    dgc = autopar.estimate(ex.model, cluster, autopar.Layout(dp=4, dgc=0.999), ex.batch,
                           ex.loss_fn, **kw)
    exact_sum = sum(p.numel() * 4 for p in ex.model.parameters())
    assert flat.comm_bytes["dp"] >= exact_sum
    dense = sum(p.numel() * 4 for p in ex.model.parameters() if p.numel() < DGC_DENSE_BELOW)
    sparse = 4 * 2 * 4 * sum(dgc_kept(p.numel(), 0.999) for p in ex.model.parameters()
                             if p.numel() >= DGC_DENSE_BELOW)  # 4 ranks' values + indices
    assert dgc.comm_bytes == {"dp": dense + 4, DGC_KEY: sparse}
    assert sum(dgc.comm_bytes.values()) < 0.05 * flat.comm_bytes["dp"]
    assert dgc.uncompressed_bytes == exact_sum and flat.uncompressed_bytes == 0
    assert dgc.step_time_s < flat.step_time_s
    # the selection's time is in the update, over SGD's own on the dense tensors
    assert dgc.breakdown["optimizer"] > flat.breakdown["optimizer"]
    # u and v of every compressed tensor, where SGD holds one momentum buffer
    assert dgc.peak_memory_bytes > flat.peak_memory_bytes


def test_the_plan_uses_dgc_only_when_allowed_and_with_sgd_momentum():
    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    cluster = _slow_cluster()
    kw = {"optimizer": "sgd-momentum", "tp": 1, "pp": 1, "amp": "off"}
    plain = autopar.plan(ex.model, cluster, ex.batch, ex.loss_fn, **kw)
    every = [plain.layout, *[lay for lay, _, _ in plain.alternatives],
             *[lay for lay, _ in plain.skipped]]
    assert all(lay.dgc is None for lay in every)
    allowed = autopar.plan(ex.model, cluster, ex.batch, ex.loss_fn, allow=["dgc"], **kw)
    assert allowed.layout.dgc == 0.999 and allowed.layout.zero == 0, allowed.layout
    assert allowed.predicted.step_time_s < plain.predicted.step_time_s
    from autopar.compiler.planner.report import headline
    line = next(x for x in headline(allowed) if x.startswith("DGC:"))
    assert "summing every gradient whole" in line and "is not modelled" in line
    assert "Layout(dp=4" in line  # the step of the layout it was derived from
    with pytest.raises(PlanArgumentError, match="plan with optimizer='sgd-momentum'"):
        autopar.plan(ex.model, cluster, ex.batch, ex.loss_fn, allow=["dgc"], optimizer="adamw")


@pytest.mark.parametrize("fields", [{"dgc": 0.999}, {"local_sgd": 4}])
def test_a_pipeline_prices_dgc_and_local_sgd_in_place_of_its_dp_all_reduce(fields):
    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    cluster = _slow_cluster(12.5e6)  # 100 Mbit/s between the nodes: dp crosses it
    kw = {"optimizer": "sgd-momentum"}
    layout = autopar.Layout(dp=4, microbatches=2)  # the pipeline runtime: accumulation
    sync = autopar.estimate(ex.model, cluster, layout, ex.batch, ex.loss_fn, **kw)
    cheaper = autopar.estimate(ex.model, cluster, layout.replace(**fields), ex.batch,
                               ex.loss_fn, **kw)
    assert cheaper.step_time_s < sync.step_time_s
    assert cheaper.breakdown["compute"] == pytest.approx(sync.breakdown["compute"], rel=0.05)
