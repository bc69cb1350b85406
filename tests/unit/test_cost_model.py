"""The cost model: each formula against hand-computed values, FLOPs of a GPT against
its closed form, memory against real optimizers, and properties (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir.trace import trace_train_step
from autopar.cluster import ClusterSpec, LinkSpec
from autopar import costs
from autopar.compiler.planner import cost_model as cm
from autopar.compiler.analysis.summary import GraphSummary, OpRecord, summarize
from autopar.examples import causal_lm_loss, gpt2

EXACT = costs.Efficiency(compute=1.0, memory=1.0, link=1.0)


def cluster(nodes=1, per_node=4, intra=(100e9, 1e-6), inter=(10e9, 10e-6), flops=1e12,
            bandwidth=1e11, backend="gloo") -> ClusterSpec:
    """backend="nccl": a GPU cluster (NCCL's topology-aware collectives across nodes)."""
    return ClusterSpec.from_dict({
        "name": "test", "nodes": nodes, "devices_per_node": per_node, "backend": backend,
        "device": {"name": "d", "kind": "gpu" if backend == "nccl" else "cpu",
                   "peak_flops": {"fp32": flops},
                   "memory_bytes": 10**10, "memory_bandwidth": bandwidth},
        "intra_node": {"bandwidth": intra[0], "latency_s": intra[1]},
        "inter_node": {"bandwidth": inter[0], "latency_s": inter[1]}})


# -- formulas ------------------------------------------------------------------------------

def test_roofline_compute_bound_and_memory_bound():
    # 1e12 FLOPs at 1e12 FLOP/s * 0.5 = 2 s; 1e9 bytes at 1e10 B/s * 0.5 = 0.2 s
    eff = costs.Efficiency(compute=0.5, memory=0.5)
    assert costs.op_time(1e12, 1e9, 1e12, 1e10, eff) == pytest.approx(2.0)
    # 1e9 FLOPs -> 2 ms; 1e11 bytes -> 20 s: memory-bound
    assert costs.op_time(1e9, 1e11, 1e12, 1e10, eff) == pytest.approx(20.0)


def test_ring_tree_and_all_gather_by_hand():
    link = LinkSpec(bandwidth=1e9, latency_s=1e-6)
    # ring, p=4, 1 GB: 2*3/4 * 1 s + 6 * 1 us
    assert costs.ring_all_reduce(1e9, 4, link) == pytest.approx(1.5 + 6e-6)
    # tree, p=4: 2 * 1 s + 2 * log2(4) * 1 us; p=5 rounds the depth up to 3
    assert costs.tree_all_reduce(1e9, 4, link) == pytest.approx(2.0 + 4e-6)
    assert costs.tree_all_reduce(1e9, 5, link) == pytest.approx(2.0 + 6e-6)
    # all-gather / reduce-scatter: 3/4 * 1 s + 3 * 1 us
    assert costs.ring_all_gather(1e9, 4, link) == pytest.approx(0.75 + 3e-6)
    assert costs.ring_all_reduce(1e9, 1, link) == costs.tree_all_reduce(1e9, 1, link) == 0.0
    # a tiny message on many ranks: the tree's log-depth latency wins
    assert costs.flat_all_reduce(8, 64, link) == costs.tree_all_reduce(8, 64, link) \
        < costs.ring_all_reduce(8, 64, link)


def test_hierarchical_all_reduce_by_hand():
    intra, inter = LinkSpec(bandwidth=100e9, latency_s=1e-6), LinkSpec(bandwidth=10e9, latency_s=1e-5)
    n = 8e9  # 8 GB over 2 nodes x 4 ranks
    reduce_scatter = 3 / 4 * n / 100e9 + 3 * 1e-6
    shard = n / 4  # each rank all-reduces its quarter with its peer on the other node
    inter_ring = 2 * 1 / 2 * shard / 10e9 + 2 * 1e-5
    inter_tree = 2 * shard / 10e9 + 2 * 1 * 1e-5
    expected = 2 * reduce_scatter + min(inter_ring, inter_tree)
    assert costs.hierarchical_all_reduce(n, 4, 2, intra, inter) == pytest.approx(expected)
    c = cluster(nodes=2, per_node=4, intra=(100e9, 1e-6), inter=(10e9, 1e-5), backend="nccl")
    assert costs.collective_time("all_reduce", n, 8, c, 1, EXACT) == pytest.approx(expected)


def test_a_strided_group_all_reduces_across_the_network_with_the_ranks_each_node_holds():
    """A group's ranks are `stride` devices apart (node-major numbering): dp outside
    tp = 2 on 4-device nodes holds 2 ranks per node, outside tp = 4 one, and that
    one's all-reduce is a flat one between the nodes (each device's own port)."""
    c = cluster(nodes=4, per_node=4, intra=(100e9, 1e-6), inter=(10e9, 1e-5), backend="nccl")
    n = 8e9
    two = costs.collective_time("all_reduce", n, 8, c, 2, EXACT)
    assert two == pytest.approx(costs.hierarchical_all_reduce(n, 2, 4, c.intra_node, c.inter_node))
    one = costs.collective_time("all_reduce", n, 4, c, 4, EXACT)
    assert one == pytest.approx(costs.flat_all_reduce(n, 4, c.inter_node))
    # by hand: a ring of 4 nodes, 2 * 3/4 of 8 GB at 10 GB/s, 6 hops of 10 us
    assert one == pytest.approx(2 * 3 / 4 * 8e9 / 10e9 + 6 * 1e-5)
    # the same 4 ranks packed in one node stay on NVLink; spread, they are slower
    assert costs.collective_time("all_reduce", n, 4, c, 1, EXACT) < one
    # gathers and scatters ring over the network whatever the stride
    assert costs.collective_time("all_gather", n, 4, c, 4, EXACT) == \
        pytest.approx(costs.ring_all_gather(n, 4, c.inter_node))


def test_collective_time_picks_the_link_of_the_group():
    c = cluster(nodes=2, per_node=4, backend="nccl")
    inside = costs.collective_time("all_reduce", 1e8, 4, c, 1, EXACT)
    assert inside == pytest.approx(costs.flat_all_reduce(1e8, 4, c.intra_node))
    # 8 ranks on 2 nodes of 4, one network port each: 4 rings of 2 (one per port) gather
    # a quarter each over the network, then each node's 4 gather over its links
    gather = costs.collective_time("all_gather", 1e8, 8, c, 1, EXACT)
    assert gather == pytest.approx(costs.ring_all_gather(1e8 / 4, 2, c.inter_node)
                                   + costs.ring_all_gather(1e8, 4, c.intra_node))
    # one rank a node (ranks 4 apart): the whole tensor crosses the one port of each node
    spread = costs.collective_time("reduce_scatter", 1e8, 2, c, 4, EXACT)
    assert spread == pytest.approx(costs.ring_all_gather(1e8, 2, c.inter_node))
    assert costs.group_spans_nodes(4, 1, c) is False and costs.group_spans_nodes(8, 1, c) is True
    assert costs.collective_time("all_reduce", 1e8, 1, c) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'all_to_all'"):
        costs.collective_time("all_to_all", 1e8, 4, c)
    with pytest.raises(ValueError, match=r"Efficiency.link must be in \(0, 1\]"):
        costs.Efficiency(link=1.5)


# -- stream simulation ---------------------------------------------------------------------

def compute_op(name, seconds, c):
    """An op taking `seconds` on cluster c's roofline at EXACT efficiency."""
    return OpRecord(name, "backward", flops=int(seconds * c.device.peak_flops["fp32"]), dtype="fp32")


def summary_of(ops, outputs=()):
    return GraphSummary(tuple(ops), (), (), 0, frozenset(outputs))


def test_overlap_hides_comm_behind_the_remaining_backward():
    c = cluster(intra=(1e9, 1e-12))
    layout = autopar.Layout(dp=2)
    comm = costs.collective_time("all_reduce", 1e9, 2, c, False, EXACT)  # ~1 s
    ops = [compute_op("a", 0.25, c),
           OpRecord("ar", "comm", collective="all_reduce", comm_bytes=int(1e9), group="dp"),
           compute_op("b", 0.5, c),
           OpRecord("w", "comm", waits_on=1)]
    compute, total_comm, end = cm.simulate_streams(summary_of(ops), c, layout, EXACT)
    assert compute == pytest.approx(0.75) and total_comm == pytest.approx(comm)
    assert end == pytest.approx(0.25 + comm)  # only comm - 0.5 s of it is exposed
    times = cm.step_time(summary_of(ops), c, layout, "sgd", EXACT)
    assert times.exposed_comm_s == pytest.approx(comm - 0.5)
    # two collectives share one stream: the second waits for the first
    ops2 = ops[:2] + [OpRecord("ar2", "comm", collective="all_reduce", comm_bytes=int(1e9),
                               group="dp")] + ops[2:]
    assert cm.simulate_streams(summary_of(ops2), c, layout, EXACT)[2] == pytest.approx(0.25 + 2 * comm)


@st.composite
def random_steps(draw):
    ops: list[OpRecord] = []
    for i in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            ops.append(OpRecord(f"c{i}", "backward", flops=draw(st.integers(0, 10**12)), dtype="fp32",
                                bytes=draw(st.integers(0, 10**10))))
        else:
            ops.append(OpRecord(f"ar{i}", "comm", collective="all_reduce",
                                comm_bytes=draw(st.integers(0, 10**10)), group="dp"))
    waits = [OpRecord(f"w{i}", "comm", waits_on=i) for i, op in enumerate(ops) if op.collective]
    return summary_of(ops + waits)


@settings(max_examples=60, deadline=None)
@given(random_steps(), st.floats(1e8, 1e12), st.floats(1.0, 100.0))
def test_overlap_bounds_and_more_bandwidth_is_never_slower(summary, bandwidth, factor):
    layout = autopar.Layout(dp=4)
    slow, fast = cluster(intra=(bandwidth, 1e-6)), cluster(intra=(bandwidth * factor, 1e-6))
    t_slow = cm.step_time(summary, slow, layout, "adamw", EXACT)
    t_fast = cm.step_time(summary, fast, layout, "adamw", EXACT)
    for t in (t_slow, t_fast):  # overlap never hurts and never hides more than exists
        assert -1e-12 <= t.exposed_comm_s <= t.comm_s * (1 + 1e-12) + 1e-12
    assert t_fast.total_s <= t_slow.total_s * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter"]), st.floats(1, 1e11),
       st.floats(1, 10), st.integers(2, 64), st.sampled_from([1, 2, 8]))
def test_collectives_grow_with_bytes_and_shrink_with_bandwidth(kind, nbytes, factor, p, stride):
    c, faster = cluster(nodes=8, per_node=8), cluster(nodes=8, per_node=8, intra=(100e9 * factor, 1e-6),
                                                      inter=(10e9 * factor, 10e-6))
    t = costs.collective_time(kind, nbytes, p, c, stride)
    assert costs.collective_time(kind, nbytes * factor, p, c, stride) >= t
    assert costs.collective_time(kind, nbytes, p, faster, stride) <= t


# -- FLOPs of a GPT ------------------------------------------------------------------------

def test_gpt_flops_equal_the_closed_form_of_its_matmuls():
    layers, h, heads, vocab, batch, seq = 2, 64, 4, 256, 8, 32
    ex = gpt2(layers=layers, hidden=h, heads=heads, vocab=vocab, batch=batch, seq=seq)
    summary = summarize(autopar.trace(ex.model, ex.batch, ex.loss_fn))
    tokens = batch * seq
    # per block: qkv 2*T*h*3h, attention output 2*T*h*h, MLP 2*T*h*4h twice = 24*T*h^2;
    # attention scores q@k^T and probabilities @ v, 2*B*S*S*h each; the tied LM head 2*T*h*V
    forward = layers * (24 * tokens * h * h + 4 * batch * seq * seq * h) + 2 * tokens * h * vocab
    assert summary.model_flops == 3 * forward  # backward: input and weight gradients, 2x
    # the attention backward kernel also recomputes the scores: time, not model FLOPs;
    # and a causal attention's kernel computes only the (seq + 1) / 2 seq of its scores
    # on and below the diagonal: that is its time, the whole s x s its model FLOPs
    recomputed = layers * 2 * batch * seq * seq * h
    scores = layers * (4 + 8) * batch * seq * seq * h + recomputed  # forward, backward
    assert summary.flops == 3 * forward + recomputed - scores + scores * (seq + 1) // (2 * seq)


def test_summary_storage_of_views_waits_and_gradients():
    ex = gpt2()
    tg = autopar.trace(ex.model, (ex.batch[0][:4],), ex.loss_fn)
    tg, _ = autopar.run_passes(tg, autopar.Layout(dp=2, bucket_mb=0.05))
    summary = summarize(tg)
    by_name = {op.name: op for op in summary.ops}
    views = [n for n in tg.call_nodes()
             if isinstance(n.target, torch._ops.OpOverload) and n.target.is_view]
    assert views and all(by_name[n.name].allocates == 0 for n in views)
    base = {n.name: by_name[n.all_input_nodes[0].name].storage for n in views
            if n.all_input_nodes[0].name in by_name}
    assert base and all(by_name[name].storage == s for name, s in base.items())
    waits = [op for op in summary.ops if op.waits_on is not None]
    assert waits and all(summary.ops[op.waits_on].collective == "all_reduce" for op in waits)
    # the reduced buckets are the gradients (and the loss) the step returns
    assert {op.waits_on for op in waits} == summary.output_storages - {None}


def test_gathered_embedding_rows_are_costed_at_their_gathered_size():
    ex = gpt2(layers=1, hidden=32, vocab=4096, batch=4, seq=16)
    tg = autopar.trace(ex.model, (ex.batch[0][:2],), ex.loss_fn)
    tg, results = autopar.run_passes(tg, autopar.Layout(dp=2))
    assert {r.name: r for r in results}["insert_allreduce"].stats["embedding_grads_gathered"]
    gathers = [op for op in summarize(tg).ops if op.collective == "all_gather"]
    # token embedding: both ranks' 2 x 16 tokens' fp32 row gradients (hidden 32) and
    # int64 ids; position embedding: the 1 x 16 positions each rank shares over its batch
    tokens = [2 * 2 * 16 * 32 * 4, 2 * 2 * 16 * 8]
    positions = [2 * 16 * 32 * 4, 2 * 16 * 8]
    assert sorted(op.comm_bytes for op in gathers) == sorted(tokens + positions)
    assert all(op.group == "dp" for op in gathers)


def test_overlapped_buckets_expose_less_than_a_reduce_after_backward():
    ex = gpt2(layers=4, hidden=128, vocab=512)
    tg = autopar.trace(ex.model, (ex.batch[0][:4],), ex.loss_fn)
    slow = cluster(intra=(2e8, 1e-5), flops=1e11, bandwidth=1e10)

    def exposed(overlap):
        layout = autopar.Layout(dp=2, bucket_mb=0.2, overlap_comm=overlap)
        new, results = autopar.run_passes(tg, layout)
        assert {r.name: r for r in results}["insert_allreduce"].stats["buckets"] > 2
        return cm.step_time(summarize(new), slow, layout, "adamw", EXACT)

    overlapped, serial = exposed(True), exposed(False)
    assert overlapped.comm_s == pytest.approx(serial.comm_s)
    assert overlapped.exposed_comm_s < 0.9 * serial.exposed_comm_s


# -- estimate ------------------------------------------------------------------------------

def meta_gpt2(layers=2, hidden=128, heads=4, vocab=1000, batch=16, seq=64):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                        n_positions=seq, use_cache=False)
    with torch.device("meta"):
        return GPT2LMHeadModel(config), (torch.randint(0, vocab, (batch, seq)),)


def test_estimate_gpt2_on_dgx_h100_with_dp8():
    model, batch = meta_gpt2()
    c = ClusterSpec.preset("dgx-h100")
    pred = autopar.estimate(model, c, autopar.Layout(dp=8), batch, causal_lm_loss)
    params = sum(p.numel() * 4 for p in model.parameters())  # tied: counted once
    assert 0 < pred.mfu <= 1 and pred.peak_memory_bytes > params
    assert pred.peak_memory_bytes == sum(pred.memory.values())
    # gradients: those alive at the peak (it falls early in the backward, in the loss)
    assert pred.memory["parameters"] == params and pred.memory["gradients"] <= params
    assert pred.memory["optimizer_states"] >= 2 * params
    b = pred.breakdown
    assert b["comm"] > 0 and 0 <= b["exposed_comm"] <= b["comm"] and b["bubble"] == 0
    assert pred.step_time_s == pytest.approx(b["compute"] + b["exposed_comm"] + b["optimizer"])
    assert pred.tflops_per_device == pytest.approx(pred.flops_per_step / 8 / pred.step_time_s / 1e12)
    # model FLOPs cover the global batch: the same whether 8 or 16 ranks share it
    two = autopar.estimate(model, ClusterSpec.preset("dgx-h100", nodes=2), autopar.Layout(dp=16),
                           batch, causal_lm_loss)
    assert two.flops_per_step == pred.flops_per_step
    assert two.memory["activations"] < pred.memory["activations"]
    assert all(p.is_meta for p in model.parameters())


def test_estimate_costs_zero_and_recompute_memory():
    model, batch = meta_gpt2()
    c = ClusterSpec.preset("dgx-h100")
    plain = autopar.estimate(model, c, autopar.Layout(dp=8), batch, causal_lm_loss)
    zero = autopar.estimate(model, c, autopar.Layout(dp=8, zero=2), batch, causal_lm_loss)
    # AdamW's state of this rank's blocks (1/8 of each tensor, rounded up to whole rows)
    assert zero.memory["optimizer_states"] <= plain.memory["optimizer_states"] / 8 * 1.05
    assert zero.breakdown["optimizer"] < plain.breakdown["optimizer"] / 4
    full = autopar.estimate(model, c, autopar.Layout(dp=8, recompute="full"), batch,
                            causal_lm_loss)
    assert full.peak_memory_bytes < plain.peak_memory_bytes
    assert full.flops_per_step == plain.flops_per_step  # recomputed FLOPs are not model FLOPs
    assert full.breakdown["compute"] > plain.breakdown["compute"]


def test_zero_moves_what_its_collectives_move():
    """ZeRO-2 reduce-scatters the gradients and gathers the updated blocks back: a ring
    moves as many bytes as plain data parallelism's all-reduce (reduce-scatter plus
    all-gather is a ring all-reduce; latency aside), ZeRO-1 all-reduces and gathers (1.5x), ZeRO-3
    gathers the parameters for the forward and again for the backward (1.5x). A
    reduce-scatter is costed by its input, the whole gradient, not by its output."""
    from autopar.compiler.planner.cost_model import zero_gather_time
    from autopar.compiler.analysis.summary import summarize

    model, batch = meta_gpt2(layers=2, hidden=1024, heads=8, vocab=32000, batch=16, seq=64)
    data = ClusterSpec.preset("dgx-h100").to_dict()
    data["intra_node"]["latency_s"] = 1e-12  # bytes only: ZeRO-1/2 gather a message a tensor
    c = ClusterSpec.from_dict(data)
    comm = {z: autopar.estimate(model, c, autopar.Layout(dp=8, zero=z), batch,
                                causal_lm_loss).breakdown["comm"] for z in range(4)}
    assert comm[2] == pytest.approx(comm[0], rel=0.05), comm
    assert comm[1] == pytest.approx(1.5 * comm[0], rel=0.05), comm
    assert comm[3] == pytest.approx(1.5 * comm[0], rel=0.05), comm
    moved = {}
    for z in (0, 2):
        local = (batch[0][: batch[0].shape[0] // 8],)
        lay = autopar.Layout(dp=8, zero=z)
        tg, _ = autopar.run_passes(trace_train_step(model, local, causal_lm_loss), lay, c)
        summary = summarize(tg)
        moved[z] = sum(op.comm_bytes for op in summary.ops if op.collective and op.comm_bytes > 64)
        gather = zero_gather_time(summary, c, lay)
        assert (gather > 0) == (z == 2)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    # every gradient once (and the gathered embedding rows), blocks' padding rows aside
    assert grads <= moved[0] <= moved[2] <= moved[0] * 1.01, (grads, moved)


def test_estimate_refuses_what_it_cannot_cost():
    model, batch = meta_gpt2()
    c = ClusterSpec.preset("dgx-h100")
    with pytest.raises(autopar.LayoutError, match=r"dp\*tp\*pp = 4 devices.* has 8 .*Layout\(dp=8\)"):
        autopar.estimate(model, c, autopar.Layout(dp=4), batch, causal_lm_loss)
    with pytest.raises(autopar.LayoutError, match="nodes=2"):
        autopar.estimate(model, c, autopar.Layout(dp=16), batch, causal_lm_loss)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        autopar.estimate(model, c, autopar.Layout(dp=8), batch, causal_lm_loss, optimizer="lamb")


def test_cli_estimate_json(capsys):
    import json

    from autopar import cli

    assert cli.main(["estimate", "gpt2-tiny", "--cluster", "dgx-h100", "--dp", "8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"]["dp"] == 8 and 0 < info["mfu"] <= 1
    assert set(info["breakdown"]) == {"compute", "comm", "exposed_comm", "bubble", "optimizer"}
    assert info["peak_memory_bytes"] == sum(info["memory"].values())
    assert cli.main(["estimate", "mlp", "--cluster", "local", "--dp", "2"]) == 0
    assert "memory per rank" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="has 8"):
        cli.main(["estimate", "gpt2-tiny", "--cluster", "dgx-h100", "--dp", "2"])
    assert math.isfinite(info["step_time_s"])


def test_estimate_prices_bf16_gradient_buckets_at_half_the_bytes():
    """Layout.grad_comm_dtype: the cost model reads the rewritten graph, whose buckets
    travel in bf16, so the predicted communication shrinks (the wire bytes halve; the
    fixed per-message latency stays)."""
    from autopar.compiler.ir.trace import trace_train_step
    from autopar.compiler.analysis.summary import summarize

    model, batch = meta_gpt2(layers=2, hidden=1024, heads=8, vocab=32000, batch=16, seq=64)
    c = ClusterSpec.preset("dgx-h100", nodes=2)
    layouts = [autopar.Layout(dp=16, amp="bf16"),
               autopar.Layout(dp=16, amp="bf16", grad_comm_dtype="bf16")]
    preds = [autopar.estimate(model, c, lay, batch, causal_lm_loss) for lay in layouts]
    # not 0.5: per-message latency, and embedding rows gathered in their own dtype
    assert preds[1].breakdown["comm"] < 0.7 * preds[0].breakdown["comm"], preds
    sent = []
    for lay in layouts:
        local = (batch[0][: batch[0].shape[0] // 16],)
        tg, _ = autopar.run_passes(trace_train_step(model, local, causal_lm_loss), lay, c)
        sent.append(sum(op.comm_bytes for op in summarize(tg).ops  # gradient buckets
                        if op.collective == "all_reduce" and op.comm_bytes > 1024))
    assert sent[1] * 2 == sent[0], sent


def test_model_compute_floor_counts_the_model_ops_without_first_touch():
    """plan.compute_bound's reference: forward, loss and backward ops at the roofline
    (1 s each here), not the packing around collectives, the collectives or the
    optimizer, and not the first touch of a fresh allocation; the second figure is
    what lies inside repeated blocks."""
    data = cluster(flops=1e12).to_dict()
    data["device"].update(first_touch_bandwidth=1e9)
    c = ClusterSpec.from_dict(data)
    fresh = 64 * 2**20  # above glibc's mmap threshold: would cost 67 ms to fault in
    ops = (OpRecord("x", "input", allocates=fresh),
           OpRecord("f", "forward", flops=10**12, allocates=fresh, layer=0),
           OpRecord("loss", "loss", flops=10**12),
           OpRecord("b", "backward", flops=2 * 10**12, layer=0),
           OpRecord("pack", "comm", flops=10**12),
           OpRecord("ar", "backward", collective="all_reduce", comm_bytes=10**9, group="dp"),
           OpRecord("w", "backward", waits_on=5),
           OpRecord("step", "optimizer", flops=10**12))
    summary = GraphSummary(ops, (), (), 0, frozenset())
    assert cm.model_compute_floor(summary, c, EXACT) == pytest.approx((4.0, 3.0))
    # the step time does count the first touch
    assert cm.simulate_streams(summary, c, autopar.Layout(dp=2), EXACT)[0] > 6.0
