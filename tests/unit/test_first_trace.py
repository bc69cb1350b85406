"""A step traced once by its first re-tracing pass (trace.pending_trace): the same graph
as a trace and then the pass, one joint trace fewer; and the planner, whose layouts with
AMP start from such a trace, predicting exactly what it predicted from two."""

from __future__ import annotations

import logging

import pytest
import torch

import autopar
from autopar.compiler.ir import trace as T
from autopar.compiler.ir.printing import graph_text
from autopar.compiler.passes.amp import AutoMixedPrecision
from autopar.compiler.passes.defaults import run_passes
from autopar.compiler.passes.insert_allreduce import InsertAllReduce
from autopar.compiler.passes.tensor_parallel import TensorParallel
from autopar.compiler.planner.cost_model import layer_costs
from autopar.compiler.planner.estimate import Estimator
from autopar.examples import causal_lm_loss
from tests.unit.test_cost_model import meta_gpt2

logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


@pytest.fixture
def joint_traces(monkeypatch):
    """How many joint graphs were traced (trace._trace_joint calls) since the test began."""
    count = [0]
    real = T._trace_joint

    def counted(source):
        count[0] += 1
        return real(source)

    monkeypatch.setattr(T, "_trace_joint", counted)
    return count


def _tiny():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                       n_positions=16, use_cache=False))
    return model, (torch.randint(0, 64, (4, 16)),)


@pytest.mark.parametrize("passes, layout", [
    ([AutoMixedPrecision()], autopar.Layout(dp=1, amp="bf16")),
    ([AutoMixedPrecision()], autopar.Layout(dp=1, amp="fp16")),  # with the loss scale input
    ([TensorParallel(), AutoMixedPrecision()], autopar.Layout(tp=2, amp="bf16")),
    ([TensorParallel()], autopar.Layout(tp=2)),
    ([InsertAllReduce()], autopar.Layout(dp=2)),  # does not re-trace: traced before it
    ([], autopar.Layout()),  # no pass: traced at the end
])
def test_a_pending_trace_gives_the_graph_of_a_trace_and_its_passes(passes, layout, joint_traces):
    model, batch = _tiny()
    cluster = autopar.ClusterSpec.local(layout.world_size)
    eager = run_passes(T.trace_train_step(model, batch, causal_lm_loss), layout, cluster,
                       passes)[0]
    traced_eagerly = joint_traces[0]
    pending = T.pending_trace(T.trace_source(model, batch, causal_lm_loss))
    assert pending.retrace_pending and not list(pending.graph.nodes)
    if not passes:  # the signature is known without tracing
        assert pending.signature == eager.signature
    lazy = run_passes(pending, layout, cluster, passes)[0]
    assert not lazy.retrace_pending and lazy.history == eager.history
    assert graph_text(lazy) == graph_text(eager)
    assert lazy.signature == eager.signature
    assert {k: v for k, v in lazy.attrs.items() if k != "amp"} == \
        {k: v for k, v in eager.attrs.items() if k != "amp"}
    retraces = any(p.retraces_from_source for p in passes[:1])
    # traced once by the passes that re-trace first, where a trace and its re-trace were two
    assert joint_traces[0] - traced_eagerly == traced_eagerly - (1 if retraces else 0)


FIELDS = [dict(dp=8, amp="bf16"), dict(dp=8, zero=3, amp="fp16", recompute="selective"),
          dict(dp=4, tp=2, amp="bf16"), dict(dp=2, pp=4, microbatches=8, amp="bf16"),
          dict(dp=8, microbatches=2, amp="fp16"), dict(dp=8)]


# every block traced ("exact") for three layouts: the others' exact variants took up to
# 35 s each in a full suite run and take no path their two-block variants do not
@pytest.mark.parametrize("fields, blocks", [(f, 2) for f in FIELDS] + [
    (FIELDS[0], "exact"), (FIELDS[1], "exact"), (FIELDS[3], "exact")])
def test_the_planner_predicts_from_one_trace_what_it_did_from_two(fields, blocks, joint_traces):
    """Traces with the cluster trace a micro-batch first asked for by a layout with AMP
    with AMP's hook (Traces._first_trace); without it (cluster None: a list of the
    caller's own passes does so) the trace is made without hooks and AMP traces again."""
    model, batch = meta_gpt2(layers=4, hidden=128, heads=4, vocab=1000, batch=16, seq=64)
    c = autopar.ClusterSpec.preset("dgx-h100")
    layout = autopar.Layout(**fields)
    once = Estimator(model, c, batch, causal_lm_loss, trace_blocks=blocks)
    got = once.predict(layout)
    traced_once = joint_traces[0]
    twice = Estimator(model, c, batch, causal_lm_loss, trace_blocks=blocks)
    twice.traces.cluster = None
    want = twice.predict(layout)
    assert (got.step_time_s, got.peak_memory_bytes, got.flops_per_step, got.breakdown,
            got.memory) == (want.step_time_s, want.peak_memory_bytes, want.flops_per_step,
                            want.breakdown, want.memory)
    # AMP without tp: its trace is the only one; with tp the AMP trace gives the FLOPs
    # and tensor parallelism's re-trace the graph, as the plain trace and it did
    saved = 1 if layout.amp != "off" and layout.tp == 1 else 0
    assert traced_once == joint_traces[0] - traced_once - saved
    # the report's per-layer rows read the graph in the layout's precision: the first
    # trace where it had AMP, AMP run on the plain trace where it did not
    rows = once.layer_rows(layout)
    assert rows == twice.layer_rows(layout)
    if layout.amp != "off":  # AMP run on the plain trace here gives the same rows
        plain = once.traced(layout)
        cast = run_passes(plain, layout, c, [AutoMixedPrecision()])[0]
        assert rows == layer_costs(cast, c) != layer_costs(plain, c)
        assert [r["flops"] for r in rows] == [r["flops"] for r in layer_costs(plain, c)]


@pytest.mark.parametrize("fields, programs", [(dict(dp=2, tp=2, amp="bf16"), 2),
                                              (dict(dp=4, amp="fp16"), 1),
                                              (dict(dp=4, zero=3), 4),
                                              (dict(dp=2, tp=2), 2)])
def test_compile_traces_once_per_program_when_its_passes_re_trace_first(fields, programs,
                                                                       joint_traces):
    """autopar.check (compile's programs, every rank's, in one process) starts from
    passes.defaults.first_graph: each program with tensor parallelism or AMP is traced
    once, with their hooks; without them the one trace is shared by every program."""
    model, batch = _tiny()
    layout = autopar.Layout(**fields)
    autopar.check(model, batch, causal_lm_loss, layout)
    retraces = layout.tp > 1 or layout.amp != "off"
    assert joint_traces[0] == (programs if retraces else 1)
