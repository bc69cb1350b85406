"""autopar.bisect in one process (the multi-process cases are in tests/dist/cases_bisect.py):
a correct program agrees with the single-process step node by node, an injected bug is
named with its node and pass, and what bisect cannot compare is refused clearly."""

import pytest

import autopar
from autopar.bisection import BisectError, _align, bisect
from autopar.examples import gpt2, hf_tiny
from tests.bisect_bugs import StaleRecomputeInput, with_bug


@pytest.mark.parametrize("layout", [autopar.Layout(), autopar.Layout(recompute="full"),
                                    autopar.Layout(recompute="selective", fusion=False)])
def test_a_correct_program_has_no_divergence(layout):
    ex = gpt2(layers=2)
    report = bisect(ex.model, ex.batch, ex.loss_fn, layout)
    assert report.ok, str(report)
    assert report.compared > 200  # forward, loss and backward, not a handful of nodes


def test_a_recomputed_node_reading_a_stale_input_is_named_with_its_pass():
    ex = gpt2(layers=2)
    layout = autopar.Layout(recompute="full")
    report = bisect(ex.model, ex.batch, ex.loss_fn, layout,
                    passes=with_bug(layout, StaleRecomputeInput()))
    first = report.first
    assert first is not None
    assert first.node == StaleRecomputeInput.made
    assert first.pass_name == "stale_recompute_input"
    assert first.module == "transformer.h.1.attn" and "modeling_gpt2.py" in first.source
    assert first.error > 1e-2 > first.allowed
    assert f"first divergence at node {first.node}" in str(report)


def test_a_model_that_draws_random_numbers_is_refused():
    ex = hf_tiny("gpt2")
    ex.model.config.attn_pdrop = 0.0
    ex.model.transformer.drop.p = 0.1
    with pytest.raises(BisectError, match=r"transformer.drop draws random numbers .*dropout 0"):
        bisect(ex.model, ex.batch, ex.loss_fn, autopar.Layout())


def test_micro_batches_in_one_process_agree_per_micro_batch():
    """Gradient accumulation runs each stage program once per micro-batch: the forward
    values are the reference's rows of that micro-batch, the gradients partial sums."""
    ex = gpt2(layers=2)
    report = bisect(ex.model, ex.batch, ex.loss_fn,
                    autopar.Layout(microbatches=4, recompute="full"))
    assert report.ok and report.compared > 200, str(report)


def test_a_missing_layout_and_fp16_are_refused():
    ex = gpt2(layers=2)
    with pytest.raises(BisectError, match="needs a layout"):
        bisect(ex.model, ex.batch, ex.loss_fn, None)
    with pytest.raises(BisectError, match="amp='bf16'"):
        bisect(ex.model, ex.batch, ex.loss_fn, autopar.Layout(amp="fp16"))


def test_one_process_recomputing_and_fused_is_within_the_references_own_rounding():
    """In one process the program runs the reference's ops on the same batch: recomputed
    copies repeat them, and a fused region on a CPU runs the same aten ops, so no value
    is further from the exact (float64) one than the fp32 reference's own value is."""
    ex = gpt2(layers=1)
    report = bisect(ex.model, ex.batch, ex.loss_fn, autopar.Layout(recompute="full"),
                    rounding=1.0)
    assert report.ok and report.compared > 100, str(report)
    assert report.closest_call < 1.0


@pytest.mark.processes
def test_the_command_line_launches_the_ranks_and_reports():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "autopar", "bisect", "mlp", "--dp", "2",
                          "--json"], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["compared"] > 10 and report["layout"] == {"dp": 2}
    assert "Warning" not in out.stderr, out.stderr[-2000:]  # nothing from `python -m` either


@pytest.mark.processes
def test_the_command_line_refuses_a_layout_the_model_cannot_take_in_one_line():
    """The ranks fail to build the layout alike (two blocks, four stages): the command
    ends with the reason, without their tracebacks or torchrun's report."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "autopar", "bisect", "gpt2-tiny", "--pp", "2",
                          "--virtual-stages", "2", "--schedule", "interleaved",
                          "--microbatches", "4"], check=False, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "autopar bisect: 4 pipeline stages (pp=2 x virtual_stages=2) but the model has 2 "
        "repeated blocks to cut between; use pp*virtual_stages <= 2"), out.stderr
    assert "Traceback" not in out.stderr



def test_align_pairs_a_forward_group_in_traced_order_and_a_backward_group_by_its_last_op():
    """A fused region's outputs stand where the region does: here the rank graph lists
    the value cast of an attention before its key cast. Paired in graph order, each would
    be compared with the other's reference (same op, same shape under GQA). Entries are
    Provenance tuples: (name, op, exported op, backward?, seq_nr)."""
    ref = [("cast_k", "_to_copy", "sdpa", False, 10), ("cast_v", "_to_copy", "sdpa", False, 11),
           ("attn", "sdpa", "sdpa", False, 12),
           ("g_mm", "mm", None, True, 12), ("g_view", "view", None, True, 12)]
    mine = [(p[0], p) for p in [
        ("my_v", "_to_copy", "sdpa", False, 11), ("my_k", "_to_copy", "sdpa", False, 10),
        ("my_attn", "sdpa", "sdpa", False, 12),
        # a pass lowered the backward another way: only its last value pairs
        ("my_perm", "permute", None, True, 12), ("my_mm", "mm", None, True, 12),
        ("my_view", "view", None, True, 12)]]
    out = {}
    _align(mine, ref, out)
    assert out == {"my_k": "cast_k", "my_v": "cast_v", "my_attn": "attn", "my_view": "g_view"}
