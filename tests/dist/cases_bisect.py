"""autopar.bisect across processes: every layout of the parity matrix that runs one
program per rank agrees with the single-process step node by node, and each injected bug
(tests/bisect_bugs.py) is named with its node, its pass and the ranks it is wrong on."""

from __future__ import annotations

import autopar
from autopar.bisection import bisect
from autopar.examples import gpt2, hf_tiny, llama
from autopar.runtime.pipeline import PipelineStep
from tests.bisect_bugs import (
    DropOneAllReduce,
    ScaleOneGradient,
    StaleRecomputeInput,
    WrongShardOffset,
    with_bug,
)
from tests.dist.registry import case

_CORRECT_2 = [
    (gpt2, autopar.Layout(dp=2)),
    (gpt2, autopar.Layout(dp=2, zero=3)),
    (llama, autopar.Layout(dp=2, zero=2, recompute="full")),
    (gpt2, autopar.Layout(tp=2)),
    (gpt2, autopar.Layout(tp=2, sequence_parallel=True, recompute="selective")),
    (llama, autopar.Layout(tp=2, sequence_parallel=True)),
    (llama, autopar.Layout(tp=2, amp="bf16")),
    (gpt2, autopar.Layout(dp=2, zero=3, amp="bf16")),
    (gpt2, autopar.Layout(pp=2, microbatches=2)),
    (llama, autopar.Layout(pp=2, microbatches=2, schedule="zero-bubble", recompute="full")),
    (gpt2, autopar.Layout(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)),
    (llama, autopar.Layout(dp=2, microbatches=2, zero=2)),
    (gpt2, autopar.Layout(tp=2, microbatches=4)),
    (lambda layers: gpt2(layers=layers, vocab=255), autopar.Layout(dp=2, zero=3)),  # odd rows
    # transformers models from small configs, as users build them
    (lambda layers: hf_tiny("qwen2"), autopar.Layout(tp=2)),
    # its fused q/k/v in pieces of unequal sizes (tp_rules.Strided)
    (lambda layers: hf_tiny("phi3"), autopar.Layout(tp=2)),
    (lambda layers: hf_tiny("opt"), autopar.Layout(pp=2, microbatches=2)),
]
_CORRECT_4 = [
    (gpt2, autopar.Layout(dp=2, tp=2, zero=2)),
    (llama, autopar.Layout(dp=2, tp=2, zero=3, sequence_parallel=True)),
    (gpt2, autopar.Layout(dp=4, zero=3, recompute="full")),
    (llama, autopar.Layout(dp=2, pp=2, microbatches=2, zero=3)),
    (gpt2, autopar.Layout(tp=2, pp=2, microbatches=2)),
    (gpt2, autopar.Layout(dp=2, pp=2, microbatches=2, zero=2)),
    (llama, autopar.Layout(dp=2, tp=2, zero=2, recompute="full")),
]


def _no_divergence(layouts):
    for factory, layout in layouts:
        ex = factory(layers=4 if layout.virtual_stages > 1 else 2)
        report = bisect(ex.model, ex.batch, ex.loss_fn, layout)
        assert report.ok, str(report)
        assert report.compared > 100, str(report)


@case(world=2)
def bisect_finds_no_divergence_in_correct_layouts_on_2_ranks():
    _no_divergence(_CORRECT_2)


@case(world=4)
def bisect_finds_no_divergence_in_correct_layouts_on_4_ranks():
    _no_divergence(_CORRECT_4)


def _first(layout, bug, factory=gpt2):
    ex = factory(layers=2)
    passes = with_bug(layout, bug) if bug is not None else None
    report = bisect(ex.model, ex.batch, ex.loss_fn, layout, passes=passes)
    assert report.first is not None, f"no divergence found: {report}"
    return report.first


@case(world=2)
def bisect_names_a_gradient_scaled_by_1_0001_under_dp():
    first = _first(autopar.Layout(dp=2), ScaleOneGradient())
    assert (first.cause, first.cause_pass) == (ScaleOneGradient.made, "scale_one_gradient"), \
        str(first)
    # seen where the synchronised gradient leaves the step, 1e-4 off, on both ranks
    assert 5e-5 < first.error < 2e-4 and first.ranks == (0, 1), str(first)


@case(world=2)
def bisect_names_a_dropped_gradient_all_reduce():
    first = _first(autopar.Layout(dp=2), DropOneAllReduce(), factory=llama)
    assert (first.cause, first.cause_pass) == (DropOneAllReduce.made, "drop_one_allreduce"), \
        str(first)
    assert first.placement == "dp: replicated" and first.error > 0.1, str(first)


@case(world=2)
def bisect_names_a_tensor_parallel_shard_read_at_the_wrong_offset_and_its_rank():
    first = _first(autopar.Layout(tp=2), WrongShardOffset())
    # the rolled read exists on rank 0 only (the report is the same on every rank)
    assert (first.cause_op, first.cause_pass) == ("roll", "wrong_shard_offset"), str(first)
    assert first.ranks == (0,), str(first)  # only rank 0 reads off
    assert first.module == "transformer.h.0.mlp.c_fc" and "tp: split on dim" in first.placement


@case(world=2)
def bisect_names_a_recomputed_node_that_reads_a_stale_input():
    first = _first(autopar.Layout(dp=2, recompute="full"), StaleRecomputeInput())
    assert (first.node, first.pass_name) == (StaleRecomputeInput.made, "stale_recompute_input"), \
        str(first)
    assert first.module == "transformer.h.1.attn", str(first)


@case(world=2)
def bisect_names_a_pipeline_stage_that_sends_the_wrong_micro_batch():
    """Stage 0 sends micro-batch 0's activations again in place of micro-batch 1's (a
    runtime bug, injected into PipelineStep for this case)."""
    run = PipelineStep._do

    def stale_send(self, action, stage, env, *rest):
        if action.kind == "SF" and stage.stage == 0:
            if action.microbatch == 0:
                self.first_env = env
            elif action.microbatch == 1:
                env = self.first_env
        return run(self, action, stage, env, *rest)

    PipelineStep._do = stale_send
    try:
        first = _first(autopar.Layout(pp=2, microbatches=2), None)
    finally:
        PipelineStep._do = run
    assert first.program == "stage 1 forward" and first.op == "placeholder", str(first)
    assert first.microbatches == (1,) and first.ranks == (1,), str(first)
    assert first.pass_name.startswith("pipeline runtime (received"), str(first)
