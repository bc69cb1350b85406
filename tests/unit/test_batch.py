"""The step's calling convention (compiler/ir/batch.py): which parts of a batch go to the
model and which to the loss, the flat order, and the errors a user meets."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir.batch import BatchError, Objective


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(x)


X, Y = torch.randn(16, 8), torch.randint(0, 3, (16,))


def ce(out, y):
    return F.cross_entropy(out, y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_whole_batch_to_a_forward_of_one_argument_says_how_to_pass_targets():
    with pytest.raises(BatchError) as err:
        autopar.compile(Net(), None, example_inputs=(X, Y), loss_fn=ce)
    message = str(err.value)
    assert "Net.forward(x)" in message and "example_targets" in message, message
    assert "step(*inputs, *targets)" in message


def test_a_loss_that_cannot_take_its_part_names_its_signature():
    with pytest.raises(BatchError, match=r"loss_fn .*\(out\) cannot take \(output, target_0\)"):
        autopar.compile(Net(), None, example_inputs=(X,), example_targets=(Y,),
                        loss_fn=lambda out: out.sum())


def test_unknown_keyword_names_forward_and_the_fix():
    with pytest.raises(BatchError, match=r"Net.forward\(x\) cannot take keywords x, y"):
        autopar.compile(Net(), None, example_inputs={"x": X, "y": Y}, loss_fn=ce)


def test_targets_need_a_loss_and_names_must_differ():
    with pytest.raises(BatchError, match="no loss_fn"):
        Objective.from_example((X,), (Y,), None)
    with pytest.raises(BatchError, match=r"both name \['x'\]"):
        Objective.from_example({"x": X}, {"x": Y}, ce)
    with pytest.raises(BatchError, match="must be a tensor"):
        Objective.from_example((X, 3), None, ce)


@pytest.mark.parametrize("inputs, targets, call", [
    ((X,), (Y,), lambda step: step(X, Y)),
    ({"x": X}, {"y": Y}, lambda step: step(x=X, y=Y)),
    ({"x": X}, (Y,), lambda step: step(Y, x=X)),
    (X, Y, lambda step: step(X, Y)),
])
def test_every_form_trains_as_eager(inputs, targets, call):
    """One process, two SGD steps: the step called as the model is equals eager PyTorch."""
    model = Net()
    ref = copy.deepcopy(model)
    opt = sgd(list(ref.parameters()))
    step = autopar.compile(model, None, example_inputs=inputs, example_targets=targets,
                           loss_fn=lambda out, y: ce(out, y), optimizer=sgd,
                           layout=autopar.Layout())
    for _ in range(2):
        loss = call(step)
        ref_loss = ce(ref(X), Y)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        torch.testing.assert_close(loss, ref_loss.detach())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(step.full_state_dict()[name], p.detach())


def test_a_call_unlike_the_example_names_the_expected_form():
    step = autopar.compile(Net(), None, example_inputs={"x": X}, example_targets=(Y,),
                           loss_fn=ce)
    with pytest.raises(BatchError, match=r"called as step\(target_0, x=\.\.\.\)"):
        step(X, Y)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(n=st.integers(0, 3), keys=st.lists(st.sampled_from("abcd"), max_size=3, unique=True),
       tn=st.integers(0, 2), tkeys=st.lists(st.sampled_from("uvw"), max_size=2, unique=True))
def test_flatten_and_unflatten_are_inverse(n, keys, tn, tkeys):
    tensors = iter(torch.arange(float(n + len(keys) + tn + len(tkeys) + 1)).unbind())
    inputs = {k: next(tensors) for k in keys} if keys else tuple(next(tensors) for _ in range(n))
    targets = ({k: next(tensors) for k in tkeys} if tkeys else
               tuple(next(tensors) for _ in range(tn)))
    objective, flat = Objective.from_example(inputs, targets, ce)
    args, kwargs = objective.unflatten(flat)
    assert objective.flatten(args, kwargs) == flat
    assert objective.size == len(flat)
