"""sync_batch_norm on the joint graph, and the layouts that refuse a batch norm in
training mode. Its parity with single-process PyTorch runs in tests/dist/
cases_batch_norm.py (real gloo groups)."""

from __future__ import annotations

import operator

import pytest
import torch

import autopar
from autopar.api import build_ps
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.batch import Objective
from autopar.compiler.ir.program import mesh_group_tag
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.passes.assign_stages import StageError
from autopar.compiler.passes.defaults import default_passes, run_passes
from autopar.compiler.passes.sync_batch_norm import BatchNormError, SyncBatchNorm
from autopar.layout import Layout, LayoutError, PSLayout
from tests.dist.cases_batch_norm import cnn

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BATCH_NORMS = {aten._native_batch_norm_legit_functional.default,
               aten._native_batch_norm_legit.no_stats, aten.native_batch_norm.default,
               aten.native_batch_norm_backward.default}


def _traced(model, example, labels):
    objective, flat = Objective.from_example(example, labels, torch.nn.functional.cross_entropy)
    return trace_train_step(model, [t[: t.shape[0] // 2] for t in flat], objective)


def _ops(tg):
    return [n.target for n in tg.call_nodes()]


def test_each_batch_norm_and_its_backward_sum_over_the_data_parallel_group():
    example, labels = cnn()
    tg = _traced(example.model, example.batch, labels)
    out, (result,) = run_passes(tg, Layout(dp=2), autopar.ClusterSpec.local(2), [SyncBatchNorm()])
    assert result.stats == {"batch_norms": 2, "backwards": 2, "collectives": 4}
    assert not BATCH_NORMS & set(_ops(out))
    # forward: each shard's mean and squared deviations gathered, [2C] from each rank;
    # backward: sum(g) and sum(g xhat) summed, [2C]
    gathers = [n for n in out.call_nodes() if n.target is c10d.all_gather_into_tensor.default]
    reduces = [n for n in out.call_nodes() if n.target is c10d.all_reduce.default]
    assert [n.meta[M.ROLE] for n in gathers] == [M.Role.FORWARD] * 2
    assert [n.meta[M.ROLE] for n in reduces] == [M.Role.BACKWARD] * 2
    assert [tuple(n.meta[M.VAL].shape) for n in gathers + reduces] == [(32,), (32,), (16,), (16,)]
    assert {n.args[1:] for n in gathers} == {(2, mesh_group_tag("dp"))}
    assert {n.args[1:] for n in reduces} == {("sum", mesh_group_tag("dp"))}
    made = [n for n in out.call_nodes() if n.meta.get(M.CREATED_BY) == "sync_batch_norm"]
    # annotated as the module they replace, with bytes for the cost model
    assert {n.meta[M.MODULE_PATH] for n in made} == {"1", "4"}
    assert all(n.meta[M.BYTES] > 0 for n in made if n.target is aten.sum.dim_IntList)
    # the step still returns the running statistics the model's buffers take
    assert out.signature.mutated_buffers == tg.signature.mutated_buffers
    assert tg.gm is not out.gm and BATCH_NORMS & set(_ops(tg))  # the input is untouched


def test_one_rank_and_running_statistics_leave_the_graph_as_it_is():
    example, labels = cnn()
    tg = _traced(example.model, example.batch, labels)
    same, (result,) = run_passes(tg, Layout(dp=1), None, [SyncBatchNorm()])
    assert not result.changed and _ops(same) == _ops(tg)
    tracked = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                                  torch.nn.Linear(6, 3)).eval()
    tg = _traced(tracked, (torch.randn(8, 4),), (torch.randint(0, 3, (8,)),))
    same, (result,) = run_passes(tg, Layout(dp=2), autopar.ClusterSpec.local(2), [SyncBatchNorm()])
    assert not result.changed and result.declined == [("batch statistics",
                                                       "no batch norm in training mode")]


def test_the_default_passes_sum_statistics_wherever_the_batch_is_split_over_dp():
    names = lambda layout: [p.name for p in default_passes(layout)]  # noqa: E731
    assert "sync_batch_norm" in names(Layout(dp=2, tp=2, dgc=0.99))
    assert names(Layout(dp=2)).index("sync_batch_norm") < names(Layout(dp=2)).index("insert_allreduce")
    for layout in (Layout(), Layout(tp=2), Layout(dp=2, local_sgd=4)):
        assert "sync_batch_norm" not in names(layout), layout


def test_a_norm_updating_its_running_statistics_in_place_is_refused_under_dp():
    # export leaves the functional form; a graph from elsewhere (not functionalised) can
    # hold the in-place one, whose statistics the pass does not rewrite: an error naming
    # the module, not a step on the shard's statistics
    example, labels = cnn()
    tg = _traced(example.model, example.batch, labels)
    node = next(n for n in tg.call_nodes()
                if n.target is aten._native_batch_norm_legit_functional.default)
    node.target = aten._native_batch_norm_legit.default  # the same arguments, in place
    with pytest.raises(BatchNormError, match=r"module 1 \(BatchNorm2d\): batch norm as "
                                             r"aten._native_batch_norm_legit.default in "
                                             r"training mode, updating .* in place; dp=2"):
        run_passes(tg, Layout(dp=2), autopar.ClusterSpec.local(2), [SyncBatchNorm()])


def test_micro_batches_refuse_a_training_batch_norm_and_name_the_module():
    example, labels = cnn()
    with pytest.raises(StageError, match=r"module 1 \(BatchNorm2d\): a batch norm in training "
                                         r"mode .* 2 micro-batches .* use microbatches=1"):
        autopar.check(example.model, example.batch, example.loss_fn,
                      Layout(dp=2, microbatches=2), autopar.ClusterSpec.local(2),
                      example_targets=labels)
    example.model.eval()  # the untracked norm still takes the batch's statistics
    with pytest.raises(StageError, match=r"module 4 \(BatchNorm2d\)"):
        autopar.check(example.model, example.batch, example.loss_fn,
                      Layout(microbatches=2), autopar.ClusterSpec.local(1),
                      example_targets=labels)


def test_a_plan_never_micro_batches_a_batch_norm():
    example, labels = cnn(16)
    plan = autopar.plan(example.model, autopar.ClusterSpec.local(2), example.batch,
                        example.loss_fn, example_targets=labels, workers=0)
    assert plan.layout.microbatches == 1 and plan.layout.pp == 1
    refused = [lay for lay, why in plan.skipped if "a batch norm in training mode" in why]
    assert refused and all(lay.microbatches > 1 for lay in refused)


class _Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.EmbeddingBag(50, 8, mode="sum")
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.norm(self.table(ids))).squeeze(-1)


def test_parameter_server_trainers_refuse_a_training_batch_norm():
    model = _Tower()
    ids, target = torch.randint(0, 50, (8, 3)), torch.rand(8)
    loss = lambda out, y: torch.nn.functional.mse_loss(out, y)  # noqa: E731
    objective, flat = Objective.from_example((ids,), (target,), loss)
    layout = Layout(dp=2, ps=PSLayout(servers=1, mode="sync"))
    with pytest.raises(LayoutError, match=r"module norm \(BatchNorm1d\): .* 2 parameter-server "
                                          r"trainers"):
        build_ps(model, None, flat, objective, lambda p: torch.optim.SGD(p, lr=0.1), layout)


def test_getitems_of_the_rewritten_norm_are_gone():
    example, labels = cnn()
    out = run_passes(_traced(example.model, example.batch, labels), Layout(dp=2),
                     autopar.ClusterSpec.local(2), [SyncBatchNorm()])[0]
    # every getitem left reads an op that still exists (dead ones were eliminated)
    assert all(n.args[0].target not in BATCH_NORMS for n in out.call_nodes()
               if n.target is operator.getitem)
