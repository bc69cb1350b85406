"""The compiled Program is serialisable and binds mesh tags to process groups."""

from __future__ import annotations

import io

import pytest
import torch

import autopar
from autopar.compiler.lowering.lower import to_program
from autopar.examples import gpt2
from autopar.compiler.ir.program import bind_groups


def test_program_survives_torch_save_and_computes_the_same():
    ex = gpt2()
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    program = to_program(tg, autopar.Layout())
    buffer = io.BytesIO()
    torch.save(program, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.params == program.params and loaded.mesh == program.mesh
    named = dict(ex.model.named_parameters())
    flat = [named[p.name] for p in loaded.params]
    with torch.no_grad():
        expected, got = program.gm(*flat, *ex.batch), loaded.gm(*flat, *ex.batch)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_binding_replaces_mesh_tags_and_refuses_unknown_dimensions():
    ex = gpt2()
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    synced, _ = autopar.run_passes(tg, autopar.Layout(dp=2))
    bound = bind_groups(synced.gm, {"dp": "group-7"})
    groups = {n.args[2] for n in bound.graph.nodes
              if n.target == torch.ops._c10d_functional.all_reduce.default}
    assert groups == {"group-7"}
    with pytest.raises(RuntimeError, match="mesh dimension 'dp'.*only \\['tp'\\]"):
        bind_groups(synced.gm, {"tp": "group-1"})
