"""Gradient accumulation in place: a stage program adds its gradient parts into their sums
as it makes them (pipeline_program.accumulating), as autograd adds into `.grad`."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

import autopar
from autopar.compiler.analysis.live_bytes import LiveBytes
from autopar.compiler.ir.batch import Objective
from autopar.compiler.ir.pipeline_program import accumulating
from autopar.testing import compare, make_batches, reference_train


def _program(x, w):
    g_w = torch.mm(x.t(), x)  # a part made early, read by nothing after
    h = torch.mm(x, w)
    return g_w, h.sum(0), h.t()  # parts g_w and h^T (a view), one kept output


def test_accumulating_adds_each_part_into_its_sum_and_frees_it_where_made():
    gm = fx.symbolic_trace(_program)
    summing, sums, kept = accumulating(gm, ("g", "s", "ht"), {"g", "ht"})
    assert sums == ("g", "ht") and kept == ("s",)
    x, w = torch.randn(256, 256), torch.randn(256, 256)
    plain = gm(x, w)
    acc = [torch.ones(256, 256), torch.ones(256, 256)]
    with LiveBytes() as added:
        out = summing(x, w, *acc)
    assert torch.equal(out[0], plain[1])
    assert torch.equal(acc[0], plain[0] + 1) and torch.equal(acc[1], plain[2] + 1)
    with LiveBytes() as returned:
        gm(x, w)
    # the plain program holds g_w until it returns, beside h and its sum; the summing one
    # frees it once added: its peak is h and its sum
    assert added.peak_bytes == 256 * 256 * 4 + 256 * 4
    assert returned.peak_bytes == 2 * 256 * 256 * 4 + 256 * 4


class SummedWeights(torch.nn.Module):
    """Two parameters whose gradients are one node of the traced graph (the gradient of
    their sum): one part, one sum, given to both."""

    def __init__(self, width=16):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(width, width) / width)
        self.b = torch.nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x):
        return torch.tanh(x @ (self.a + self.b))


def test_two_parameters_with_one_gradient_node_accumulate_it_once():
    torch.manual_seed(0)
    model = SummedWeights()
    batch = (torch.randn(8, 16),)

    def loss_fn(out, x):
        return (out - x).pow(2).mean()

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    objective, flat = Objective.from_example(batch, None, loss_fn)
    batches = make_batches(flat, 4)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ref_losses, ref_state = reference_train(model, batches, objective, sgd)
    step = autopar.compile(copy.deepcopy(model), None, batch, loss_fn, optimizer=sgd,
                           layout=autopar.Layout(microbatches=4, fusion=False))
    parts = dict(zip((e.name for e in step.program.params), step.program.grad_parts))
    assert parts["a"] == parts["b"], parts  # the case under test
    losses = [step(*b).item() for b in batches]
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)
