"""batch_split: where samples of different shards meet, the step does not split along the
batch, and the analysis says so, naming the op and the line; everywhere else it splits.
Each verdict is checked against arithmetic: the average of the shards' losses (what dp
and micro-batches compute) equals the whole batch's loss exactly when the analysis
accepts the step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir.batch import Objective
from autopar.compiler.ir.trace import trace_source
from autopar.compiler.passes.batch_split import MEAN, SAME, SUM, BatchSplitError, split_loss
from autopar.examples import ctr, hf_tiny
from tests.dist.cases_batch_norm import cnn

# ops that keep each sample apart, on x: [n, 6]
APART = {
    "linear": lambda m, x: m.linear(x),
    "tanh": lambda m, x: torch.tanh(x),
    "softmax_features": lambda m, x: torch.softmax(x, -1),
    "layer_norm": lambda m, x: F.layer_norm(x, (6,)),
    "views": lambda m, x: x.view(x.shape[0], 2, 3).transpose(1, 2).reshape(x.shape[0], 6),
    "pairs": lambda m, x: x.unsqueeze(1).expand(x.shape[0], 2, 6).flatten(0, 1)
    .view(x.shape[0], 2, 6).mean(1),
    "feature_scale": lambda m, x: x * torch.arange(6.0),
    "ones_per_sample": lambda m, x: x + torch.ones(x.shape[0], 1),
    "masked_fill": lambda m, x: x.masked_fill(x > 1, 0.0),
    "cumsum_features": lambda m, x: x.cumsum(-1),
    "sorted_features": lambda m, x: x.sort(-1).values,
    "gather_features": lambda m, x: x.gather(1, x.argsort(-1)),
}
# ops that let samples meet
MEET = {
    "center": lambda m, x: x - x.mean(0, keepdim=True),
    "softmax_batch": lambda m, x: torch.softmax(x, 0),
    "gram": lambda m, x: (x @ x.T) @ x / x.shape[0],
    "cumsum_batch": lambda m, x: x.cumsum(0),
    "flip_batch": lambda m, x: x.flip(0),
    "arange_rows": lambda m, x: x * torch.arange(x.shape[0])[:, None],
    "max_batch": lambda m, x: x - x.max(0).values,
    "batch_norm_by_hand": lambda m, x: x / x.std(0),
}


class Chain(torch.nn.Module):
    def __init__(self, ops):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(6, 6)
        self.ops = ops

    def forward(self, x):
        x = self.linear(x)
        for name in self.ops:
            x = {**APART, **MEET}[name](self, x)
        return x


def _mse(out, y):
    return F.mse_loss(out, y)


def _split(model, inputs, loss_fn, targets=None, shards=2):
    objective, flat = Objective.from_example(inputs, targets, loss_fn)
    local = [t[: t.shape[0] // shards] for t in flat]
    return split_loss(trace_source(model, local, objective, whole=flat))


def _form(model, inputs, loss_fn, targets=None, shards=2):
    return _split(model, inputs, loss_fn, targets, shards).form


def _shards_average_is_the_batch(model, x, y, shards=2) -> bool:
    with torch.no_grad():
        whole = _mse(model(x), y)
        n = x.shape[0] // shards
        parts = [_mse(model(x[k * n:(k + 1) * n]), y[k * n:(k + 1) * n]) for k in range(shards)]
        return torch.allclose(sum(parts) / shards, whole, rtol=1e-5, atol=1e-7)


def _batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=gen) * 2, torch.randn(8, 6, generator=gen)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(ops=st.lists(st.sampled_from(sorted(APART)), min_size=1, max_size=4))
def test_chains_that_keep_samples_apart_split(ops):
    model = Chain(ops)
    x, y = _batch(len(ops))
    assert _form(model, (x,), _mse, (y,)) == MEAN
    assert _shards_average_is_the_batch(model, x, y)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(ops=st.lists(st.sampled_from(sorted(APART)), max_size=3),
       meet=st.sampled_from(sorted(MEET)), at=st.integers(0, 3))
def test_one_op_where_samples_meet_is_refused_naming_it(ops, meet, at):
    ops = ops[:at] + [meet] + ops[at:]
    model = Chain(ops)
    x, y = _batch(len(ops))
    assert not _shards_average_is_the_batch(model, x, y)  # the refusal is warranted
    with pytest.raises(BatchSplitError, match=r"at .*test_batch_split.py:\d+: samples of "
                                              r"different shards meet here"):
        _form(model, (x,), _mse, (y,))


class Towers(torch.nn.Module):
    """In-batch negatives, as contrastive (CLIP-style) training writes them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(6, 8)

    def forward(self, x, y):
        return F.normalize(self.a(x), dim=-1) @ F.normalize(self.b(y), dim=-1).T


def test_a_shard_of_one_sample_is_checked_at_two_samples():
    """Batch dims of size 1 read as broadcast ones (a view may drop them): a shard of one
    sample is read as the step exported at two samples of the batch, so where samples
    meet it is refused as at any shard size, by compile, check and the planner."""
    x, y = _batch(0)
    model = Chain(["center"])
    for shards in (8, 4):
        with pytest.raises(BatchSplitError, match="aten.sub.Tensor at .*test_batch_split.py"):
            _split(model, (x,), _mse, (y,), shards=shards)
    split = _split(Chain(["linear"]), (x,), _mse, (y,), shards=8)
    assert split.form == MEAN and split.checked

    def in_batch_negatives(logits, x, y):
        return F.cross_entropy(logits, torch.arange(logits.shape[0]))
    layout = autopar.Layout(dp=2)
    with pytest.raises(BatchSplitError, match="aten.matmul.default at"):
        autopar.check(Towers(), (x[:2], y[:2]), in_batch_negatives, layout,
                      autopar.ClusterSpec.local(2))
    plan = autopar.plan(Towers(), autopar.ClusterSpec.local(2), (x[:2], y[:2]),
                        in_batch_negatives, workers=0)
    assert plan.layout.dp == 1 and plan.layout.microbatches == 1


class OneSampleOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.linear(x).view(1, 6) - self.linear(x).mean(0)


def test_a_shard_of_one_sample_not_exported_at_two_is_not_checked_and_says_why():
    """Where no export at two samples exists (a model written for one sample, a graph
    traced without its batch), the shard gets the loss's form, `checked` False, and
    global_loss_mean lists why among what it declined."""
    x, y = _batch(0)
    split = _split(OneSampleOnly(), (x[:2],), _mse, (y[:2, None],), shards=2)
    assert split.form == MEAN and not split.checked
    assert split.unchecked.startswith("the step does not export at two samples (")
    tg = autopar.trace(Chain(["center"]), (x[:1],), _mse, example_targets=(y[:1],))
    _, (result,) = autopar.run_passes(tg, autopar.Layout(microbatches=8), passes=["global_loss_mean"])
    assert ("samples meeting across shards", "each shard holds one sample: its batch dims of "
            "size 1 read as broadcast ones, and no batch of other sizes to export it at: "
            "not checked") in result.declined


# losses written with the shard's size: on shards of n samples the export holds n as a
# number, which the analysis tells from a constant by exporting at another size
SIZED = {
    "sum_over_samples": (lambda out, y: F.mse_loss(out, y, reduction="sum") / out.shape[0], MEAN),
    "sum_over_elements": (lambda out, y: (out - y).square().sum() / out.numel(), MEAN),
    "sum_times_inverse": (lambda out, y: F.mse_loss(out, y, reduction="sum") * (1 / len(out)),
                          MEAN),
    "mean_times_samples": (lambda out, y: F.mse_loss(out, y) * out.shape[0], SUM),
    "over_the_shards_fraction": (lambda out, y: (out - y).square().sum()
                                 / ((y > 0).sum() / y.numel()), None),
    "samples_times_mean": (lambda out, y: F.mse_loss(out, y) * out.shape[0] ** 0.5, None),
    "per_sample_scale": (lambda out, y: F.mse_loss(out * out.shape[0], y), None),
    # the size as a tensor: a constant of the export, a fill, a sum of a fill
    "over_a_tensor_of_the_size": (lambda out, y: F.mse_loss(out, y, reduction="sum")
                                  / torch.tensor(out.shape[0]), MEAN),
    "over_a_float_tensor_of_the_size": (lambda out, y: F.mse_loss(out, y, reduction="sum")
                                        / torch.tensor(len(out), dtype=torch.float32), MEAN),
    "over_new_tensor": (lambda out, y: F.mse_loss(out, y, reduction="sum")
                        / out.new_tensor(out.size(0)), MEAN),
    "over_a_full_of_the_size": (lambda out, y: F.mse_loss(out, y, reduction="sum")
                                / torch.full((), out.shape[0]), MEAN),
    "over_the_sum_of_ones": (lambda out, y: F.mse_loss(out, y, reduction="sum")
                             / torch.ones(out.shape[0]).sum(), MEAN),
    "mean_times_a_tensor_of_the_size": (lambda out, y: F.mse_loss(out, y)
                                        * torch.tensor(float(out.shape[0])), SUM),
    # arithmetic on it, computed at both sizes
    "over_the_product_of_a_tensor_of_the_shape": (
        lambda out, y: F.mse_loss(out, y, reduction="sum") / torch.tensor(out.shape).prod(),
        MEAN),
    "over_a_clamped_tensor_of_the_size": (
        lambda out, y: F.mse_loss(out, y, reduction="sum")
        / torch.clamp(torch.tensor(out.shape[0]), min=1), MEAN),
    "over_the_root_of_a_tensor_of_the_size": (
        lambda out, y: F.mse_loss(out, y, reduction="sum")
        / torch.tensor(float(out.shape[0])).sqrt(), None),
    "a_tensor_of_the_size_in_the_sample": (lambda out, y: F.mse_loss(
        out / torch.tensor(out.shape[0]), y), None),
}


@pytest.mark.parametrize("name", sorted(SIZED))
def test_numbers_made_from_the_shards_size(name):
    """Read at a second batch size, a number that follows the shard's size is told from a
    constant: a sum over a shard's samples or elements divided by their number is a mean
    over the batch, a mean times it a sum; other uses refuse. Each verdict is checked
    against arithmetic: a mean's shards average to the batch's loss, a sum's add up to
    it, a refused one's do neither."""
    loss_fn, form = SIZED[name]
    model = Chain(["linear"])
    x, y = _batch(3)
    with torch.no_grad():
        whole = loss_fn(model(x), y)
        parts = [loss_fn(model(x[k * 4:(k + 1) * 4]), y[k * 4:(k + 1) * 4]) for k in range(2)]
    if form is None:
        with pytest.raises(BatchSplitError, match="samples of different shards meet here"):
            _form(model, (x,), loss_fn, (y,))
        assert not torch.allclose(sum(parts) / 2, whole) and not torch.allclose(sum(parts), whole)
        return
    assert _form(model, (x,), loss_fn, (y,)) == form
    torch.testing.assert_close(sum(parts) / 2 if form == MEAN else sum(parts), whole)


def test_in_batch_negatives_are_refused_at_the_users_line():
    x, y = _batch(0)
    with pytest.raises(BatchSplitError, match=r"aten.matmul.default at .*test_batch_split.py:"
                                              r"\d+: .* \(its block of dim 0, its block of dim "
                                              r"1\) .* dp=1 and microbatches=1"):
        _form(Towers(), (x, y), lambda logits, x, y: F.cross_entropy(
            logits, torch.arange(logits.shape[0])))


def test_layouts_that_split_the_batch_refuse_and_the_planner_skips_them():
    x, y = _batch(0)
    model = Towers()

    def loss(logits, x, y):
        return F.cross_entropy(logits, torch.arange(logits.shape[0]))
    for layout in (autopar.Layout(dp=2), autopar.Layout(microbatches=2),
                   autopar.Layout(dp=2, zero=3), autopar.Layout(dp=2, dgc=0.9)):
        with pytest.raises(BatchSplitError, match="aten.matmul.default at"):
            autopar.check(model, (x, y), loss, layout, autopar.ClusterSpec.local(layout.world_size))
    assert autopar.check(model, (x, y), loss, autopar.Layout(tp=2), autopar.ClusterSpec.local(2)) > 0
    plan = autopar.plan(model, autopar.ClusterSpec.local(2), (x, y), loss, workers=0)
    assert plan.layout.dp == 1 and plan.layout.microbatches == 1
    assert any("samples of different shards meet" in why for lay, why in plan.skipped
               if lay.dp * lay.microbatches > 1)


def test_labels_built_from_the_batch_size_are_refused():
    model = torch.nn.Linear(6, 8)
    with pytest.raises(BatchSplitError, match=r"cross_entropy_loss.default in the loss function"):
        _form(model, (torch.randn(8, 6),),
              lambda out, x: F.cross_entropy(out, torch.arange(out.shape[0])))


def test_the_losses_form_over_the_batch():
    model = torch.nn.Linear(6, 6)
    x, y = _batch(1)
    def form(loss_fn):
        return _form(model, (x,), loss_fn, (y,))
    assert form(lambda out, y: F.mse_loss(out, y, reduction="sum")) == SUM
    assert form(lambda out, y: (out - y).square().sum() * 0.5) == SUM
    assert form(lambda out, y: (out - y).square().mean() + 1.0) == MEAN
    assert form(lambda out, y: model.weight.square().sum()) == SAME
    # a masked sum over the mask's count: the count of the data (global_loss_mean's)
    assert form(lambda out, y: ((out - y).square() * (y > 0)).sum()
                / (y > 0).sum().clamp(min=1)) == MEAN
    with pytest.raises(BatchSplitError, match=r"a part of a sum over the batch, a part of a "
                                              r"mean over the batch"):
        form(lambda out, y: F.mse_loss(out, y, reduction="sum") + F.mse_loss(out, y))
    with pytest.raises(BatchSplitError, match="aten.log.default"):
        form(lambda out, y: F.mse_loss(out, y).log())


@pytest.mark.parametrize("family", ["gpt2", "mixtral", "bloom", "bert", "gemma2"])
def test_transformers_models_split(family):
    """Their own patterns: position ids and masks built with the batch's size and
    expanded (constant along it), Bloom's ALiBi tiled per sample, a mixture of experts
    sorting its tokens by expert and putting them back, Gemma 2's sliding-window mask
    (`new_ones(())` of a mask of the shard's size: a fill, not a count of samples)."""
    example = hf_tiny(family, batch=4, seq=8)
    split = _split(example.model, example.batch, example.loss_fn)
    assert split.form == MEAN
    # the experts' sort of token ids and grouped matmul: taken as keeping samples apart
    # with no rule that proves it, and listed; nothing else is
    assumed = {a.split(" ")[0] for a in split.assumed}
    assert assumed == ({"aten.sort.default", "aten.cumsum.default", "aten.index_put.default",
                        "transformers.grouped_mm_fallback.default"} if family == "mixtral"
                       else set())


def test_batch_norms_and_embedding_bags_split():
    example, labels = cnn()
    assert _form(example.model, example.batch, example.loss_fn, labels) == MEAN
    example = ctr(batch=8)
    assert _form(example.model, example.batch, example.loss_fn) == MEAN
