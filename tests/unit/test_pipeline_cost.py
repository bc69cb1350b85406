"""The pipeline step-time model: each term against hand-computed values, then on
real stage-assigned graphs (tp, pp, micro-batches, schedules) through estimate."""

from __future__ import annotations

import pytest

import autopar
from autopar.cluster import ClusterSpec
from autopar import costs
from autopar.compiler.planner import cost_model as cm
from autopar.compiler.planner import pipeline_cost as pc
from autopar.compiler.planner.stages import Message, StageSummary
from autopar.compiler.analysis.summary import GraphSummary, OpRecord, summarize
from autopar.examples import causal_lm_loss
from tests.unit.test_cost_model import EXACT, cluster, meta_gpt2


def two_stage(params=(), param_stages=(), messages=(), f=1.0, b=2.0, flops=1e12):
    """Stage 0 and 1, each one forward op of `f` s and one backward op of `b` s."""
    def op(name, role, seconds):
        return OpRecord(name, role, flops=int(seconds * flops), dtype="fp32")

    ops = (op("f0", "forward", f), op("f1", "forward", f), op("b1", "backward", b),
           op("b0", "backward", b))
    summary = GraphSummary(ops, tuple(n for n, _ in params), tuple(s for _, s in params), 0,
                           frozenset())
    stages = StageSummary(2, (0, 1, 1, 0), ("F", "F", "I", "I"), tuple(messages),
                          tuple(frozenset(s) for s in param_stages))
    return summary, stages


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_bubble_of_a_balanced_pipeline_is_pp_minus_one_slots(schedule):
    summary, stages = two_stage()
    layout = autopar.Layout(pp=2, microbatches=4, schedule=schedule)
    t = pc.pipeline_time(summary, stages, cluster(), layout, "sgd", EXACT)
    # (m + pp - 1) * (F + B) = 5 * 3 s; each rank is busy m * (F + B) = 12 s
    assert t.total_s == pytest.approx(15.0)
    assert t.compute_s == pytest.approx(12.0) and t.bubble_s == pytest.approx(3.0)
    assert t.bubble_fraction == pytest.approx(0.2) and t.exposed_comm_s == 0


def test_a_receive_holds_up_the_next_stage_by_alpha_plus_bytes_over_bandwidth():
    c = cluster(intra=(100e9, 1e-6))
    summary, stages = two_stage(messages=[Message(0, 1, "F", int(1e9), 2)])
    layout = autopar.Layout(pp=2)
    receive = 2 * 1e-6 + 1e9 / 100e9
    assert pc.p2p_time(1e9, 2, c, layout, EXACT) == pytest.approx(receive)
    t = pc.pipeline_time(summary, stages, c, layout, "sgd", EXACT)
    # F0 | RF | F1 B1 | B0 on rank 0 after rank 1's backward: 1 + r + 1 + 2 + 2
    assert t.total_s == pytest.approx(6 + receive)
    assert t.critical_rank == 0 and t.bubble_s == pytest.approx(3 + receive)


def test_p2p_uses_the_network_once_the_pipeline_group_leaves_the_node():
    c = cluster(nodes=2, per_node=4, intra=(100e9, 1e-6), inter=(10e9, 10e-6))
    inside = autopar.Layout(pp=2, dp=2)  # pipeline neighbours 2 apart: one node of 4
    across = autopar.Layout(pp=2, dp=4)  # 4 apart: the next node
    assert pc.p2p_time(1e9, 1, c, inside, EXACT) == pytest.approx(1e-6 + 1e9 / 100e9)
    assert pc.p2p_time(1e9, 1, c, across, EXACT) == pytest.approx(10e-6 + 1e9 / 10e9)


def test_gradient_sync_and_optimizer_after_the_last_action():
    c = cluster(intra=(100e9, 1e-6), bandwidth=1e11)
    # p0 (1 GB) on stage 0, p1 (2 GB) on stage 1, tied p2 (0.5 GB) on both
    params = [(250_000_000, 4), (500_000_000, 4), (125_000_000, 4)]
    summary, stages = two_stage(params, [{0}, {1}, {0, 1}])
    layout = autopar.Layout(pp=2, dp=2)
    tied = costs.flat_all_reduce(0.5e9, 2, c.intra_node)
    dp_sync = [costs.flat_all_reduce(1.5e9, 2, c.intra_node), costs.flat_all_reduce(2.5e9, 2, c.intra_node)]
    sync = pc.grad_sync_time(summary, stages, c, layout, EXACT)
    assert sync == pytest.approx([tied + dp_sync[0], tied + dp_sync[1]])
    t = pc.pipeline_time(summary, stages, c, layout, "adamw", EXACT)
    optim = [costs.optimizer_traffic(b, "adamw") / 1e11 for b in (1.5e9, 2.5e9)]
    ends = [6.0, 4.0]  # m=1: rank 0 ends after B0 at 6 s, rank 1 after B1 at 4 s
    totals = [e + s + o for e, s, o in zip(ends, sync, optim)]
    assert t.total_s == pytest.approx(max(totals))
    assert t.optimizer_s == pytest.approx(optim[totals.index(max(totals))])
    # bf16 on the wire halves the dp all-reduce's bytes (the tied all-reduce stays)
    half = pc.grad_sync_time(summary, stages, c, layout.replace(grad_comm_dtype="bf16"), EXACT)
    assert half[1] == pytest.approx(tied + costs.flat_all_reduce(1.25e9, 2, c.intra_node))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_in_a_pipeline_updates_blocks_and_gathers_them(zero):
    """As runtime/pipeline.py: ZeRO-1 all-reduces, ZeRO-2/3 reduce-scatter each parameter
    with at least dp rows; the optimizer updates ceil(rows / dp) rows of those; the
    blocks are all-gathered (after the optimizer, or before the schedule for ZeRO-3:
    the same seconds on the step). A parameter with fewer rows than dp stays whole."""
    from dataclasses import replace

    # NCCL: its reduce-scatter and all-gather are the ring's halves of an all-reduce
    c = cluster(intra=(100e9, 1e-6), bandwidth=1e11, backend="nccl")
    # p0 (1 GB, 1,000 rows) on stage 0, p1 (2 GB, 1,000 rows) on 1, tied p2 (0.5 GB, 1 row)
    params = [(250_000_000, 4), (500_000_000, 4), (125_000_000, 4)]
    summary, stages = two_stage(params, [{0}, {1}, {0, 1}])
    summary = replace(summary, param_rows=(1000, 1000, 1))
    layout = autopar.Layout(pp=2, dp=2, zero=zero)
    link = c.intra_node
    tied = costs.flat_all_reduce(0.5e9, 2, link)
    if zero == 1:
        sync = [tied + costs.flat_all_reduce(1.5e9, 2, link), tied + costs.flat_all_reduce(2.5e9, 2, link)]
    else:
        sync = [tied + costs.ring_all_gather(1e9, 2, link) + costs.flat_all_reduce(0.5e9, 2, link),
                tied + costs.ring_all_gather(2e9, 2, link) + costs.flat_all_reduce(0.5e9, 2, link)]
    gather = [costs.ring_all_gather(1e9, 2, link), costs.ring_all_gather(2e9, 2, link)]
    assert pc.grad_sync_time(summary, stages, c, layout, EXACT) == pytest.approx(sync)
    assert pc.param_gather_time(summary, stages, c, layout, EXACT) == pytest.approx(gather)
    updated = [0.5e9 + 0.5e9, 1e9 + 0.5e9]  # half of p0 / p1, all of the tied p2
    assert pc.updated_bytes(summary, stages, layout) == pytest.approx(updated)
    t = pc.pipeline_time(summary, stages, c, layout, "adamw", EXACT)
    optim = [costs.optimizer_traffic(b, "adamw") / 1e11 for b in updated]
    totals = [e + s + o + g for e, s, o, g in zip([6.0, 4.0], sync, optim, gather)]
    assert t.total_s == pytest.approx(max(totals))
    assert t.param_gather_s == pytest.approx(gather)
    # without ZeRO nothing is gathered and every parameter is updated whole
    plain = pc.pipeline_time(summary, stages, c, layout.replace(zero=0), "adamw", EXACT)
    assert plain.param_gather_s == (0.0, 0.0) and plain.total_s != t.total_s


def test_zero_bubble_fills_the_bubble_with_weight_gradients():
    # each backward op split: I on the critical path (1 s), W deferred (1 s)
    ops = tuple(OpRecord(n, r, flops=int(1e12), dtype="fp32") for n, r in
                [("f0", "forward"), ("f1", "forward"), ("i1", "backward"), ("w1", "backward"),
                 ("i0", "backward"), ("w0", "backward")])
    summary = GraphSummary(ops, (), (), 0, frozenset())
    stages = StageSummary(2, (0, 1, 1, 1, 0, 0), ("F", "F", "I", "W", "I", "W"), (), ())
    c = cluster()
    times = {s: pc.pipeline_time(summary, stages, c, autopar.Layout(pp=2, microbatches=4,
                                                                    schedule=s), "sgd", EXACT)
             for s in ("1f1b", "zero-bubble")}
    assert times["1f1b"].total_s == pytest.approx(15.0)
    assert times["zero-bubble"].total_s < times["1f1b"].total_s
    assert times["zero-bubble"].compute_s == pytest.approx(12.0)


# -- real graphs ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt():
    return meta_gpt2(layers=4, hidden=256, heads=8, vocab=1000, batch=16, seq=64)


def test_estimate_costs_pipelines_tensor_parallelism_and_accumulation(gpt):
    model, batch = gpt
    c = ClusterSpec.preset("dgx-h100")

    def est(**fields):
        return autopar.estimate(model, c, autopar.Layout(**fields), batch, causal_lm_loss)

    dp = est(dp=8)
    pipes = {s: est(dp=2, pp=4, microbatches=8, schedule=s) for s in ("gpipe", "1f1b")}
    for p in [dp, *pipes.values()]:
        assert p.flops_per_step == dp.flops_per_step  # the global batch's model FLOPs
        parts = p.breakdown
        assert p.step_time_s == pytest.approx(parts["compute"] + parts["exposed_comm"]
                                              + parts["bubble"] + parts["optimizer"])
    assert dp.bubble_fraction == 0
    assert all(p.bubble_fraction > 0.05 for p in pipes.values())


def test_tensor_parallel_ranks_compute_half_and_pay_tp_collectives(gpt):
    model, batch = gpt
    four, eight = (cluster(per_node=n, flops=1e14, bandwidth=1e12) for n in (4, 8))
    # unfused: the ratio below is about matmuls against the ops tp replicates
    whole = autopar.estimate(model, four, autopar.Layout(dp=4, fusion=False), batch,
                             causal_lm_loss)
    split = autopar.estimate(model, eight, autopar.Layout(dp=4, tp=2, fusion=False), batch,
                             causal_lm_loss)
    # the same micro-batch per rank; tp=2 halves the matmuls, not the replicated ops
    assert 0.45 < split.breakdown["compute"] / whole.breakdown["compute"] < 0.8
    assert split.flops_per_step == whole.flops_per_step
    # its comm is the dp buckets (half the gradient bytes) plus the tp collectives
    layout = autopar.Layout(dp=4, tp=2)
    local = (batch[0][:4],)
    tg, _ = autopar.run_passes(autopar.trace(model, local, causal_lm_loss), layout, eight)
    ops = summarize(tg).ops
    by_group = {g: sum(cm.collective_seconds(op, eight, layout) for op in ops
                       if op.collective and op.group == g) for g in ("dp", "tp")}
    assert by_group["tp"] > 0 and by_group["dp"] > 0
    assert split.breakdown["comm"] == pytest.approx(by_group["dp"] + by_group["tp"])


def test_gradient_accumulation_runs_the_micro_batches_back_to_back(gpt):
    model, batch = gpt
    c = ClusterSpec.preset("dgx-h100")
    one = autopar.estimate(model, c, autopar.Layout(dp=8), batch, causal_lm_loss)
    two = autopar.estimate(model, c, autopar.Layout(dp=8, microbatches=2), batch, causal_lm_loss)
    assert two.bubble_fraction == 0 and two.flops_per_step == one.flops_per_step
    # two half micro-batches compute what one whole one does; the gradient all-reduce
    # after the last one is not overlapped with any backward
    assert two.breakdown["compute"] == pytest.approx(one.breakdown["compute"], rel=0.15)
    assert two.breakdown["exposed_comm"] == pytest.approx(two.breakdown["comm"])
    # ZeRO-1 with accumulation: the optimizer's state is held for this rank's blocks
    zero = autopar.estimate(model, c, autopar.Layout(dp=8, microbatches=2, zero=1), batch,
                            causal_lm_loss)
    assert zero.memory["optimizer_states"] < two.memory["optimizer_states"] / 4


# -- the bytes each pipeline rank sends or reduces (Prediction.comm_bytes) -------------------

def _bytes_summary(zero_rows=False):
    """Stage 0 holds a 1,000-float weight (rows 100) and stage 1 a 50-float one; a
    10-float weight is read by both (tied); 400 bytes go each way per micro-batch."""
    summary, stages = two_stage(params=[(1000, 4), (10, 4), (50, 4)],
                                param_stages=[{0}, {0, 1}, {1}],
                                messages=[Message(0, 1, "F", 400, 1), Message(1, 0, "B", 400, 1)])
    if zero_rows:
        summary = GraphSummary(summary.ops, summary.param_numel, summary.param_itemsize, 0,
                               frozenset(), param_rows=(100, 10, 50))
    return summary, stages


def test_each_pipeline_rank_sends_its_values_and_sums_its_gradients():
    summary, stages = _bytes_summary()
    c = cluster(per_node=8)
    layout = autopar.Layout(dp=2, pp=2, microbatches=3)
    # 3 micro-batches x 400 bytes each way, the tied weight's 40 summed over the pipeline
    # ranks, then each rank's gradients (tied one included) over dp
    assert pc.rank_comm_bytes(summary, stages, c, layout) == [
        {"pp": 3 * 400 + 40, "dp": 4000 + 40}, {"pp": 3 * 400 + 40, "dp": 40 + 200}]
    alone = autopar.Layout(pp=2, microbatches=3)  # dp = 1: nothing over dp
    assert pc.rank_comm_bytes(summary, stages, c, alone) == [{"pp": 1240}, {"pp": 1240}]
    assert pc.rank_uncompressed_bytes(summary, stages, layout) == [0, 0]


def test_a_pipeline_ranks_zero_blocks_local_sgd_and_dgc_bytes():
    summary, stages = _bytes_summary(zero_rows=True)
    c = cluster(per_node=8)
    base = dict(dp=2, pp=2, microbatches=3)
    # ZeRO-1: the gradients summed whole, the updated blocks gathered (each block x dp);
    # ZeRO-2: each block reduce-scattered instead (the full tensor: block x dp)
    one = pc.rank_comm_bytes(summary, stages, c, autopar.Layout(**base, zero=1))
    assert [r["dp"] for r in one] == [4040 + 4000 + 40, 240 + 40 + 200]
    two = pc.rank_comm_bytes(summary, stages, c, autopar.Layout(**base, zero=2))
    assert [r["dp"] for r in two] == [2 * 4040, 2 * 240]
    # Local SGD: each rank's parameters averaged every 4 steps, amortised; no gradient sum
    local = pc.rank_comm_bytes(summary, stages, c, autopar.Layout(**base, local_sgd=4))
    assert [r[cm.AVERAGE_KEY] for r in local] == [4040 // 4, 240 // 4]
    assert all("dp" not in r for r in local)
    assert pc.rank_uncompressed_bytes(summary, stages, autopar.Layout(**base, local_sgd=4)) \
        == [4040, 240]


def test_a_pipelines_dgc_sends_values_and_indices_of_its_large_gradients():
    big = costs.DGC_DENSE_BELOW
    summary, stages = two_stage(params=[(big, 4), (10, 4)], param_stages=[{0}, {1}])
    layout = autopar.Layout(dp=4, pp=2, microbatches=2, dgc=0.99)
    kept = costs.dgc_kept(big, 0.99)
    ranks = pc.rank_comm_bytes(summary, stages, cluster(per_node=8), layout)
    # every rank's k fp32 values and k int32 indices, gathered; the small one summed dense
    assert ranks == [{cm.DGC_KEY: 8 * kept * 4}, {"dp": 40}]
    assert pc.rank_uncompressed_bytes(summary, stages, layout) == [big * 4, 40]


def test_a_pipelines_hierarchical_sum_counts_each_level():
    summary, stages = _bytes_summary()
    layout = autopar.Layout(dp=4, pp=2, microbatches=3, allreduce="hierarchical")
    for backend, node in (("gloo", 4040), ("nccl", 4040 / 2)):
        c = cluster(nodes=4, per_node=2, backend=backend)  # each dp group: 2 nodes x 2
        rank0 = pc.rank_comm_bytes(summary, stages, c, layout)[0]
        # reduce and broadcast (reduce-scatter and all-gather) inside the node, the
        # leaders' all-reduce (of one shard on NCCL) among the nodes
        assert rank0 == {"pp": 1240, "dp.local": 2 * 4040, "dp.node": int(node)}


def test_a_pipelined_prediction_carries_its_critical_ranks_bytes(gpt):
    """On a real model: a rank sends one hidden state per micro-batch each way; its
    gradients summed over dp are its stages' parameters (GPT-2's tied embedding on
    both ends); tensor parallelism's collectives run once per micro-batch; a per-block
    trace gives what an exact one does."""
    from autopar.compiler.planner.estimate import Estimator
    model, batch = gpt
    c = ClusterSpec.preset("dgx-h100")
    layout = autopar.Layout(dp=2, pp=2, microbatches=4)
    estimator = Estimator(model, c, batch, causal_lm_loss)
    summary, stages, _ = estimator.rewritten(layout, timing=True)
    ranks = pc.rank_comm_bytes(summary, stages, c, layout)
    hidden = 16 // (2 * 4) * 64 * 256 * 4  # a micro-batch's (2, 64, 256) fp32 hidden state
    wte = model.transformer.wte.weight.numel() * 4
    assert [r["pp"] for r in ranks] == [4 * hidden + wte] * 2
    params = sum(p.numel() * 4 for p in model.parameters())  # wte counted once
    assert sum(r["dp"] for r in ranks) == params + wte
    pred = estimator.predict(layout)
    critical = pc.pipeline_time(summary, stages, c, layout).critical_rank
    assert pred.comm_bytes == ranks[critical] and pred.uncompressed_bytes == 0
    # two micro-batches of 2 sequences: twice the tp bytes of a step of 2 sequences
    half = tuple(t[:8] for t in batch)
    whole = autopar.estimate(model, c, autopar.Layout(tp=2, dp=4), half, causal_lm_loss)
    split = autopar.estimate(model, c, autopar.Layout(tp=2, dp=4, microbatches=2), batch,
                             causal_lm_loss)
    assert split.comm_bytes["tp"] == 2 * whole.comm_bytes["tp"] > 0
    deep, deep_batch = meta_gpt2(layers=6, hidden=128, heads=4, vocab=500, batch=16, seq=32)
    for lay in (autopar.Layout(dp=2, pp=2, microbatches=4, zero=2),
                autopar.Layout(dp=2, pp=2, microbatches=4, schedule="interleaved",
                               virtual_stages=3)):
        exact, scaled = (Estimator(deep, c, deep_batch, causal_lm_loss, trace_blocks=blocks)
                         .predict(lay) for blocks in (None, 2))
        assert scaled.comm_bytes == exact.comm_bytes and exact.comm_bytes["pp"] > 0
