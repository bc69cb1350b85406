"""Hierarchical all-reduce (Layout.allreduce="hierarchical") on 4 processes arranged as
2 nodes x 2 (a ClusterSpec of two nodes; the processes share this machine): exact
against the flat all-reduce, parity with one process, and who uses the network."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.api import build_step
from autopar.compiler.ir import comm_ops
from autopar.compiler.ir.batch import Objective
from autopar.examples import gpt2
from autopar.testing import compare, make_batches, reference_train
from tests.dist.cases_dp import adamw, sgd
from tests.dist.registry import case


def two_nodes() -> autopar.ClusterSpec:
    """This machine's 4 processes described as 2 nodes of 2 devices."""
    local = autopar.ClusterSpec.local(4).to_dict()
    return autopar.ClusterSpec.from_dict({**local, "name": "two-nodes", "nodes": 2,
                                          "devices_per_node": 2})


def step_of(model, batch, loss_fn, optimizer, layout, form="auto", targets=None):
    objective, flat = Objective.from_example(batch, targets, loss_fn)
    return build_step(model, two_nodes(), flat, objective, optimizer, layout,
                      pass_options={"hierarchy_form": form}), objective


class _IntegerLinear(torch.nn.Module):
    """Weights of 15 and 3 elements: the bias does not divide by the 2 ranks of a node."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(5, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.arange(15.0).reshape(3, 5) - 7)
            self.fc.bias.copy_(torch.tensor([1.0, -2.0, 3.0]))

    def forward(self, x):
        return self.fc(x)


def _integer_step(layout, form):
    """The integer model's step under `layout` with SGD (lr 1), and its integer batch."""
    torch.manual_seed(0)
    model = _IntegerLinear()
    x = torch.randint(-3, 4, (8, 5)).float()
    loss_fn = lambda out, x: (out * torch.arange(1.0, 4.0)).sum()
    step, _ = step_of(model, (x,), loss_fn, lambda p: torch.optim.SGD(p, lr=1.0), layout, form)
    return step, x


def _integer_grads(layout, form):
    """The weights after 3 steps of SGD (lr 1) on integer data: the loss sums over the
    batch, so every gradient (each rank's share, summed over dp = 4) is an integer, and
    sums are exact in any order."""
    step, x = _integer_step(layout, form)
    for k in range(3):
        step(x + k)
    return step.full_state_dict()


@case(world=4)
def hierarchical_integer_gradients_equal_flat_both_forms():
    flat = _integer_grads(autopar.Layout(dp=4, bucket_mb=0.0), "auto")
    for form in ("leaders", "shards"):
        # a bucket per gradient (3 elements: padded), one bucket; and without overlap
        for bucket_mb, overlap in ((0.0, True), (25.0, True), (25.0, False)):
            layout = autopar.Layout(dp=4, bucket_mb=bucket_mb, allreduce="hierarchical",
                                    overlap_comm=overlap)
            got = _integer_grads(layout, form)
            for name, value in flat.items():
                assert torch.equal(got[name], value), (form, bucket_mb, overlap, name)
            assert not torch.equal(flat["fc.weight"], _IntegerLinear().fc.weight.detach())


def _parity(optimizer, form, steps):
    example = gpt2()
    objective, flat = Objective.from_example(example.batch, None, example.loss_fn)
    init = {k: v.clone() for k, v in example.model.state_dict().items()}
    batches = make_batches(flat, steps)
    ref_losses, ref_state = reference_train(example.model, batches, objective, optimizer)
    layout = autopar.Layout(dp=4, allreduce="hierarchical", bucket_mb=0.05)
    step, objective = step_of(copy.deepcopy(example.model), example.batch, example.loss_fn,
                              optimizer, layout, form)
    stats = {r.name: r for r in step.pass_results}["insert_allreduce"].stats
    assert stats["allreduce"].startswith("hierarchical over 2 nodes x 2 ranks"), stats
    assert stats["buckets"] > 2, stats  # several chains in flight at once
    losses = [step(*objective.unflatten(b)[0]).item() for b in batches]
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init,
                     adam=optimizer is adamw)
    assert report.ok, str(report)
    return step


@case(world=4)
def hierarchical_parity_gpt2_20_steps_sgd_leaders():
    _parity(sgd, "leaders", 20)


@case(world=4)
def hierarchical_parity_gpt2_adamw_shards():
    _parity(adamw, "shards", 6)


class _CountCollectives(TorchDispatchMode):
    """The collectives this process runs, by the name of the group they run over."""

    def __init__(self):
        super().__init__()
        self.by_group: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "_c10d_functional" or func is comm_ops.reduce:
            names = [a for a in args if isinstance(a, str)]
            if names and not func.__name__.startswith("wait_tensor"):
                self.by_group[names[-1]] = self.by_group.get(names[-1], 0) + 1
        return func(*args, **(kwargs or {}))


@case(world=4)
def hierarchical_only_node_leaders_use_the_inter_node_group():
    example = gpt2()
    layout = autopar.Layout(dp=4, allreduce="hierarchical", bucket_mb=0.05)
    step, objective = step_of(example.model, example.batch, example.loss_fn, sgd, layout)
    counter = _CountCollectives()
    with counter:
        step(*objective.unflatten(make_batches(
            Objective.from_example(example.batch, None, example.loss_fn)[1], 1)[0])[0])
    names = step.mesh.group_names
    node, local = counter.by_group.get(names["dp.node"], 0), counter.by_group.get(names["dp.local"], 0)
    buckets = {r.name: r for r in step.pass_results}["insert_allreduce"].stats["buckets"]
    leader = dist.get_rank() % 2 == 0  # ranks 0, 2: the first of nodes 0 and 1
    assert node == (buckets if leader else 0), (dist.get_rank(), counter.by_group, names)
    assert local == 2 * buckets, (counter.by_group, names)  # a reduce and a broadcast each
    members = dist.get_process_group_ranks(step.mesh.group("dp.node"))
    assert members == ([0, 2] if leader else [1, 3]), members
    assert dist.get_process_group_ranks(step.mesh.group("dp.local")) == \
        ([0, 1] if dist.get_rank() < 2 else [2, 3])


@case(world=4)
def hierarchical_on_the_pipeline_runtime_both_forms():
    """Gradient accumulation (the pipeline runtime, which sums over dp after the
    schedule): integer gradients equal the flat sum bitwise in both forms, and GPT-2
    keeps parity with one process."""
    flat = _integer_grads(autopar.Layout(dp=4, microbatches=2), "auto")
    for form in ("leaders", "shards"):
        got = _integer_grads(autopar.Layout(dp=4, microbatches=2, allreduce="hierarchical"),
                             form)
        for name, value in flat.items():
            assert torch.equal(got[name], value), (form, name, got[name], value)
    example = gpt2()
    objective, flat_batch = Objective.from_example(example.batch, None, example.loss_fn)
    init = {k: v.clone() for k, v in example.model.state_dict().items()}
    batches = make_batches(flat_batch, 6)
    ref_losses, ref_state = reference_train(example.model, batches, objective, sgd)
    step, objective = step_of(copy.deepcopy(example.model), example.batch, example.loss_fn,
                              sgd, autopar.Layout(dp=4, microbatches=2,
                                                  allreduce="hierarchical"), "leaders")
    assert step.node_split == 2 and step.mesh.group("dp.node") is not None
    losses = [step(*objective.unflatten(b)[0]).item() for b in batches]
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)


def _local_sgd(layout, form):
    """Local SGD of the integer model, 4 steps of SGD (lr 1): each rank's own gradient is
    an integer over 2 (its share's mean), so the parameters' sums and their mean over 4
    ranks are exact in any order."""
    step, x = _integer_step(layout, form)
    for k in range(4):
        step(x + k * dist.get_rank())  # the ranks' data differ: their steps move apart
    return step


@case(world=4)
def hierarchical_local_sgd_average_equals_flat_and_only_leaders_cross():
    """Local SGD's parameter average with Layout.allreduce="hierarchical" takes the
    gradients' three levels (Mesh.sum_over_dp), on both runtimes (micro-batches run on
    the pipeline's): the parameters equal the flat average's bitwise, and in the
    leaders form only the first rank of each node uses the inter-node group."""
    ops = ("all_reduce", "reduce", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor")
    for extra in ({}, {"microbatches": 2}):
        flat = _local_sgd(autopar.Layout(dp=4, local_sgd=2, **extra), "auto").full_state_dict()
        for form in ("leaders", "shards"):
            calls, saved = [], {op: getattr(dist, op) for op in ops}

            def recorder(op):
                def call(*args, group=None, **kwargs):
                    calls.append((op, "WORLD" if group is None else group.group_name))
                    return saved[op](*args, group=group, **kwargs)
                return call

            for op in ops:
                setattr(dist, op, recorder(op))
            try:
                step = _local_sgd(autopar.Layout(dp=4, local_sgd=2, allreduce="hierarchical",
                                                 **extra), form)
            finally:
                for op, fn in saved.items():
                    setattr(dist, op, fn)
            assert step.schedule.averagings == 2, step.schedule
            got = step.full_state_dict()
            for name, value in flat.items():
                assert torch.equal(got[name], value), (extra, form, name, got[name], value)
            names = step.mesh.group_names
            crossing = [c for c in calls if c[1] == names["dp.node"]]
            inside = [c for c in calls if c[1] == names["dp.local"]]
            leader = dist.get_rank() % 2 == 0
            expected = 2 if leader or form == "shards" else 0  # one per averaging
            assert len(crossing) == expected, (extra, form, dist.get_rank(), calls)
            assert len(inside) == 4, (extra, form, calls)  # two per averaging


@case(world=4)
def every_group_autopar_makes_takes_the_world_groups_collective_timeout():
    """init_process_group's `timeout` bounds every collective of the job: the groups of
    the mesh's dimensions, the hierarchical all-reduce's node groups, a pipeline's groups
    of a weight two stages read, and mesh.new_group's (the background saves', Local SGD's
    detached ones). torch would give each new group its backend's 30 min instead."""
    from datetime import timedelta

    from autopar.runtime import mesh as mesh_module

    world = dist.group.WORLD
    before = mesh_module.collective_timeout()
    wanted = timedelta(seconds=77)
    dist.distributed_c10d._set_pg_timeout(wanted, world)
    try:
        assert mesh_module.collective_timeout() == wanted

        def timeout(group):
            return group._get_backend(torch.device("cpu")).options._timeout

        example = gpt2(layers=2)
        layouts = (autopar.Layout(dp=4, allreduce="hierarchical"),
                   autopar.Layout(dp=2, tp=2), autopar.Layout(dp=2, pp=2, microbatches=2))
        for layout in layouts:
            step, _ = step_of(copy.deepcopy(example.model), example.batch, example.loss_fn,
                              sgd, layout)
            groups = {name: step.mesh.group(name) for name in step.mesh.group_names}
            groups.update(getattr(step, "_groups", {}))
            if layout.pp > 1:
                assert groups.keys() - step.mesh.group_names, "no group of a shared weight"
            assert len(groups) >= 2, (layout, groups)
            for name, group in groups.items():
                assert timeout(group) == wanted, (layout, name, timeout(group))
        assert timeout(mesh_module.new_group(backend="gloo")) == wanted
        assert timeout(dist.new_group()) == timedelta(minutes=30)  # torch's own default
    finally:
        dist.distributed_c10d._set_pg_timeout(before, world)
