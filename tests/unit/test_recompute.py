"""The recompute pass: where copies go, what each policy keeps, bit-identical training,
the measured memory it saves, and "auto" against its budget (hypothesis)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.verify import verify
from autopar.compiler.passes.recompute_rules import RecomputeError
from autopar.compiler.analysis.memory import step_memory
from autopar.compiler.analysis.summary import summarize
from autopar.examples import load_example
from autopar.compiler.analysis.live_bytes import measure_step

aten = torch.ops.aten


class Mlp(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.up, self.down, self.dropout = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8), dropout

    def forward(self, x):
        h = F.gelu(self.up(x))
        return self.down(F.dropout(h, self.dropout, training=self.dropout > 0)).square().mean()


def rewritten(model, batch, policy, loss_fn=None, **options):
    tg = autopar.trace(model, batch, loss_fn)
    out, results = autopar.run_passes(tg, autopar.Layout(recompute=policy), options=options)
    verify(out)
    return tg, out, {r.name: r for r in results}["recompute"]


def test_selective_recomputes_gelu_in_the_backward_and_keeps_the_matmul():
    _, tg, result = rewritten(Mlp(), (torch.randn(4, 8),), "selective")
    copies = [n for n in tg.call_nodes() if n.meta.get(M.RECOMPUTED)]
    # gelu and a weight's transpose (a view): not the matmuls
    assert {n.target for n in copies} == {aten.gelu.default, aten.t.default}
    (gelu,) = [n for n in copies if n.target == aten.gelu.default]
    # the copy reads the kept addmm and sits right before the backward node that needs it
    assert gelu.args[0].target == aten.addmm.default
    assert gelu.meta[M.ROLE] == M.Role.BACKWARD and gelu.next in gelu.users
    forward_gelu = next(n for n in tg.call_nodes() if n.name == gelu.meta[M.RECOMPUTED])
    assert all(u.meta[M.ROLE] != M.Role.BACKWARD for u in forward_gelu.users)
    assert result.stats["recomputed_ops"] == len(copies) and not result.declined


def test_a_random_op_is_kept_and_declined_visibly():
    torch.manual_seed(0)
    _, tg, result = rewritten(Mlp(dropout=0.5), (torch.randn(4, 8),), "full")
    assert any("random op" in why for _, why in result.declined), result.declined
    copies = {n.target for n in tg.call_nodes() if n.meta.get(M.RECOMPUTED)}
    assert not any(torch.Tag.nondeterministic_seeded in t.tags for t in copies
                   if isinstance(t, torch._ops.OpOverload))


def test_full_keeps_only_layer_boundaries_and_never_crosses_layers():
    ex = load_example("gpt2-tiny", layers=3)
    _, tg, _ = rewritten(ex.model, ex.batch, "full", loss_fn=ex.loss_fn)
    copies = [n for n in tg.call_nodes() if n.meta.get(M.RECOMPUTED)]
    assert {n.meta[M.LAYER] for n in copies} == {0, 1, 2}
    for copy_ in copies:  # a copy reads copies of its own layer, or kept values
        for arg in copy_.all_input_nodes:
            if arg.meta.get(M.RECOMPUTED):
                assert arg.meta[M.LAYER] == copy_.meta[M.LAYER]
    # copies are made in the backward, not earlier: after the first backward node
    order = {n: i for i, n in enumerate(tg.graph.nodes)}
    first_backward = min(order[n] for n in tg.call_nodes()
                         if n.meta[M.ROLE] == M.Role.BACKWARD and not n.meta.get(M.RECOMPUTED))
    assert min(order[n] for n in copies) > first_backward


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("optimizer", [lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                       lambda ps: torch.optim.AdamW(ps, lr=1e-3)])
def test_training_with_recompute_is_bit_identical(name, optimizer):
    ex = load_example(name)
    runs = {}
    for policy in ("none", "full", "selective"):
        step = autopar.compile(copy.deepcopy(ex.model), example_inputs=ex.batch,
                               loss_fn=ex.loss_fn, optimizer=optimizer,
                               layout=autopar.Layout(recompute=policy))
        losses = [step(*b).item() for b in ex.batches(3)]
        runs[policy] = losses, step.full_state_dict()
    base_losses, base_state = runs.pop("none")
    for policy, (losses, state) in runs.items():
        assert losses == base_losses, policy
        assert all(torch.equal(state[k], base_state[k]) for k in base_state), policy


def test_full_recompute_halves_measured_activation_memory_of_gpt2_at_4_layers():
    ex = load_example("gpt2-tiny", layers=4)
    activations = {}
    for policy in ("none", "full"):
        step = autopar.compile(copy.deepcopy(ex.model), example_inputs=ex.batch,
                               loss_fn=ex.loss_fn,
                               layout=autopar.Layout(recompute=policy, fusion=False),
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
        step(*ex.batch)
        peak, held = measure_step(step, *ex.batch)
        activations[policy] = peak - held
        # and the memory model predicts that step's peak
        pred = step_memory(summarize(step.train_graph), autopar.Layout(), "sgd")
        assert pred.peak_bytes == pytest.approx(peak, rel=0.05)
    assert activations["none"] >= 2 * activations["full"], activations


@pytest.fixture(scope="module")
def gpt2_graph():
    ex = load_example("gpt2-tiny", layers=3)
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    peaks = {}
    for policy in ("none", "selective", "full"):
        out, _ = autopar.run_passes(tg, autopar.Layout(recompute=policy, fusion=False))
        peaks[policy] = step_memory(summarize(out), autopar.Layout(), "adamw").peak_bytes
    return tg, peaks


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0.0, 1.2))
def test_auto_never_exceeds_its_budget(gpt2_graph, fraction):
    tg, peaks = gpt2_graph
    smallest = min(peaks.values())
    budget = int(smallest + fraction * (peaks["none"] - smallest))
    out, results = autopar.run_passes(tg, autopar.Layout(recompute="auto", fusion=False),
                                      options={"memory_budget": budget})
    assert step_memory(summarize(out), autopar.Layout(), "adamw").peak_bytes <= budget
    if budget >= peaks["none"]:
        assert results[0].stats["recomputed_ops"] == 0  # nothing to do: nothing recomputed


def test_auto_names_the_smallest_budget_when_nothing_fits(gpt2_graph):
    tg, peaks = gpt2_graph
    with pytest.raises(RecomputeError, match=r"smallest predicted peak is .* MiB"):
        autopar.run_passes(tg, autopar.Layout(recompute="auto"),
                           options={"memory_budget": min(peaks.values()) - 1})
    with pytest.raises(RecomputeError, match="needs a memory budget"):
        autopar.run_passes(tg, autopar.Layout(recompute="auto"))
