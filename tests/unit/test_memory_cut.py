"""Pipeline cuts that fit the memory budget (passes/assign_stages.py): the micro-batches
each schedule keeps in flight per stage, the cut against every cut enumerated, what a
GPT-2's blocks weigh, and the planner's replicated pipelines cut as the whole model is."""

from __future__ import annotations

import itertools
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.schedule import build, in_flight
from autopar.compiler.passes.assign_stages import (
    CUT_WEIGHTS,
    AssignStages,
    CutMemory,
    balanced_cuts,
    cut_weights,
)
from autopar.compiler.passes.base import PassContext
from autopar.compiler.planner.estimate import Estimator
from autopar.examples import causal_lm_loss, gpt2
from tests.unit.test_cost_model import meta_gpt2

logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


@pytest.mark.parametrize("pp,microbatches", [(1, 1), (2, 4), (4, 8), (4, 2), (3, 1), (6, 9)])
def test_micro_batches_in_flight_per_stage(pp, microbatches):
    """1F1B's warm-up runs pp - s forwards on stage s before its first backward; GPipe
    runs every forward first; ZB-H1 defers up to s weight gradients on stage s, and a
    stage keeps a micro-batch until its weight gradient (W reads the saved inputs)."""
    for name in ("1f1b", "gpipe", "zero-bubble"):
        replayed = []
        for actions in build(name, pp, microbatches).ranks:
            live = most = 0
            for action in actions:
                live += action.kind == "F"
                live -= action.kind == ("W" if name == "zero-bubble" else "B")
                most = max(most, live)
            replayed.append(most)
        assert in_flight(name, pp, microbatches) == tuple(replayed), name
    assert in_flight("1f1b", pp, microbatches) == tuple(min(microbatches, pp - s)
                                                        for s in range(pp))
    assert in_flight("gpipe", pp, microbatches) == (microbatches,) * pp


def _loads(cut, n, per_part):
    bounds = (0, *cut, n)
    return [per_part(k, a, b) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9), st.integers(0, 9)),
                min_size=2, max_size=8),
       st.integers(2, 4), st.integers(0, 12), st.integers(0, 12),
       st.tuples(st.integers(0, 20), st.integers(0, 9), st.integers(0, 20), st.integers(0, 9)),
       st.sampled_from(["1f1b", "gpipe", "zero-bubble"]), st.integers(1, 8),
       st.integers(1, 120), st.booleans())
def test_the_cut_is_the_fastest_that_fits_else_the_lightest(blocks, parts, head, tail, ends,
                                                            schedule, microbatches, budget,
                                                            alike):
    """Every cut of the blocks enumerated: the time-balanced cut where it fits the budget,
    else the least costly of those that fit, else the one whose fullest stage holds
    least (and the least costly of those). `alike`: every block weighs as the first
    (the path by block counts)."""
    if alike:
        blocks = [blocks[0]] * len(blocks)
    costs = [float(c) for c, _, _ in blocks]
    parts = min(parts, len(costs))
    flight = in_flight(schedule, parts, microbatches)
    memory = CutMemory(tuple(float(f) for _, f, _ in blocks), tuple(float(s) for _, _, s in blocks),
                       *map(float, ends), flight)
    n = len(costs)

    def seconds(k, a, b):
        return sum(costs[a:b]) + (head if k == 0 else 0) + (tail if k == parts - 1 else 0)

    def held(k, a, b):
        out = sum(memory.fixed[a:b]) + flight[k] * sum(memory.saved[a:b])
        if k == 0:
            out += memory.head_fixed + flight[0] * memory.head_saved
        if k == parts - 1:
            out += memory.tail_fixed + flight[-1] * memory.tail_saved
        return out

    cuts = [list(c) for c in itertools.combinations(range(1, n + (tail > 0)), parts - 1)]
    got = balanced_cuts(costs, parts, float(head), float(tail), memory, float(budget))
    assert got in cuts
    assert _loads(got, n, held) == pytest.approx(memory.stage_bytes(got))
    fastest = min(max(_loads(c, n, seconds)) for c in cuts)
    timed = balanced_cuts(costs, parts, float(head), float(tail))
    fitting = [c for c in cuts if max(_loads(c, n, held)) <= budget]
    if max(_loads(timed, n, held)) <= budget:
        assert got == timed
    elif fitting:
        assert max(_loads(got, n, held)) <= budget
        assert max(_loads(got, n, seconds)) == min(max(_loads(c, n, seconds)) for c in fitting)
        assert max(_loads(got, n, seconds)) >= fastest
    else:
        lightest = min(max(_loads(c, n, held)) for c in cuts)
        assert max(_loads(got, n, held)) == lightest
        assert max(_loads(got, n, seconds)) == min(
            max(_loads(c, n, seconds)) for c in cuts if max(_loads(c, n, held)) == lightest)


def test_every_block_of_a_gpt2_weighs_the_same_and_the_ends_hold_their_parameters():
    """Each block: its parameters, what its forward keeps, its time with the sums of its
    input's gradient terms (autograd's accumulation between blocks has no block); the
    tied embedding on both ends."""
    example = gpt2(layers=4, vocab=4096)
    tg = autopar.trace(example.model, example.batch, example.loss_fn)
    w = cut_weights(tg, autopar.ClusterSpec.local(1))
    model = example.model
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    assert w.params == {b: block for b in range(4)}
    assert len(set(w.saved.values())) == 1 and w.saved[0] > 0
    assert len({round(t, 15) for t in w.seconds.values()}) == 1
    wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
    assert w.head_params == (wte.numel() + wpe.numel()) * 4
    ln_f = sum(p.numel() * 4 for p in model.transformer.ln_f.parameters())
    assert w.tail_params == wte.numel() * 4 + ln_f
    assert w.head_saved > 0 and w.tail_saved > w.saved[0] / 4  # the loss keeps its logits' work


def _stats(example, budget=None, **layout):
    tg = autopar.trace(example.model, example.batch, example.loss_fn)
    ctx = PassContext(autopar.Layout(**layout), autopar.ClusterSpec.local(1),
                      options={"memory_budget": budget})
    out, result = AssignStages().run(tg, ctx)
    assert out.attrs[CUT_WEIGHTS] == cut_weights(tg, autopar.ClusterSpec.local(1))
    return result.stats


def test_assign_stages_keeps_the_fastest_cut_that_fits_the_budget():
    example = gpt2(layers=8, vocab=4096)
    free = _stats(example, pp=4, microbatches=4)
    heaviest = max(free["weighed_stage_bytes"])
    # under 1F1B the first stage keeps 4 micro-batches' activations, the last one
    assert free["weighed_stage_bytes"][0] == heaviest
    tight = _stats(example, int(heaviest * 0.9), pp=4, microbatches=4)
    assert max(tight["weighed_stage_bytes"]) <= heaviest * 0.9
    assert tight["first_block_of_stage"] != free["first_block_of_stage"]
    assert max(tight["estimated_stage_seconds"]) >= max(free["estimated_stage_seconds"])
    # nothing fits one byte: the lightest cut
    none = _stats(example, 1, pp=4, microbatches=4)
    assert max(none["weighed_stage_bytes"]) <= max(tight["weighed_stage_bytes"])
    # GPipe keeps every micro-batch on every stage: the weights follow the schedule
    gpipe = _stats(example, pp=4, microbatches=4, schedule="gpipe")
    assert gpipe["first_block_of_stage"] == free["first_block_of_stage"]
    assert gpipe["weighed_stage_bytes"][-1] > free["weighed_stage_bytes"][-1]


def _with_memory(cluster, nbytes):
    return cluster.model_copy(update={"device": cluster.device.model_copy(
        update={"memory_bytes": int(nbytes)})})


@pytest.mark.parametrize("memory", [None, 60e6], ids=["80GB", "60MB"])
def test_a_replicated_pipeline_is_cut_as_the_whole_model_is(memory):
    """The planner's pipelines of any depth from one two-block template are cut where
    AssignStages cuts the whole model's trace (time-balanced on the 80 GB card, to fit
    on 60 MB), and predicted alike. Measured here: 3 stages of 8 blocks cut 3 / 3 / 2 on
    time (the template once counted the gradient sums between every two blocks in the
    embeddings' stage: 2 / 3 / 3 on the whole trace, 29% more peak than its template
    predicted); 2 / 3 / 3 and 1 / 2 / 2 / 3 to fit 60 MB, both sides."""
    model, batch = meta_gpt2(layers=8, hidden=256, heads=8, vocab=1000, batch=16, seq=64)
    cluster = autopar.ClusterSpec.preset("dgx-h100")
    if memory is not None:
        cluster = _with_memory(cluster, memory)
    scaled = Estimator(model, cluster, batch, causal_lm_loss, trace_blocks=2)
    # the template cuts between blocks: the whole trace too, as a Plan costed from a
    # template compiles it (Plan.pass_options)
    exact = Estimator(model, cluster, batch, causal_lm_loss, trace_blocks="exact",
                      pass_options={"cut_inside_blocks": False})
    moved = 0
    for fields in [dict(pp=4, microbatches=4), dict(pp=3, microbatches=4),
                   dict(dp=4, pp=2, microbatches=4, schedule="zero-bubble")]:
        layout = autopar.Layout(**fields)
        approx, whole = scaled.predict(layout), exact.predict(layout)
        template = scaled.rewrites.entry(scaled.rewrite(layout)).template
        counts = scaled.blocks_per_stage(template, layout)
        summary, stages, _ = exact.rewritten(layout)
        blocks: dict[int, set] = {}
        for op, stage in zip(summary.ops, stages.stage_of):
            if op.layer is not None and op.role != M.Role.BACKWARD.value:
                blocks.setdefault(stage, set()).add(op.layer)
        assert counts == tuple(len(blocks.get(s, ())) for s in range(stages.stages)), fields
        assert approx.step_time_s == pytest.approx(whole.step_time_s, rel=0.01)
        assert approx.peak_memory_bytes == pytest.approx(whole.peak_memory_bytes, rel=0.01)
        moved += counts != template.blocks_per_stage(stages.stages)
    assert moved == (0 if memory is None else 2)
