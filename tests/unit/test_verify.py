"""The verifier fires on graphs corrupted on purpose."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.ir.verify import VerificationError, verify
from autopar.compiler.passes.base import PassContext
from autopar.compiler.passes.insert_allreduce import InsertAllReduce
from autopar.layout import Layout


@pytest.fixture
def tg():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return trace_train_step(model, (torch.randn(4, 4),), lambda out, x: out.square().mean())


def test_valid_graph_passes(tg):
    verify(tg)


def test_use_before_definition(tg):
    nodes = tg.call_nodes()
    nodes[0].append(nodes[-1])  # move the last op before the first
    with pytest.raises(VerificationError, match="lint"):
        verify(tg)


def test_missing_output(tg):
    out = tg.output_node()
    out.args = (tuple(out.args[0][:-1]),)
    with pytest.raises(VerificationError, match="outputs"):
        verify(tg)


def test_gradient_with_wrong_shape(tg):
    out = tg.output_node()
    outs = list(out.args[0])
    outs[1], outs[2] = outs[2], outs[1]
    out.args = (tuple(outs),)
    with pytest.raises(VerificationError, match="gradient of 0.weight"):
        verify(tg)


def test_unknown_role(tg):
    tg.call_nodes()[3].meta[M.ROLE] = "forward"
    with pytest.raises(VerificationError, match="not a meta.Role"):
        verify(tg)


def test_placeholder_count_must_match_signature(tg):
    bad = dataclasses.replace(tg, signature=dataclasses.replace(tg.signature, inputs=()))
    with pytest.raises(VerificationError, match="placeholders"):
        verify(bad)


def test_collective_without_wait(tg):
    synced, _ = InsertAllReduce().run(tg, PassContext(Layout(dp=2)))
    wait = next(n for n in synced.call_nodes()
                if n.target == torch.ops._c10d_functional.wait_tensor.default)
    wait.replace_all_uses_with(wait.args[0])
    synced.graph.erase_node(wait)
    with pytest.raises(VerificationError, match="exactly one wait_tensor"):
        verify(synced)
