"""PassManager: requires/provides, verification after each pass, IR dumps, user passes."""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.trace import retrace, trace_train_step
from autopar.compiler.ir.verify import VerificationError
from autopar.compiler.passes.assign_stages import StageError
from autopar.compiler.passes.base import GraphPass, PassContext, PassOptions, PassResult
from autopar.compiler.passes.defaults import run_passes
from autopar.compiler.passes.insert_allreduce import InsertAllReduce
from autopar.compiler.passes.manager import (PassManager, PassOrderError, get_pass,
                                             register_pass, registered_passes)
from autopar.layout import Layout


@pytest.fixture(scope="module")
def tiny_graph():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return trace_train_step(model, (torch.randn(4, 4),), lambda out, x: out.square().mean())


class NeedsStages(GraphPass):
    name = "needs_stages"
    requires = frozenset({"traced", "stages_cut"})

    def run(self, tg, ctx):
        return tg, PassResult(self.name, changed=False)


class CutsStages(GraphPass):
    name = "cuts_stages"
    provides = frozenset({"stages_cut"})

    def run(self, tg, ctx):
        return tg.copy(), PassResult(self.name, changed=True)


class DropsMetadata(GraphPass):
    name = "drops_metadata"

    def run(self, tg, ctx):
        tg = tg.copy()
        tg.call_nodes()[0].meta.pop(M.ROLE)
        return tg, PassResult(self.name, changed=True)


def test_pass_whose_requirement_is_missing_is_refused_and_suppliers_named(tiny_graph):
    with pytest.raises(PassOrderError, match=r"needs_stages.*stages_cut.*cuts_stages"):
        PassManager([NeedsStages(), CutsStages()]).run(tiny_graph, PassContext())
    out, results = PassManager([CutsStages(), NeedsStages()]).run(tiny_graph, PassContext())
    assert "stages_cut" in out.provides
    assert out.history == ("cuts_stages", "needs_stages")
    assert [r.name for r in results] == ["cuts_stages", "needs_stages"]
    assert all(r.seconds >= 0 for r in results)


@register_pass
class FailsOnPurpose(GraphPass):
    """Raises the error type a caller may catch (StageError), as a real pass would."""

    name = "test_fails_on_purpose"

    def run(self, tg, ctx):
        raise StageError("cannot cut this model on purpose")


def test_verifier_runs_after_each_pass_and_names_the_pass(tiny_graph):
    with pytest.raises(VerificationError, match="created by tracing lacks metadata") as caught:
        PassManager([CutsStages(), DropsMetadata()]).run(tiny_graph, PassContext())
    assert str(caught.value).startswith(
        "pass 'drops_metadata' returned an invalid graph (pass 2 of 2; ran before it: "
        "'cuts_stages'): node ")


def test_a_failing_pass_is_named_with_the_passes_before_it(tiny_graph):
    """The error keeps its type and message (callers catch it, tests match it) and gains
    a note naming the pass, its place and what ran before it, shown in tracebacks."""
    with pytest.raises(StageError, match="on purpose\nin pass 'test_fails_on_purpose'") as caught:
        run_passes(tiny_graph, Layout(), passes=[CutsStages(), "test_fails_on_purpose"])
    assert str(caught.value) == "cannot cut this model on purpose"
    note = "in pass 'test_fails_on_purpose' (pass 2 of 2; ran before it: 'cuts_stages')"
    assert caught.value.__notes__ == [note]
    assert note in "".join(traceback.format_exception(caught.value))
    with pytest.raises(StageError) as caught:
        PassManager([FailsOnPurpose()]).run(tiny_graph, PassContext())
    assert caught.value.__notes__ == [
        "in pass 'test_fails_on_purpose' (pass 1 of 1; ran before it: none)"]


class _FailingHook:
    """A forward hook that fails when the step is traced with it."""

    def call_function(self, node, args, kwargs, run):
        raise RuntimeError("the hook fails on purpose")


class DefersAFailingRetrace(GraphPass):
    name = "defers_a_failing_retrace"
    requires = frozenset({"traced", "retraceable"})
    invalidates = frozenset()

    def run(self, tg, ctx):
        assert ctx.may_defer_retrace
        return retrace(tg, _FailingHook(), deferred=True), PassResult(self.name, changed=True)


class RetracesLater(GraphPass):
    """Reads only the source, like AMP; here it leaves the graph as it came (AMP off)."""

    name = "retraces_later"
    requires = frozenset({"traced", "retraceable"})
    invalidates = frozenset()
    retraces_from_source = True

    def run(self, tg, ctx):
        return tg, PassResult(self.name, changed=False)


def test_a_failing_deferred_retrace_names_the_pass_that_left_it(tiny_graph):
    with pytest.raises(RuntimeError, match="the hook fails on purpose") as caught:
        PassManager([DefersAFailingRetrace(), RetracesLater()]).run(tiny_graph, PassContext())
    assert ("in the re-trace pass 'defers_a_failing_retrace' left to the next pass (passes "
            "run: 'defers_a_failing_retrace', 'retraces_later')") in caught.value.__notes__


def test_input_graph_is_never_modified(tiny_graph):
    before = [n.format_node() for n in tiny_graph.graph.nodes]
    PassManager([InsertAllReduce()]).run(tiny_graph, PassContext(Layout(dp=2)))
    assert [n.format_node() for n in tiny_graph.graph.nodes] == before


def test_dump_writes_ir_after_each_pass(tiny_graph, tmp_path):
    PassManager([CutsStages(), InsertAllReduce()], dump_dir=tmp_path).run(
        tiny_graph, PassContext(Layout(dp=2)))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["000_traced.py", "001_cuts_stages.py", "002_insert_allreduce.py"]
    assert "all_reduce" in (tmp_path / "002_insert_allreduce.py").read_text()


def test_user_pass_registration():
    @register_pass
    class CountMatmuls(GraphPass):
        name = "test_count_matmuls"

        def run(self, tg, ctx):
            n = sum(1 for node in tg.call_nodes() if node.target == torch.ops.aten.mm.default)
            return tg, PassResult(self.name, changed=False, stats={"mm": n})

    assert "test_count_matmuls" in registered_passes()
    assert isinstance(get_pass("test_count_matmuls"), CountMatmuls)
    with pytest.raises(ValueError, match="already registered"):
        register_pass(type("Other", (GraphPass,), {"name": "test_count_matmuls"}))
    with pytest.raises(KeyError, match="no pass named 'nope'"):
        get_pass("nope")


def test_context_and_options_are_frozen_and_typed(tiny_graph):
    ctx = PassContext(options={"tp_rank": 1, "pipeline_cuts": ["h.2"],
                               "amp_lists": {"white": ["mm"]}})
    assert isinstance(ctx.options, PassOptions)
    assert (ctx.options.tp_rank, ctx.options.pipeline_cuts) == (1, ("h.2",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.options.tp_rank = 2
    with pytest.raises(TypeError):
        ctx.options.amp_lists["black"] = ["mm"]
    assert PassContext().options == PassOptions()
    known = (r"\['tp_rank', 'dp_rank', 'optimizer_memory', 'memory_budget', 'pipeline_cuts', "
             r"'cut_inside_blocks', 'amp_lists', 'hierarchy_form'\]")
    with pytest.raises(TypeError, match=r"unknown pass option\(s\) \['loss_scale'\]; the options are "
                       + known):
        PassContext(options={"loss_scale": 2.0})
    with pytest.raises(TypeError, match=r"unknown pass option\(s\) \['tp'\]"):
        run_passes(tiny_graph, Layout(), passes=[], options={"tp": 1})
    with pytest.raises(ValueError, match="tp_rank must be an int >= 0, got -1"):
        PassOptions(tp_rank=-1)
    with pytest.raises(ValueError, match="unknown optimizer kind 'lion'"):
        PassOptions(optimizer_memory="lion")
    with pytest.raises(TypeError, match="the cluster must be an autopar.ClusterSpec or None, "
                       "got str 'dgx-h100'"):
        PassContext(cluster="dgx-h100")


def _two_layer_mlp():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    return trace_train_step(model, (torch.randn(4, 8),), lambda out, x: out.square().mean())


def test_tensor_parallel_leaves_its_retrace_to_amp(monkeypatch):
    """TP then AMP: AMP re-traces from the source (TP's hook included), so TP's own trace
    is skipped; the graph, attrs and history equal the passes run one by one."""
    from autopar.cluster import ClusterSpec
    from autopar.compiler.ir import trace as trace_module
    from autopar.compiler.ir.printing import graph_text
    from autopar.compiler.passes.amp import AutoMixedPrecision
    from autopar.compiler.passes.tensor_parallel import TensorParallel

    tg, layout = _two_layer_mlp(), Layout(tp=2, amp="bf16")
    ctx = PassContext(layout, ClusterSpec.local(2))
    one, _ = PassManager([TensorParallel()]).run(tg, ctx)
    apart, _ = PassManager([AutoMixedPrecision()]).run(one, ctx)
    traces = []
    real = trace_module._trace_from
    monkeypatch.setattr(trace_module, "_trace_from", lambda source: traces.append(1) or real(source))
    together, results = PassManager([TensorParallel(), AutoMixedPrecision()]).run(tg, ctx)
    assert len(traces) == 1, "TP's trace was not left to AMP"
    assert not together.retrace_pending
    assert graph_text(together) == graph_text(apart)
    assert together.attrs["tp"] == apart.attrs["tp"] and together.attrs["amp"] == apart.attrs["amp"]
    assert together.history == apart.history == ("tensor_parallel", "amp")
    assert [r.name for r in results] == ["tensor_parallel", "amp"]


def test_a_deferred_retrace_is_done_when_no_pass_does_it():
    """If the pass after a deferring one does not re-trace after all (AMP off), the
    manager traces the graph before the next pass and at the end: nothing stale leaves."""
    from autopar.cluster import ClusterSpec
    from autopar.compiler.ir.printing import graph_text
    from autopar.compiler.passes.amp import AutoMixedPrecision
    from autopar.compiler.passes.tensor_parallel import TensorParallel

    tg, ctx = _two_layer_mlp(), PassContext(Layout(tp=2), ClusterSpec.local(2))
    alone, _ = PassManager([TensorParallel()]).run(tg, ctx)
    out, _ = PassManager([TensorParallel(), AutoMixedPrecision("off")]).run(tg, ctx)
    assert not out.retrace_pending
    assert graph_text(out) == graph_text(alone)
    shapes = {tuple(p.meta["val"].shape) for p in out.placeholders()}
    assert shapes & {(8, 8), (16, 4)}, f"the first weight (16 x 8) is not split: {shapes}"


@pytest.mark.parametrize("layout", [Layout(dp=2, zero=3, recompute="full"),
                                    Layout(dp=2, pp=2, microbatches=2)],
                         ids=["zero3_recompute", "pp2"])
def test_a_run_copies_the_callers_graph_once_and_rewrites_as_pass_by_pass(layout, monkeypatch):
    """The default passes after the trace (gradient sums, ZeRO-3's gathers, recomputation,
    the stage cut, fusion) hand each other their graphs (PassContext.owns_input): one
    copy of the caller's graph in a run, and the program every pass run alone on a
    graph it must copy gives, node for node; the caller's graph unchanged."""
    from autopar.cluster import ClusterSpec
    from autopar.compiler.ir.graph import TrainGraph
    from autopar.compiler.ir.printing import graph_text
    from autopar.compiler.passes.defaults import default_passes
    from autopar.examples import gpt2

    example = gpt2(layers=4)
    traced = trace_train_step(example.model, example.batch, example.loss_fn)
    before = graph_text(traced)
    cluster = ClusterSpec.local(layout.world_size)
    passes = default_passes(layout)
    copies, owned = [], []
    real_copy = TrainGraph.copy
    monkeypatch.setattr(TrainGraph, "copy",
                        lambda self: copies.append(1) or real_copy(self))
    for p in passes:
        real_run = type(p).run
        monkeypatch.setattr(p, "run", lambda tg, ctx, _run=real_run, _p=p:
                            owned.append((_p.name, ctx.owns_input)) or _run(_p, tg, ctx))
    together, _ = run_passes(traced, layout, cluster, passes)
    assert graph_text(traced) == before
    assert len(copies) == 1, (copies, owned)
    # the first pass gets the caller's graph; once one has rewritten it, the rest own theirs
    assert not owned[0][1] and owned[-1] == ("fusion", True), owned
    assert sum(o for _, o in owned) >= 2, owned
    one_by_one = traced
    for p in passes:
        one_by_one, _ = PassManager([p]).run(one_by_one, PassContext(layout, cluster))
    assert len(copies) > 2  # alone, each rewriting pass copied its input
    assert graph_text(together) == graph_text(one_by_one)
    assert together.signature == one_by_one.signature


class EditsInPlace(GraphPass):
    """A pass that rewrites the graph it is handed when it owns it (`writable`)."""
    name = "edits_in_place"

    def run(self, tg, ctx):
        from autopar.compiler.passes.base import writable

        out = writable(tg, ctx)
        out.attrs["owned"] = ctx.owns_input
        return out, PassResult(self.name, changed=True)


def test_only_a_graph_made_in_the_run_is_handed_over_to_edit(tiny_graph):
    """The caller's graph is copied before an edit, also when a pass before handed it on
    unchanged; a graph a pass made is the next pass's."""
    class Unchanged(GraphPass):
        name = "unchanged"

        def run(self, tg, ctx):
            return tg, PassResult(self.name, changed=False)

    out, _ = PassManager([Unchanged(), EditsInPlace()]).run(tiny_graph, PassContext())
    assert out.attrs["owned"] is False and out.graph is not tiny_graph.graph
    assert "owned" not in tiny_graph.attrs
    out, _ = PassManager([CutsStages(), EditsInPlace()]).run(tiny_graph, PassContext())
    assert out.attrs["owned"] is True
