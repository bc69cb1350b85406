"""Stage assignment and per-stage programs: balanced cuts, data-flow direction, and
the stage programs run back to back equal the joint graph."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir import meta as M
from autopar.compiler.lowering.lower_pipeline import lower_pipeline
from autopar.compiler.ir.meta import STAGE
from autopar.compiler.passes.assign_stages import AssignStages, StageError, balanced_cuts
from autopar.compiler.passes.base import PassContext
from autopar.examples import gpt2, hf_tiny, llama, load_example


def brute_force(costs, parts, head, tail):
    best = None
    last = len(costs) + (tail > 0)  # the last part may hold only the tail
    for cuts in itertools.combinations(range(1, last), parts - 1):
        bounds = (0, *cuts, len(costs))
        loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        loads[0] += head
        loads[-1] += tail
        best = max(loads) if best is None else min(best, max(loads))
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=2, max_size=9), st.integers(2, 4),
       st.integers(0, 30), st.integers(0, 30))
def test_balanced_cuts_equal_brute_force(costs, parts, head, tail):
    parts = min(parts, len(costs))
    cuts = balanced_cuts(costs, parts, head, tail)
    bounds = (0, *cuts, len(costs))
    loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    loads[0] += head
    loads[-1] += tail
    assert len(cuts) == parts - 1 and all(b > a for a, b in zip(bounds[:-1], bounds[1:-1]))
    assert bounds[-2] < bounds[-1] or tail > 0  # only a tail may stand alone
    assert max(loads) == brute_force(costs, parts, head, tail)


def scan_cuts(costs, parts, head, tail):
    """balanced_cuts by the plain O(parts n^2) scan: every start of the last part, the
    first least max kept (the binary search must pick the same cuts, ties included)."""
    ends = list(costs) + [tail] * (tail > 0)
    parts, n = min(parts, len(ends)), len(ends)
    best = {(0, 0): (0.0, 0)}
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            options = [(max(best[k - 1, i][0], sum(ends[i:j]) + (head if k == 1 else 0.0)), i)
                       for i in range(k - 1, j) if (k - 1, i) in best]
            if options:
                least = min(value for value, _ in options)
                best[k, j] = (least, next(i for value, i in options if value == least))
    cuts, j = [], n
    for k in range(parts, 1, -1):
        j = best[k, j][1]
        cuts.append(j)
    return sorted(cuts)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(1, 6),
       st.integers(0, 4), st.integers(0, 4))
def test_balanced_cuts_break_ties_as_a_scan(costs, parts, head, tail):
    """Zero-cost blocks and equal loads give many optimal cuts: the binary search takes
    the scan's (the earliest start of each part, from the last)."""
    costs = [float(c) for c in costs]
    assert balanced_cuts(costs, parts, float(head), float(tail)) == \
        scan_cuts(costs, parts, float(head), float(tail))


def test_a_large_output_head_gets_a_stage_of_its_own():
    tg, result = assigned(gpt2(layers=2, vocab=16384), pp=2, microbatches=2)
    assert result.stats["first_block_of_stage"] == [None]
    for node in tg.call_nodes():
        if node.meta.get(M.LAYER) is not None and node.meta[M.ROLE] != M.Role.BACKWARD:
            assert node.meta[STAGE] == 0, node.name
    head = [n for n in tg.call_nodes() if n.meta.get(M.MODULE_PATH) == "lm_head"]
    assert head and all(n.meta[STAGE] == 1 for n in head)


def assigned(example, options=None, **layout):
    tg = autopar.trace(example.model, example.batch, example.loss_fn)
    return AssignStages().run(tg, PassContext(autopar.Layout(**layout), options=options))


@pytest.mark.parametrize("factory", [lambda: gpt2(layers=4), lambda: llama(layers=4),
                                     lambda: hf_tiny("bert"), lambda: hf_tiny("mixtral")],
                         ids=["gpt2", "llama", "bert", "mixtral"])
def test_every_node_in_one_stage_and_data_flows_forward_then_back(factory):
    tg, result = assigned(factory(), {"cut_inside_blocks": False}, pp=2, microbatches=2)
    assert result.stats["stages"] == 2
    assert {node.meta[STAGE] for node in tg.call_nodes()} == {0, 1}
    _data_flows_forward_then_back(tg)
    for node in tg.call_nodes():
        if node.meta.get(M.LAYER) is not None:
            assert node.meta[STAGE] == (node.meta[M.LAYER] >= result.stats["first_block_of_stage"][0])


def test_pinned_cuts_and_errors():
    ex = gpt2(layers=4)
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    ctx = PassContext(autopar.Layout(pp=2, microbatches=2), options={"pipeline_cuts": ["transformer.h.3"]})
    _, result = AssignStages().run(tg, ctx)
    assert result.stats["first_block_of_stage"] == [3]
    bad = PassContext(autopar.Layout(pp=2, microbatches=2), options={"pipeline_cuts": ["transformer.h.9"]})
    with pytest.raises(StageError, match="not a block of the model or a module inside one; the blocks are transformer.h.0"):
        AssignStages().run(tg, bad)
    with pytest.raises(StageError, match="use pp\\*virtual_stages <= 4"):
        AssignStages().run(tg, PassContext(autopar.Layout(pp=4, microbatches=4, virtual_stages=2,
                                                          schedule="interleaved")))


def _cut_at(example, *paths, **layout):
    tg = autopar.trace(example.model, example.batch, example.loss_fn)
    layout = autopar.Layout(**{"pp": 2, "microbatches": 2, **layout})
    return AssignStages().run(tg, PassContext(layout, options={"pipeline_cuts": list(paths)}))


def _data_flows_forward_then_back(tg):
    for node in tg.call_nodes():
        for source in node.all_input_nodes:
            if STAGE not in source.meta:
                continue
            if source.meta[M.ROLE] == M.Role.BACKWARD:  # gradients flow to earlier stages
                assert source.meta[STAGE] >= node.meta[STAGE], (source.name, node.name)
            else:  # activations to later ones (or the same stage's backward)
                assert source.meta[STAGE] <= node.meta[STAGE], (source.name, node.name)


@pytest.mark.parametrize("factory, path", [
    (lambda: gpt2(layers=4), "transformer.h.2.mlp"),
    (lambda: gpt2(layers=4), "transformer.h.1.attn.c_proj"),
    (lambda: llama(layers=4), "model.layers.2.post_attention_layernorm"),
    (lambda: llama(layers=4), "model.layers.1.mlp.down_proj")],
    ids=["gpt2-mlp", "gpt2-attn-proj", "llama-norm", "llama-down-proj"])
def test_a_cut_inside_a_block_splits_its_forward_ops_where_the_module_starts(factory, path):
    """A pinned cut at a module inside a block: the block's forward ops before the first
    one that runs in that module stay on the stage before, the rest and every later
    block go to the next; the backward follows each op's forward."""
    tg, result = _cut_at(factory(), path)
    assert result.stats["first_block_of_stage"] == [path]
    block = int(path.split(".")[2])
    ops = [n for n in tg.call_nodes() if n.meta.get(M.LAYER) == block
           and n.meta[M.ROLE] != M.Role.BACKWARD]
    first = next(k for k, n in enumerate(ops) if (n.meta[M.MODULE_PATH] + ".").startswith(path + "."))
    assert first > 0 and {n.meta[STAGE] for n in ops[:first]} == {0}
    assert {n.meta[STAGE] for n in ops[first:]} == {1}
    for node in tg.call_nodes():
        layer = node.meta.get(M.LAYER)
        if layer is not None and layer != block:
            assert node.meta[STAGE] == (layer > block), node.name
    _data_flows_forward_then_back(tg)


def test_a_cut_at_the_first_module_of_a_block_is_the_blocks_cut_and_bad_cuts_say_why():
    ex = gpt2(layers=4)
    assert _cut_at(ex, "transformer.h.2.ln_1")[1].stats["first_block_of_stage"] == [2]
    with pytest.raises(StageError, match=r"cut 'transformer.h.2.mpl' names no module that runs a "
                                         r"forward op in block transformer.h.2; its modules that "
                                         r"do are transformer.h.2.attn, transformer.h.2.attn."):
        _cut_at(ex, "transformer.h.2.mpl")
    with pytest.raises(StageError, match=r"3 stages need 2 distinct cuts, in order, none at "
                                         r"the first block; got \['transformer.h.2.mlp', "
                                         r"'transformer.h.2'\]"):
        _cut_at(ex, "transformer.h.2.mlp", "transformer.h.2", pp=3, microbatches=3)
    with pytest.raises(StageError, match="none at the first block"):
        _cut_at(ex, "transformer.h.0.ln_1")
    # recomputation replays a block in its backward: on one stage only
    with pytest.raises(StageError, match=r"cut 'transformer.h.2.mlp' is inside block "
                                         r"transformer.h.2, whose forward is recomputed in its "
                                         r"backward \(Layout.recompute\).*cut at a block "
                                         r"\(transformer.h.2 or transformer.h.3\) or use "
                                         r"recompute='none'"):
        tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
        autopar.run_passes(tg, autopar.Layout(pp=2, microbatches=2, recompute="selective"),
                           options={"pipeline_cuts": ["transformer.h.2.mlp"]})
    # inside the first block is a cut: the first stage holds the embeddings and part of it
    assert _cut_at(ex, "transformer.h.0.mlp")[1].stats["first_block_of_stage"] == \
        ["transformer.h.0.mlp"]


def run_back_to_back(program, model, batch):
    """Every stage's forward in order, then every backward in reverse: one micro-batch."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    entries = program.params + program.buffers
    env = {key: named[e.name] for key, e in zip(program.keys, entries)}
    env.update(zip(program.keys[len(entries):], batch))
    with torch.no_grad():
        for stage in program.stages:
            env.update(zip(stage.f_outputs, stage.forward(*[env[k] for k in stage.f_inputs])))
        for stage in reversed(program.stages):
            env.update(zip(stage.b_outputs, stage.backward(*[env[k] for k in stage.b_inputs])))
    return env[program.loss_key], [sum(env[k] for k in parts) for parts in program.grad_parts]


def _back_to_back_equals_the_joint_graph(ex, tg):
    """Lower `tg` (stages assigned, one micro-batch), run its stages back to back, and
    check the loss and gradients against the joint graph's; the program."""
    program = lower_pipeline(tg, autopar.Layout(pp=2, microbatches=1))
    loss, grads = run_back_to_back(program, ex.model, ex.batch)
    named = dict(ex.model.named_parameters())
    named.update(ex.model.named_buffers())
    flat = [named[p.name] for p in tg.signature.params] + \
        [named[b.name] for b in tg.signature.buffers]
    with torch.no_grad():
        expected = tg.gm(*flat, *ex.batch)
    torch.testing.assert_close(loss, expected[0], rtol=0, atol=0)
    for got, want in zip(grads, expected[1:]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    return program


@pytest.mark.parametrize("factory", [lambda: gpt2(layers=4), lambda: llama(layers=4),
                                     lambda: hf_tiny("falcon")], ids=["gpt2", "llama", "falcon"])
def test_stage_programs_back_to_back_equal_the_joint_graph(factory):
    ex = factory()
    tg, _ = assigned(ex, pp=2)
    program = _back_to_back_equals_the_joint_graph(ex, tg)
    sends = {s.stage: s.send_forward for s in program.stages}
    assert set(sends[0]) == {1} and sends[1] == {}  # activations go to the next stage only


@pytest.mark.parametrize("factory, path", [
    (lambda: gpt2(layers=2), "transformer.h.1.mlp"),
    (lambda: llama(layers=2), "model.layers.0.self_attn.o_proj")], ids=["gpt2", "llama"])
def test_stage_programs_cut_inside_a_block_back_to_back_equal_the_joint_graph(factory, path):
    """What crosses a cut inside a block (the residual and the module's inputs) is sent,
    and the stages' programs run back to back compute the joint graph's loss and
    gradients."""
    ex = factory()
    tg, _ = _cut_at(ex, path, microbatches=1)
    program = _back_to_back_equals_the_joint_graph(ex, tg)
    assert program.stages[0].send_forward[1] and program.stages[1].send_backward[0]


def _slowest(tg, options=None, stats=None) -> float:
    """The slowest stage's estimated seconds, its sends and receives counted."""
    if stats is None:
        layout = autopar.Layout(pp=2, microbatches=2)
        stats = AssignStages().run(tg, PassContext(layout, options=options))[1].stats
    return max(a + b for a, b in zip(stats["estimated_stage_seconds"],
                                     stats["estimated_send_seconds"]))


@pytest.mark.parametrize("factory", [lambda: gpt2(layers=4), lambda: llama(layers=4),
                                     lambda: hf_tiny("bert"), lambda: hf_tiny("mixtral")],
                         ids=["gpt2", "llama", "bert", "mixtral"])
def test_the_default_cut_moves_inside_a_block_only_where_its_slowest_stage_is_faster(factory):
    """By default a cut between blocks moves to the start of a direct child of a block
    beside it when that makes the slowest stage faster, its sends and receives counted:
    it is then no slower than the cut between blocks nor than a cut at any child of the
    block it chose (every one tried here as a pinned cut), gives the stages of that cut
    pinned, and the stages lower to the joint graph."""
    ex = factory()
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    layout = autopar.Layout(pp=2, microbatches=1)
    cut, result = AssignStages().run(tg, PassContext(layout))
    chosen = result.stats["first_block_of_stage"][0]
    between = _slowest(tg, {"cut_inside_blocks": False})
    if isinstance(chosen, int) or chosen is None:
        assert _slowest(tg, stats=result.stats) == pytest.approx(between)
        return
    container, _ = tg.source.blocks
    block = int(chosen[len(container) + 1:].split(".")[0])
    children = {(n.meta[M.MODULE_PATH] or "")[len(f"{container}.{block}") + 1:].split(".")[0]
                for n in tg.call_nodes() if n.meta.get(M.LAYER) == block
                and n.meta[M.ROLE] != M.Role.BACKWARD}
    slowest = _slowest(tg, stats=result.stats)
    assert slowest <= between + 2e-6  # the stats' seconds are rounded to 1e-6
    for child in children - {""}:
        try:
            other = _slowest(tg, {"pipeline_cuts": [f"{container}.{block}.{child}"]})
        except StageError:  # the block's first module: its own cut
            continue
        assert slowest <= other + 2e-6, (chosen, child)
    pinned, _ = AssignStages().run(tg, PassContext(layout, options={"pipeline_cuts": [chosen]}))
    assert [n.meta[STAGE] for n in pinned.call_nodes()] == [n.meta[STAGE] for n in cut.call_nodes()]
    _data_flows_forward_then_back(cut)
    _back_to_back_equals_the_joint_graph(ex, cut)


def test_no_default_cut_inside_a_recomputed_block_or_with_virtual_stages():
    """A block recomputed in its backward would run its recomputation on both stages, and
    a rank of an interleaved pipeline holds several stages: the cuts stay between blocks."""
    ex = load_example("gpt2-small4", vocab=4096, hidden=256, layers=4)
    micro = tuple(t[:len(t) // 4] for t in ex.batch)
    tg = autopar.trace(ex.model, micro, ex.loss_fn)
    local = autopar.ClusterSpec.local(2)
    moved = AssignStages().run(tg, PassContext(autopar.Layout(pp=2, microbatches=4), local))
    assert moved[1].stats["first_block_of_stage"] == ["transformer.h.2.ln_2"]  # else: moot
    interleaved = autopar.Layout(pp=2, microbatches=4, virtual_stages=2, schedule="interleaved")
    stats = AssignStages().run(tg, PassContext(interleaved, local))[1].stats
    assert not any(isinstance(b, str) for b in stats["first_block_of_stage"]), stats
    recomputed = autopar.run_passes(tg, autopar.Layout(pp=2, microbatches=4, recompute="full"),
                                    local, passes=["recompute", "assign_stages"])[1]
    stats = {r.name: r for r in recomputed}["assign_stages"].stats
    assert not isinstance(stats["first_block_of_stage"][0], str), stats


@pytest.mark.parametrize("arch", ["bert", "mixtral", "falcon", "gpt_neox", "phi3"])
def test_a_cut_at_any_architectures_middle_module_lowers_to_the_joint_graph(arch):
    """No module names assumed: cut the last block at whichever of its direct children
    starts nearest the middle of its forward ops; data still flows forward then back,
    and the lowered stages compute the joint graph's loss and gradients."""
    ex = hf_tiny(arch)
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    container, count = tg.source.blocks
    block = f"{container}.{count - 1}"
    ops = [n for n in tg.call_nodes() if n.meta.get(M.LAYER) == count - 1
           and n.meta[M.ROLE] != M.Role.BACKWARD]
    starts = {}
    for k, n in enumerate(ops):
        inside = (n.meta[M.MODULE_PATH] or "")[len(block) + 1:].split(".")[0]
        if inside:
            starts.setdefault(f"{block}.{inside}", k)
    path = min((p for p in starts if starts[p] > 0), key=lambda p: abs(starts[p] - len(ops) / 2))
    cut, result = AssignStages().run(tg, PassContext(autopar.Layout(pp=2, microbatches=1),
                                                     options={"pipeline_cuts": [path]}))
    assert result.stats["first_block_of_stage"] == [path]
    _data_flows_forward_then_back(cut)
    _back_to_back_equals_the_joint_graph(ex, cut)


def test_tied_weight_gets_one_gradient_part_per_stage_and_nothing_big_crosses():
    ex = gpt2(layers=4, vocab=1024)
    tg, _ = assigned(ex, pp=2, microbatches=2)
    program = lower_pipeline(tg, autopar.Layout(pp=2, microbatches=2))
    names = [p.name for p in program.params]
    assert len(program.grad_parts[names.index("transformer.wte.weight")]) == 2
    assert all(len(parts) == 1 for name, parts in zip(names, program.grad_parts)
               if name != "transformer.wte.weight")
    table = 1024 * 64
    for stage in program.stages:
        for keys in list(stage.send_forward.values()) + list(stage.send_backward.values()):
            assert all(torch.Size(program.values[k].shape).numel() < table for k in keys)


def test_zero_bubble_splits_each_backward_into_input_and_weight_gradients():
    ex = llama(layers=4)
    layout = autopar.Layout(pp=2, microbatches=1, schedule="zero-bubble")
    tg, _ = assigned(ex, pp=2)
    program = lower_pipeline(tg, layout)
    first, last = program.stages
    sent = set(last.send_backward[0])
    i_gm, i_in, i_out = last.input_grad
    w_gm, w_in, w_out = last.weight_grad
    assert sent <= set(i_out) and not sent & set(w_out)
    mm = torch.ops.aten.mm.default
    assert any(n.target == mm for n in w_gm.graph.nodes)  # weight gradients wait for W
    parts = {k for ps in program.grad_parts for k in ps}
    assert parts & set(w_out)
    # I then W computes what B computes
    named = dict(ex.model.named_parameters())
    entries = program.params + program.buffers
    env = {key: named.get(e.name, dict(ex.model.named_buffers()).get(e.name))
           for key, e in zip(program.keys, entries)}
    env.update(zip(program.keys[len(entries):], ex.batch))
    with torch.no_grad():
        for stage in program.stages:
            env.update(zip(stage.f_outputs, stage.forward(*[env[k] for k in stage.f_inputs])))
        split_env = dict(env)
        for stage in reversed(program.stages):
            env.update(zip(stage.b_outputs, stage.backward(*[env[k] for k in stage.b_inputs])))
            for gm, ins, outs in (stage.input_grad, stage.weight_grad):
                split_env.update(zip(outs, gm(*[split_env[k] for k in ins])))
    for k in parts:
        torch.testing.assert_close(split_env[k], env[k], rtol=0, atol=0)
