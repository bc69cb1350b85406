"""The memory model (compiler/analysis/memory.py): liveness on hand-made programs, static
bytes against real optimizers, and the predicted peak against live storage counted
while a real step runs (compiler/analysis/live_bytes.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.compiler.analysis import memory as mm
from autopar.compiler.analysis.live_bytes import LiveBytes, measure_step
from autopar.compiler.analysis.summary import GraphSummary, OpRecord, summarize
from autopar.examples import load_example, mlp


def summary_of(ops, outputs=()):
    return GraphSummary(tuple(ops), (), (), 0, frozenset(outputs))


def test_liveness_on_a_hand_made_chain():
    # x -> a = relu(x) -> v = view(a) -> b = mul(v) -> loss = sum(b)   (100 bytes each)
    ops = [OpRecord("x", "input", allocates=100, storage=0),
           OpRecord("a", "forward", allocates=100, storage=1, uses=(0,)),
           OpRecord("v", "forward", storage=1, uses=(1,)),
           OpRecord("b", "forward", allocates=100, storage=3, uses=(2,)),
           OpRecord("loss", "loss", allocates=4, storage=4, uses=(3,))]
    # the input is static (not counted here); a lives through b (read via its view)
    live = mm.graph_liveness(summary_of(ops, outputs={4}))
    assert (live.peak_bytes, live.peak_op) == (200, "b")
    assert live.at_peak["activations"] == 200 and live.outputs_bytes == 4
    # a backward op that reads a: a is saved for the backward; b (dead by then) is not
    grad = ops + [OpRecord("g", "backward", allocates=100, storage=5, uses=(1,))]
    live = mm.graph_liveness(summary_of(grad, outputs={5}))
    assert live.saved_bytes == 100 and live.peak_bytes == 204  # a + b + loss... b freed
    # collectives' storage is its own category
    comm = ops[:4] + [OpRecord("buf", "comm", allocates=150, storage=4, uses=(3,))]
    live = mm.graph_liveness(summary_of(comm))
    assert live.peak_bytes == 250 and live.at_peak["comm_buffers"] == 150


@pytest.mark.parametrize("kind, make", [
    ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-3)),
    ("sgd-momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
    ("adamw-fused", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
    ("sgd-momentum-fused", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True)),
])
def test_static_bytes_match_real_optimizers(kind, make):
    ex = mlp()
    model = copy.deepcopy(ex.model)
    summary = summarize(autopar.trace(model, ex.batch, ex.loss_fn))
    opt = make(list(model.parameters()))
    ex.loss_fn(model(*ex.batch), *ex.batch).backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    pred = mm.step_memory(summary, autopar.Layout(), kind)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert pred.static["parameters"] == params
    assert pred.static["optimizer_states"] == state
    # the table of known kinds is what profiling the real optimizer measures
    assert mm.profile_optimizer(make) == mm.OPTIMIZERS[kind]
    with pytest.raises(ValueError, match="unknown optimizer kind 'lamb'"):
        mm.step_memory(summary, autopar.Layout(), "lamb")


def test_zero_blocks_are_held_beside_whole_parameters():
    ex = mlp()
    summary = summarize(autopar.trace(ex.model, ex.batch, ex.loss_fn))
    plain = mm.step_memory(summary, autopar.Layout(), "adamw").static
    zero = mm.step_memory(summary, autopar.Layout(dp=2, zero=1), "adamw").static
    # every MLP parameter has >= 2 rows: blocks of half the rows, states on the blocks
    assert zero["parameters"] > plain["parameters"]
    assert zero["optimizer_states"] < 0.6 * plain["optimizer_states"]


def measured_and_predicted(name, layout=autopar.Layout(), **kw):
    ex = load_example(name, **kw)
    step = autopar.compile(copy.deepcopy(ex.model), example_inputs=ex.batch,
                           loss_fn=ex.loss_fn, layout=layout,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    step(*ex.batch)  # the first step creates the optimizer state
    measured, _ = measure_step(step, *ex.batch)
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    tg, _ = autopar.run_passes(tg, layout)
    # on this CPU the runtime runs the fused regions' ops inline
    return measured, mm.step_memory(summarize(tg), layout, "adamw", regions_inline=True)


@pytest.mark.parametrize("name, kw, layout", [
    ("gpt2-tiny", {}, autopar.Layout()), ("llama-tiny", {}, autopar.Layout()),
    ("mlp", {}, autopar.Layout()), ("gpt2-tiny", {"layers": 4, "hidden": 128}, autopar.Layout()),
    ("gpt2-tiny", {"layers": 4, "hidden": 128}, autopar.Layout(recompute="full")),
    ("llama-tiny", {}, autopar.Layout(recompute="selective")),
    ("gpt2-tiny", {}, autopar.Layout(fusion=False))])
def test_predicted_peak_matches_live_storage(name, kw, layout):
    measured, pred = measured_and_predicted(name, layout, **kw)
    assert pred.peak_bytes == pytest.approx(measured, rel=0.05), pred.by_category


def test_fused_regions_run_inline_on_a_cpu_are_counted_op_by_op():
    """On a CPU the runtime runs each fused region's ops inline, so the region's
    intermediates exist. With full recomputation the peak falls inside a region of the
    backward: counted as one kernel (as on a GPU) the step is under-predicted by over 5%;
    replayed op by op it is within 2%."""
    layout = autopar.Layout(recompute="full")
    measured, pred = measured_and_predicted("gpt2-tiny", layout, layers=4, hidden=128)
    ex = load_example("gpt2-tiny", layers=4, hidden=128)
    tg, _ = autopar.run_passes(autopar.trace(ex.model, ex.batch, ex.loss_fn), layout)
    kernels = mm.step_memory(summarize(tg), layout, "adamw")
    assert kernels.peak_bytes < 0.95 * measured
    assert pred.peak_bytes == pytest.approx(measured, rel=0.02)
    assert pred.peak_op.startswith("fused_")


def test_live_bytes_counts_new_storage_once_and_frees_it():
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: nothing new
        c = a * 2  # 4000 more
        del c
        d = b + 1  # c's storage was freed: the peak stays 8000
    assert live.peak_bytes == 8000 and d.numel() == 1000


def test_live_bytes_counts_what_a_storage_made_before_grew_by_in_place():
    """FSDP2 allocates an unsharded parameter by resizing a storage it made earlier
    (`UntypedStorage.resize_`, which no op reports): given as resizable, what it grew
    by counts while it is grown, and once."""
    held = torch.empty(0)
    held.untyped_storage().resize_(0)
    with LiveBytes(resizable=[held, held.view(-1)]) as live:
        held.untyped_storage().resize_(4000)
        a = torch.ones(1000)  # 8000 with the grown storage
        held.untyped_storage().resize_(0)
        b = a * 2  # 8000 again, the grown storage freed
    assert live.peak_bytes == 8000 and b.numel() == 1000
    with LiveBytes() as unseen:
        held.untyped_storage().resize_(4000)
        c = torch.ones(1000)
    assert unseen.peak_bytes == 4000 and c.numel() == 1000


@pytest.mark.parametrize("name, microbatches", [("gpt2-tiny", 4), ("llama-tiny", 2)])
def test_gradient_accumulation_peak_matches_live_storage(name, microbatches):
    from autopar.compiler.planner.pipeline_memory import pipeline_memory

    ex = load_example(name)
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    step = autopar.compile(copy.deepcopy(ex.model), example_inputs=ex.batch, loss_fn=ex.loss_fn,
                           layout=autopar.Layout(microbatches=microbatches), optimizer=optimizer)
    step(*ex.batch)
    measured, held = measure_step(step, *ex.batch)
    # a CPU runs the fused regions' ops inline, as the planner models it on a CPU cluster
    pred = pipeline_memory(step.program, 0, mm.profile_optimizer(optimizer), regions_inline=True)
    assert sum(pred.static.values()) == held
    assert pred.peak_bytes == pytest.approx(measured, rel=0.01), pred.by_category
    # one micro-batch's activations at a time: less than the unsplit step's
    whole, _ = measured_and_predicted(name)
    assert measured < whole
