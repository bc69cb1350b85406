"""Each bad input a user can give gets the documented error, and its message names what
the user controls (the world size to launch, the batch size compiled, the part of the
batch, the cut, the checkpoint's parameters, the CLI flag)."""

import pytest
import torch

import autopar
from autopar import cli
from autopar.compiler.ir.batch import BatchError
from autopar.compiler.ir.trace import TraceError, trace_train_step
from autopar.compiler.passes.assign_stages import StageError
from autopar.examples import gpt2, mlp
from autopar.layout import LayoutError
from autopar.runtime.checkpoint import CheckpointError
from autopar.runtime.mesh import WorldSizeError, build_mesh


@pytest.fixture(scope="module")
def ex():
    return gpt2(layers=2, batch=4, seq=8)


def test_a_layout_for_more_processes_than_the_job_says_how_to_launch(ex):
    with pytest.raises(LayoutError, match=r"dp\*tp\*pp = 2 processes, but the world size is 1: "
                                          r"start it with `torchrun --nproc-per-node 2`"):
        autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=autopar.Layout(dp=2))


def test_a_program_mesh_for_another_world_size_is_a_world_size_error():
    with pytest.raises(WorldSizeError, match=r"compiled for 4 processes .* the job has 1: "
                                             r"start it with `torchrun --nproc-per-node 4"):
        build_mesh([("dp", 2), ("tp", 2)])


def test_a_non_tensor_in_the_batch_names_its_type(ex):
    with pytest.raises(BatchError, match=r"must be a tensor \(got \['int'\]\)"):
        autopar.compile(ex.model, None, (ex.batch[0], 3), ex.loss_fn, layout=autopar.Layout())
    with pytest.raises(BatchError, match=r"must be a tensor \(got \['str'\]\)"):
        autopar.trace(ex.model, (ex.batch[0], "labels"), lambda out, ids, s: out.logits.sum())
    with pytest.raises(TraceError, match=r"example_inputs must all be tensors \(got \['str'\]\)"):
        trace_train_step(ex.model, (ex.batch[0], "labels"), lambda out, ids, s: out.logits.sum())


class _NoLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


def test_an_output_without_a_loss_and_no_loss_fn_says_to_pass_one():
    with pytest.raises(TraceError, match=r"scalar floating-point tensor, got \(2, 4\); pass "
                                         r"loss_fn="):
        autopar.compile(_NoLoss(), None, (torch.randn(2, 4),), layout=autopar.Layout())


def test_an_empty_batch_is_refused(ex):
    for layout in (autopar.Layout(), None):
        with pytest.raises(ValueError, match="compile needs example_inputs: one global batch"):
            autopar.compile(ex.model, None, (), ex.loss_fn, layout=layout)


def test_a_layout_of_another_type_names_the_type(ex):
    with pytest.raises(TypeError, match="layout must be an autopar.Layout or Plan, got dict"):
        autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout={"dp": 1})


def test_planning_in_compile_needs_a_cluster_spec_of_the_jobs_size(ex):
    with pytest.raises(TypeError, match="needs cluster to be an autopar.ClusterSpec .* got str"):
        autopar.compile(ex.model, "dgx-h100", ex.batch, ex.loss_fn, layout=None)
    with pytest.raises(LayoutError, match=r"has 2 devices and this job has 1 processes: launch 2 "
                                          r"processes, or pass a cluster of 1 devices"):
        autopar.compile(ex.model, autopar.ClusterSpec.local(nprocs=2), ex.batch, ex.loss_fn,
                        layout=None)


@pytest.mark.parametrize("layout", [autopar.Layout(), autopar.Layout(microbatches=2)],
                         ids=["step", "pipelined"])
def test_a_batch_of_another_size_names_the_size_compiled(ex, layout):
    step = autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=layout)
    with pytest.raises(BatchError, match=r"input_0: global batch of 3 along dim 0, but the "
                                         r"program was compiled for 4"):
        step(ex.batch[0][:3])


def test_pipeline_cuts_must_be_distinct_blocks(ex):
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    layout = autopar.Layout(pp=2, microbatches=2)
    with pytest.raises(StageError, match=r"2 stages need 1 distinct cuts, in order, none at the "
                                         r"first block; got \['transformer.h.1', "
                                         r"'transformer.h.1'\]"):
        autopar.run_passes(tg, layout, options={"pipeline_cuts": ["transformer.h.1",
                                                                  "transformer.h.1"]})
    with pytest.raises(StageError, match=r"cut 'model.transformer.h.1' is not a block of the "
                                         r"model or a module inside one; the blocks are "
                                         r"transformer.h.0 \.\.\. transformer.h.1"):
        autopar.run_passes(tg, layout, options={"pipeline_cuts": ["model.transformer.h.1"]})


def test_pass_options_of_compile_need_a_layout_and_leave_its_own_fields(ex):
    with pytest.raises(ValueError, match=r"pass_options set how the passes rewrite a given "
                                         r"layout; pass layout= too"):
        autopar.compile(ex.model, None, ex.batch, ex.loss_fn,
                        pass_options={"pipeline_cuts": ["transformer.h.1"]})
    with pytest.raises(ValueError, match=r"pass_options \['amp_lists', 'tp_rank'\] are set by "
                                         r"compile itself"):
        autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=autopar.Layout(),
                        pass_options={"tp_rank": 1, "amp_lists": {}})


def test_heads_that_do_not_split_over_tp_are_said_in_the_pass_result(ex):
    """GPT-2 with 4 heads on tp=8: its linear layers are split, its attention cannot be
    split by heads and runs whole; the tensor_parallel result says so for each block."""
    tg = autopar.trace(gpt2(layers=2, heads=4).model, ex.batch, ex.loss_fn)
    _, results = autopar.run_passes(tg, autopar.Layout(tp=8))
    declined = dict({r.name: r for r in results}["tensor_parallel"].declined)
    whole = {what: why for what, why in declined.items() if what.startswith("attention")}
    assert sorted(what.rsplit(" at ", 1)[1] for what in whole) == \
        ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert all(why.startswith("4/4 heads (q/k) do not split over tp=8: it runs whole")
               for why in whole.values())
    # on tp=2 the heads divide: an attention the solver keeps whole says why that was
    _, results = autopar.run_passes(tg, autopar.Layout(tp=2))
    assert all(why.startswith("splitting it by heads was costed higher")
               for what, why in {r.name: r for r in results}["tensor_parallel"].declined
               if what.startswith("attention"))


def test_loading_another_models_checkpoint_names_the_parameters(ex, tmp_path):
    step = autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=autopar.Layout())
    step.save(tmp_path / "ckpt")
    other = mlp()
    wrong = autopar.compile(other.model, None, other.batch, other.loss_fn, layout=autopar.Layout())
    with pytest.raises(CheckpointError, match=r"does not match this model:\s+not in the "
                                              r"checkpoint: layers.0.weight"):
        wrong.load(tmp_path / "ckpt")


@pytest.mark.parametrize("argv, message", [
    (["estimate", "gpt2-tiny", "--cluster", "dgx-h100", "--dp", "8", "--optimizer", "adamx"],
     "argument --optimizer: invalid choice: 'adamx'"),
    (["plan", "gpt2-tiny", "--cluster", "dgx-h100", "--optimizer", "sgdd"],
     "argument --optimizer: invalid choice: 'sgdd'"),
    (["estimate", "gpt2-tiny", "--cluster", "dgx-h100", "--nodes", "0", "--dp", "8"],
     "preset 'dgx-h100': nodes: must be >= 1, got 0"),
    (["plan", "gpt2-tiny", "--cluster", "dgx-h100", "--nodes", "-1"],
     "preset 'dgx-h100': nodes: must be >= 1, got -1"),
    # a cut the model cannot take: found while its graph is rewritten, a message too
    (["estimate", "gpt2-tiny", "--cluster", "dgx-h100", "--dp", "2", "--pp", "4",
      "--microbatches", "4"],
     "autopar estimate: 4 pipeline stages (pp=4 x virtual_stages=1) but the model has 2 "
     "repeated blocks to cut between; use pp*virtual_stages <= 2"),
    (["check", "gpt2-tiny", "--pp", "4", "--microbatches", "4"],
     "autopar check: 4 pipeline stages"),
    (["validate", "gpt2-tiny", "--layout", '{"dp": 2'],
     "autopar validate: --layout '{\"dp\": 2' is not JSON"),
    (["validate", "gpt2-tiny", "--layout", "[2]"],
     "autopar validate: --layout '[2]' is not a JSON object of Layout fields"),
    (["validate", "gpt2-tiny", "--layout", '{"dp": 3}'],
     "autopar validate: the global batch of 8 does not split evenly into dp=3"),
    # a model that is not there: found before anything is launched, named with what is
    (["train", "gpt2-tny", "--dp", "2"],
     "autopar train: no built-in example 'gpt2-tny' (did you mean 'gpt2-tiny'?)"),
    (["bisect", "mypkg.models:gpt", "--dp", "2"],
     "autopar bisect: cannot load model factory 'mypkg.models:gpt': No module named 'mypkg'"),
    (["estimate", "lama", "--dp", "2"],
     "autopar estimate: 'lama' is neither a built-in example"),
])
def test_a_bad_cli_flag_names_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code != 0
    assert message in capsys.readouterr().err + str(info.value.code)


def test_plan_arguments_are_plan_argument_errors_and_a_bug_is_not_hidden(monkeypatch, capsys):
    """The CLI turns what the user controls into a message; an error from inside the
    planner (a bug) keeps its traceback instead of reading as bad input."""
    ex = gpt2(layers=4)
    cluster = autopar.ClusterSpec.preset("dgx-h100")
    with pytest.raises(autopar.PlanArgumentError, match="workers needs per-block tracing"):
        autopar.plan(ex.model, cluster, ex.batch, ex.loss_fn, trace_blocks="exact", workers=1)
    with pytest.raises(autopar.PlanArgumentError, match="optimizer must be one of"):
        autopar.estimate(ex.model, cluster, autopar.Layout(dp=8), ex.batch, ex.loss_fn,
                         optimizer="lamb")
    with pytest.raises(SystemExit, match="autopar plan: workers needs per-block tracing"):
        cli.main(["plan", "gpt2-tiny", "--cluster", "dgx-h100", "--trace-blocks", "exact",
                  "--workers", "1"])

    def broken(*args, **kwargs):
        raise ValueError("an internal bug")
    monkeypatch.setattr("autopar.compiler.planner.plan.plan", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        cli.main(["plan", "gpt2-tiny", "--cluster", "dgx-h100"])


def test_a_tensor_parallel_placement_that_no_strategy_admits_names_the_op(monkeypatch):
    """The solver's constraints cannot all hold (here: the loss op offered only as a
    partial sum, while the step returns the loss whole): the error names the op, its
    source line, and tp=1 as what works."""
    import dataclasses

    from autopar.compiler.passes import tp_solver
    from autopar.compiler.passes.tp_rules import P

    real = tp_solver.strategies

    def partial_loss(node, tp, *args, **kwargs):
        found = real(node, tp, *args, **kwargs)
        returned = node.graph.output_node().args[0]
        if node in returned and tp > 1:
            return [dataclasses.replace(s, output=P) for s in found]
        return found

    monkeypatch.setattr(tp_solver, "strategies", partial_loss)
    ex = gpt2(layers=1)
    with pytest.raises(tp_solver.TensorParallelPlanError,
                       match=r"tensor parallelism \(tp=2\) found no valid placement for .* "
                             r"\(node .*\) at .*: the step returns it whole.*Layout\(tp=1\)"):
        autopar.check(ex.model, ex.batch, ex.loss_fn, autopar.Layout(tp=2))
