"""Forward hooks and re-tracing: the backward follows whatever the forward hook did."""

from __future__ import annotations

import pytest
import torch

from autopar.compiler.ir.trace import retrace, trace_train_step
from autopar.compiler.ir.verify import verify
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.insert_allreduce import InsertAllReduce
from autopar.compiler.passes.manager import PassManager, PassOrderError
from autopar.layout import Layout


class ScaleLinearOutputs:
    """A forward hook: every linear layer's output times 3."""

    def __init__(self):
        self.seen = []

    def call_function(self, node, args, kwargs, run):
        out = run(args, kwargs)
        if node.target == torch.ops.aten.linear.default:
            self.seen.append(node.name)
            return out * 3
        return out


class Scaled(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        h = x
        for i, layer in enumerate(self.inner):
            h = layer(h) * 3 if isinstance(layer, torch.nn.Linear) else layer(h)
        return h.square().mean()


def test_backward_follows_the_hooked_forward():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(5, 4)
    tg = trace_train_step(model, (x,), lambda out, x: out.square().mean())
    hook = ScaleLinearOutputs()
    hooked = retrace(tg, hook)
    verify(hooked)
    assert len(hook.seen) == 2 and "retraceable" in hooked.provides
    with torch.no_grad():
        outs = hooked.gm(*model.parameters(), x)
    expect = Scaled(model)
    loss = expect(x)
    loss.backward()
    torch.testing.assert_close(outs[0], loss.detach())
    for got, p in zip(outs[1:], model.parameters()):
        torch.testing.assert_close(got, p.grad)


class NeedsRetraceable(GraphPass):
    name = "needs_retraceable"
    requires = frozenset({"traced", "retraceable"})
    invalidates = frozenset()

    def run(self, tg, ctx):
        return retrace(tg, ScaleLinearOutputs()), PassResult(self.name, changed=True)


def test_forward_level_pass_must_come_before_joint_rewrites():
    model = torch.nn.Linear(4, 2)
    tg = trace_train_step(model, (torch.randn(2, 4),), lambda out, x: out.sum())
    with pytest.raises(PassOrderError, match="retraceable"):
        PassManager([InsertAllReduce(), NeedsRetraceable()]).check_order(tg.provides)
    out, _ = PassManager([NeedsRetraceable(), InsertAllReduce()]).run(
        tg, PassContext(Layout(dp=2)))
    assert out.history == ("needs_retraceable", "insert_allreduce")
    assert "retraceable" not in out.provides
    with pytest.raises(ValueError, match="went through"):
        retrace(out, ScaleLinearOutputs())
