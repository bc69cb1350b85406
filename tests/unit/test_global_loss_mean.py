"""global_loss_mean: a loss divided by a count the batch decides divides by the global
batch's count. Checked in one process by running the rewritten step on each shard of a
batch and averaging, as dp ranks and micro-batches do, against eager PyTorch on the
whole batch."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir.batch import LOSS_NORM_INPUT, Objective, normalizer_means
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.passes.batch_split import BatchSplitError

aten = torch.ops.aten


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _masked_mean(out, y):
    mask = y != -100
    picked = torch.log_softmax(out, -1).gather(-1, y.clamp(min=0)[:, None])[:, 0]
    return -(picked * mask).sum() / mask.sum().clamp(min=1)


LOSSES = {
    "mean": lambda out, y: F.cross_entropy(out, y),
    "class_weights": lambda out, y: F.cross_entropy(out, y, weight=torch.arange(1., 6.)),
    "label_smoothing": lambda out, y: F.cross_entropy(out, y, label_smoothing=0.2),
    "sum_over_count": lambda out, y: F.cross_entropy(out, y, reduction="sum") / (y != -100).sum(),
    "masked_mean": _masked_mean,
    # a function of the count's sum alone: applied to the batch's sum (LossNormalizer)
    "over_count_plus_epsilon": lambda out, y: F.cross_entropy(out, y, reduction="sum")
    / ((y != -100).sum() + 1e-6),
    "over_twice_the_count": lambda out, y: F.cross_entropy(out, y, reduction="sum")
    / ((y != -100).sum() * 2).clamp(min=1),
    # sums over the batch: the step scales each shard's loss by the number of shards
    "sum": lambda out, y: F.cross_entropy(out, y, reduction="sum"),
    "sum_of_sums": lambda out, y: F.cross_entropy(out, y, reduction="sum") + 0.1 * out.square().sum(),
}


@functools.lru_cache(maxsize=None)
def _rewritten_cached(loss, shards):
    """The graph depends on shapes only: one trace per loss and shard count."""
    return _rewritten(LOSSES[loss], torch.zeros(8, 6), torch.zeros(8, dtype=torch.long),
                      shards=shards)


def _rewritten(loss_fn, x, y, passes=("global_loss_mean",), shards=2, **layout):
    model = Net()
    tg = autopar.trace(model, (x[:len(x) // shards],), loss_fn,
                       example_targets=(y[:len(y) // shards],))
    new, results = autopar.run_passes(tg, autopar.Layout(dp=shards, **layout),
                                      passes=list(passes))
    return model, new, {r.name: r for r in results}


def _sharded_step(model, tg, x, y, shards):
    """The loss and gradients of the rewritten graph averaged over shards."""
    params = [p.detach() for p in model.parameters()]
    counts = normalizer_means(tg.loss_normalizers, (x, y), (0, 0), shards)
    n = len(x) // shards
    outs = [tg.gm(*params, x[k * n:(k + 1) * n], y[k * n:(k + 1) * n], *counts)
            for k in range(shards)]
    loss = sum(o[0] for o in outs) / shards
    grads = [sum(o[1 + i] for o in outs) / shards for i in range(len(params))]
    return loss, grads


def _eager(model, loss_fn, x, y):
    loss = loss_fn(model(x), y)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(loss=st.sampled_from(sorted(LOSSES)), shards=st.sampled_from([2, 4]),
       ignored=st.lists(st.booleans(), min_size=8, max_size=8))
def test_sharded_step_equals_the_whole_batch(loss, shards, ignored):
    """Whatever targets are ignored (a shard with none left included), the average over
    shards of the rewritten step is eager PyTorch's loss and gradients on the batch."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    if all(ignored):
        ignored[0] = False  # the whole batch ignored is 0/0 in eager PyTorch too
    y[torch.tensor(ignored)] = -100
    model, tg, results = _rewritten_cached(loss, shards)
    assert results["global_loss_mean"].changed
    got_loss, got_grads = _sharded_step(model, tg, x, y, shards)
    ref_loss, ref_grads = _eager(model, LOSSES[loss], x, y)
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, ref in zip(got_grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_without_the_pass_uneven_shards_differ():
    """The reference really differs from a per-shard mean: the property above could fail."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    y[:3] = -100
    model, tg, _ = _rewritten(LOSSES["mean"], x, y, passes=())
    got_loss, _ = _sharded_step(model, tg, x, y, 2)
    ref_loss, _ = _eager(model, LOSSES["mean"], x, y)
    assert abs(got_loss - ref_loss) > 1e-3


def test_golden_nll_sums_and_its_backward_divides_by_the_input():
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    _, tg, results = _rewritten(LOSSES["mean"], x, y)
    names = [p.name for p in tg.placeholders()]
    assert names[-1] == f"{LOSS_NORM_INPUT}_0" and tg.signature.inputs[-1].shape == ()
    assert tg.signature.batch_dims[-1] is None
    nll = next(n for n in tg.call_nodes() if n.target == aten.nll_loss_forward.default)
    assert nll.args[3] == 2  # sums over the shard
    backward = next(n for n in tg.call_nodes() if n.target == aten.nll_loss_backward.default)
    assert backward.args[6].name == f"{LOSS_NORM_INPUT}_0"
    assert results["global_loss_mean"].stats["normalizers"] == 1


def test_a_ratio_of_the_batch_is_refused_naming_the_op():
    """A mean of the batch does not add up over shards: no step on shards is the batch's,
    so the pass refuses it (passes/batch_split.py) rather than divide per shard."""
    def per_ratio(out, y):
        return F.cross_entropy(out, y, reduction="sum") / (y > 2).float().mean()
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    with pytest.raises(BatchSplitError, match=r"aten.div.Tensor in the loss function: samples "
                                              r"of different shards meet here.* \(a part of a "
                                              r"sum over the batch, a part of a mean over"):
        _rewritten(per_ratio, x, y)


@pytest.mark.parametrize("divisor", [lambda y: y.float().amax().clamp(min=1),
                                     lambda y: (y != -100).float().mean() + 1,
                                     lambda y: (y != -100).sum() * (y > 2).sum()])
def test_a_divisor_that_is_no_sum_of_the_batch_is_refused(divisor):
    """A maximum, a mean, a product of counts: the check lets them pass as data of the
    batch, but no divisor per shard makes the shards' average the batch's loss."""
    def loss(out, y):
        return F.cross_entropy(out, y.clamp(min=0), reduction="sum") / divisor(y)
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    # refused by the pass (a value that is no function of a sum) or by the analysis
    # before it (a sum over a mean of the batch)
    with pytest.raises(BatchSplitError, match=r"samples of different shards meet here, so the "
                                              r"step does not split along the batch: (the loss "
                                              r"divides by .*, a value of the batch that is not "
                                              r"a function of a sum over it|aten.div.Tensor "
                                              r"takes \(a part of a sum over the batch, a part "
                                              r"of a mean over the batch\))"):
        _rewritten(loss, x, y)


def test_a_regression_loss_over_a_count_of_its_targets():
    """`mse_loss` broadcasts the output with the targets in the exported forward, and the
    count then reads the broadcast targets: still a count of the data, taken over the
    whole batch, the shards' step equal to the batch's."""
    def loss_fn(out, y):
        return F.mse_loss(out, y, reduction="sum") / (y > 0).sum()
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)
    y[:3] = -1.0  # the first shard counts fewer targets than the second
    model, tg, results = _rewritten(loss_fn, x, y)
    assert results["global_loss_mean"].stats["normalizers"] == 1
    got_loss, got_grads = _sharded_step(model, tg, x, y, 2)
    ref_loss, ref_grads = _eager(model, loss_fn, x, y)
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, ref in zip(got_grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("divisor", ["tensor", "full", "ones"])
def test_a_sum_over_the_shards_size_written_as_a_tensor(divisor):
    """The shard's size as a tensor (`torch.tensor(n)`, a fill, a sum of ones), found by
    exporting the step at a second batch size: the sharded step's loss and gradients are
    the whole batch's mean over sequences, not each shard's scaled by the shards."""
    size = {"tensor": lambda n: torch.tensor(n), "full": lambda n: torch.full((), n),
            "ones": lambda n: torch.ones(n).sum()}[divisor]

    def loss_fn(out, y):
        return F.cross_entropy(out, y, reduction="sum") / size(out.shape[0])
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    model = Net()
    objective, flat = Objective.from_example((x,), (y,), loss_fn)
    tg = trace_train_step(model, [t[:4] for t in flat], objective, whole=flat)
    tg, _ = autopar.run_passes(tg, autopar.Layout(dp=2), passes=["global_loss_mean"])
    got_loss, got_grads = _sharded_step(model, tg, x, y, 2)
    ref_loss, ref_grads = _eager(model, loss_fn, x, y)
    torch.testing.assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, ref in zip(got_grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_a_sum_over_the_batch_is_scaled_by_the_shards():
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    _, tg, results = _rewritten(LOSSES["sum"], x, y, shards=4)
    assert results["global_loss_mean"].stats["divides_by"] == ["the loss, a sum over the batch (sum)"]
    (normalizer,) = tg.loss_normalizers
    # the batch's divisor is 1, so each of 4 shards divides its sum by 1/4
    assert normalizer_means(tg.loss_normalizers, (x, y), (0, 0), 4)[0].item() == 0.25
    loss = tg.loss_node()
    assert loss.target is aten.div.Tensor and loss.args[1].name == normalizer.name


def test_one_shard_is_left_alone():
    x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
    _, tg, results = _rewritten(LOSSES["mean"], x, y, shards=1)
    assert not results["global_loss_mean"].changed and not tg.loss_normalizers


def test_recomputed_copies_of_the_count_take_the_mean_too():
    """Full recomputation (before this pass) may copy the count into the backward: the
    copy must divide by the global mean as well."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 5, (8,), generator=gen)
    y[:3] = -100
    loss_fn = LOSSES["sum_over_count"]
    model, tg, _ = _rewritten(loss_fn, x, y, passes=("recompute", "global_loss_mean"),
                              recompute="full")
    got_loss, got_grads = _sharded_step(model, tg, x, y, 2)
    ref_loss, ref_grads = _eager(model, loss_fn, x, y)
    torch.testing.assert_close(got_loss, ref_loss)
    for got, ref in zip(got_grads, ref_grads):
        torch.testing.assert_close(got, ref)
