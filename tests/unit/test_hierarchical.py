"""Layout.allreduce="hierarchical": the two levels of a dp group (costs.dp_node_split),
the graphs insert_allreduce builds for them on each rank, their pre-launch check, their
cost, and the planner's choice between flat and hierarchical. The multi-process
results (exact against the flat all-reduce, parity, who uses the network) are
tests/dist/cases_hierarchical.py."""

import pytest
import torch

import autopar
from autopar.compiler.ir import comm_ops
from autopar.compiler.ir.batch import Objective
from autopar.compiler.ir.collectives import (
    CollectiveMismatch,
    check_collectives,
    collectives_of,
    node_split_members,
)
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.passes.defaults import run_passes
from autopar.compiler.planner.cost_model import collective_seconds
from autopar.costs import (
    collective_time,
    dp_node_split,
    pipelined_reduce,
    ring_all_reduce,
)
from autopar.examples import gpt2
from autopar.layout import LayoutError

H = "hierarchical"


def cluster(nodes=2, per_node=2, inter_bw=5e9, backend="gloo", name="c"):
    spec = autopar.ClusterSpec.local(nodes * per_node).to_dict()
    spec.update(name=name, nodes=nodes, devices_per_node=per_node, backend=backend,
                inter_node={"bandwidth": inter_bw, "latency_s": 1e-4})
    return autopar.ClusterSpec.from_dict(spec)


def test_two_levels_of_a_dp_group():
    assert dp_node_split(autopar.Layout(dp=4, allreduce=H), cluster()) == (2, 2)
    assert dp_node_split(autopar.Layout(dp=4, tp=2, allreduce=H), cluster(2, 4)) == (2, 2)
    assert dp_node_split(autopar.Layout(dp=12, allreduce=H), cluster(3, 4)) == (4, 3)
    # mesh (pp, dp, tp): each stage's dp x tp ranks fill whole nodes
    assert dp_node_split(autopar.Layout(dp=4, pp=2, allreduce=H), cluster(4, 2)) == (2, 2)
    assert dp_node_split(autopar.Layout(dp=4, microbatches=2, allreduce=H), cluster()) == (2, 2)


@pytest.mark.parametrize("layout, spec, words", [
    (autopar.Layout(dp=4, allreduce=H), cluster(2, 3), "3 devices per node do not divide the world size 4"),
    (autopar.Layout(dp=2, tp=3, allreduce=H), cluster(3, 2), "tp=3 does not divide the 2 devices"),
    (autopar.Layout(dp=4, allreduce=H), cluster(1, 4), "within one node"),
    (autopar.Layout(dp=2, tp=2, allreduce=H), cluster(2, 2), "at one rank per node"),
    (autopar.Layout(dp=2, pp=2, allreduce=H), cluster(1, 4), "within one node"),
    (autopar.Layout(dp=3, pp=2, allreduce=H), cluster(3, 2), "dp x tp = 3 ranks do not fill"),
])
def test_a_split_that_does_not_cut_whole_nodes_names_the_field(layout, spec, words):
    with pytest.raises(LayoutError, match="Layout.allreduce='hierarchical'") as err:
        dp_node_split(layout, spec)
    assert words in str(err.value) and "allreduce='flat'" in str(err.value)


@pytest.mark.parametrize("fields, words", [
    ({"allreduce": "tree"}, "Layout.allreduce must be one of"),
    ({"allreduce": H}, "needs dp > 1"),
])
def test_bad_layouts(fields, words):
    with pytest.raises(LayoutError, match=words):
        autopar.Layout(**fields)


def _traced(dp=4):
    ex = gpt2(layers=1, batch=12)
    objective, flat = Objective.from_example(ex.batch, None, ex.loss_fn)
    layout = autopar.Layout(dp=dp, allreduce=H, bucket_mb=0.05)
    from autopar.compiler.ir.trace import local_example
    return trace_train_step(ex.model, local_example(flat, layout), objective), layout


def _ops(graph, group):
    return [c.op for c in collectives_of(graph.gm) if c.group == group]


def test_leaders_form_reduces_sends_among_leaders_and_broadcasts():
    tg, layout = _traced()
    leader, _ = run_passes(tg, layout, cluster(), options={"dp_rank": 2})
    other, results = run_passes(tg, layout, cluster(), options={"dp_rank": 3})
    stats = {r.name: r for r in results}["insert_allreduce"].stats
    buckets = stats["buckets"]
    assert buckets > 2 and stats["allreduce"].startswith("hierarchical over 2 nodes x 2 ranks")
    for graph in (leader, other):
        # the broadcasts once the backward is done: no compute waits on the network
        assert _ops(graph, "dp.local") == ["reduce"] * buckets + ["broadcast"] * buckets
        assert graph.gm.graph.find_nodes(op="call_function", target=comm_ops.reduce)
        assert _ops(graph, "dp") == ["all_reduce"]  # the loss
        assert graph.attrs["dp_node_split"] == 2
    assert _ops(leader, "dp.node") == ["all_reduce"] * buckets
    assert _ops(other, "dp.node") == []


def test_shards_form_pads_a_bucket_that_does_not_divide_by_the_local_ranks():
    tg, layout = _traced(dp=6)  # 2 nodes x 3
    graph, _ = run_passes(tg, layout, cluster(2, 3), options={"dp_rank": 1, "hierarchy_form": "shards"})
    found = [c for c in collectives_of(graph.gm) if c.group.startswith("dp.")]
    scatters = [c for c in found if c.op == "reduce_scatter_tensor"]
    assert {c.op for c in found} == {"reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"}
    assert all(c.shape[0] % 3 == 0 for c in scatters)
    sizes = [p.numel() for p in gpt2(layers=1).model.parameters()]
    assert any(n % 3 for n in sizes)  # gradients of sizes 3 does not divide: padded
    cut = [n for n in graph.gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor
           and n.args[0].target is torch.ops._c10d_functional.wait_tensor.default]
    assert cut  # and the padding cut off after the all-gather
    # "auto" is shards on NCCL
    gpu = autopar.ClusterSpec.preset("dgx-a100-80gb", nodes=2)
    lay = autopar.Layout(dp=16, allreduce=H, bucket_mb=0.05)
    assert dp_node_split(lay, gpu) == (8, 2)


def test_hierarchical_needs_a_cluster():
    tg, layout = _traced()
    with pytest.raises(LayoutError, match="needs the cluster's devices per node"):
        run_passes(tg, layout, None)


def test_every_ranks_program_agrees_and_a_leader_that_skips_the_network_is_refused():
    ex = gpt2(layers=1)
    assert autopar.check(ex.model, ex.batch, ex.loss_fn, autopar.Layout(dp=4, allreduce=H),
                         cluster=cluster()) > 0
    mesh = (("dp", 4),)
    assert node_split_members(mesh, 2) == {"dp.local": [[0, 1], [2, 3]], "dp.node": [[0, 2], [1, 3]]}
    tg, layout = _traced()
    from autopar.compiler.ir.collectives import program_collectives
    from autopar.compiler.lowering.lower import to_program
    by_rank = {r: program_collectives(to_program(run_passes(
        tg, layout, cluster(), options={"dp_rank": r})[0], layout)) for r in range(4)}
    assert check_collectives(by_rank, mesh, 2) > 0
    by_rank[2] = {"step": [c for c in by_rank[2]["step"] if c.group != "dp.node"]}
    with pytest.raises(CollectiveMismatch, match="ranks 0 and 2 of one 'dp.node' group"):
        check_collectives(by_rank, mesh, 2)


def test_cost_of_each_level_on_its_link():
    slow = cluster(inter_bw=125e6)
    n = 64e6
    # gloo's flat ring crosses the network at every step
    assert collective_time("all_reduce", n, 4, slow) == pytest.approx(
        ring_all_reduce(n, 4, slow.inter_node, 0.8))
    # the levels: reduce and broadcast inside a node, an all-reduce of two leaders
    local = collective_time("reduce", n, 2, slow)
    assert local == pytest.approx(pipelined_reduce(n, 2, slow.intra_node, 0.8))
    leaders = collective_time("all_reduce", n, 2, slow, stride=2)
    assert leaders == pytest.approx(ring_all_reduce(n, 2, slow.inter_node, 0.8))
    assert 2 * local + leaders < collective_time("all_reduce", n, 4, slow)
    fast = cluster(inter_bw=5e9)
    assert 2 * collective_time("reduce", n, 2, fast) + collective_time(
        "all_reduce", n, 2, fast, stride=2) > collective_time("all_reduce", n, 4, fast)


def test_the_cost_model_prices_the_graphs_collectives_on_their_groups():
    from autopar.compiler.analysis.summary import summarize
    tg, layout = _traced()
    slow = cluster(inter_bw=125e6)
    graph, _ = run_passes(tg, layout, slow, options={"dp_rank": 0})
    ops = [op for op in summarize(graph).ops if op.collective]
    kinds = {(op.collective, op.group) for op in ops}
    assert kinds == {("all_reduce", "dp"), ("reduce", "dp.local"), ("all_reduce", "dp.node"),
                     ("broadcast", "dp.local")}
    for op in ops:
        size, stride = {"dp": (4, 1), "dp.local": (2, 1), "dp.node": (2, 2)}[op.group]
        assert collective_seconds(op, slow, layout) == pytest.approx(
            collective_time(op.collective, op.comm_bytes, size, slow, stride))


@pytest.mark.parametrize("inter_bw, chosen", [(125e6, H), (5e9, "flat")])
def test_the_planner_sums_in_two_levels_where_the_network_is_slow(inter_bw, chosen):
    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    plan = autopar.plan(ex.model, cluster(inter_bw=inter_bw), ex.batch, ex.loss_fn,
                        optimizer="sgd-momentum", tp=1, pp=1, zero=0, amp="off")
    assert plan.layout.allreduce == chosen, plan.layout
    other = [pred for lay, pred, _ in plan.alternatives
             if lay.allreduce != chosen and lay.dp == 4 and lay.recompute == "none"]
    skipped = [why for lay, why in plan.skipped if lay.allreduce != chosen]
    assert other or skipped  # the other way was costed (or bounded out), not left untried


def test_the_planner_never_offers_it_on_one_node():
    ex = gpt2(layers=2, hidden=64, vocab=256, batch=8, seq=32)
    plan = autopar.plan(ex.model, autopar.ClusterSpec.local(4), ex.batch, ex.loss_fn,
                        tp=1, pp=1, amp="off")
    every = [plan.layout, *[lay for lay, _, _ in plan.alternatives], *[lay for lay, _ in plan.skipped]]
    assert all(lay.allreduce == "flat" for lay in every)


def test_the_prediction_says_what_each_group_carries():
    from autopar.compiler.planner.report import tables
    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    slow = cluster(inter_bw=125e6)
    flat = autopar.estimate(ex.model, slow, autopar.Layout(dp=4), ex.batch, ex.loss_fn)
    two = autopar.estimate(ex.model, slow, autopar.Layout(dp=4, allreduce=H), ex.batch, ex.loss_fn)
    grads = sum(p.numel() * 4 for p in ex.model.parameters())
    assert set(flat.comm_bytes) == {"dp"} and flat.comm_bytes["dp"] >= 0.9 * grads
    # the leader's program: every whole bucket reduced and broadcast in the node, summed
    # among the nodes; only the loss (and embedding rows) over the flat group
    assert two.comm_bytes["dp.local"] == 2 * two.comm_bytes["dp.node"]
    assert two.comm_bytes["dp.node"] + two.comm_bytes["dp"] == pytest.approx(flat.comm_bytes["dp"])
    plan = autopar.plan(ex.model, slow, ex.batch, ex.loss_fn, tp=1, pp=1, amp="off")
    rows = {t: r for t, _, r in tables(plan)}
    comm = next(r for t, r in rows.items() if t.startswith("Communication per step"))
    assert [g for g, _ in comm] == list(plan.predicted.comm_bytes)


def test_the_pipeline_runtime_prices_its_levels_as_it_runs_them():
    """Accumulation sums over dp after the schedule (pipeline_cost.dp_sum_time): on a
    slow network two levels cost less than one flat ring, and the leaders' form is the
    reduce, the all-reduce among leaders and the broadcast."""
    from autopar.compiler.planner.pipeline_cost import dp_sum_time
    slow = cluster(inter_bw=1e8)
    flat, two = autopar.Layout(dp=4, microbatches=2), \
        autopar.Layout(dp=4, microbatches=2, allreduce=H)
    n = 8e6
    assert dp_sum_time(n, slow, two) < dp_sum_time(n, slow, flat)
    assert dp_sum_time(n, slow, two) == pytest.approx(
        collective_time("reduce", n, 2, slow) + collective_time("all_reduce", n, 2, slow, 2)
        + collective_time("broadcast", n, 2, slow))
    ex = gpt2(layers=2, batch=8)
    times = [autopar.estimate(ex.model, slow, lay, ex.batch, ex.loss_fn).step_time_s
             for lay in (flat, two)]
    assert times[1] < times[0]
