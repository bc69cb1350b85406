"""Gradient accumulation in place: a stage program adds its gradient parts into their sums
as it makes them (pipeline_program.accumulating), as autograd adds into `.grad`."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.compiler.analysis.live_bytes import LiveBytes
from autopar.compiler.ir.batch import Objective
from autopar.compiler.ir.pipeline_program import accumulating
from autopar.testing import compare, make_batches, reference_train


def _program(x, w):
    g_w = torch.mm(x.t(), x)  # a part made early, read by nothing after
    h = torch.mm(x, w)
    return g_w, h.sum(0), h.t()  # parts g_w and h^T (a view), one kept output


def test_accumulating_adds_each_part_into_its_sum_and_frees_it_where_made():
    gm = fx.symbolic_trace(_program)
    summing, sums, kept = accumulating(gm, ("g", "s", "ht"), {"g", "ht"})
    assert sums == ("g", "ht") and kept == ("s",)
    x, w = torch.randn(256, 256), torch.randn(256, 256)
    plain = gm(x, w)
    acc = [torch.ones(256, 256), torch.ones(256, 256)]
    with LiveBytes() as added:
        out = summing(x, w, *acc)
    assert torch.equal(out[0], plain[1])
    assert torch.equal(acc[0], plain[0] + 1) and torch.equal(acc[1], plain[2] + 1)
    with LiveBytes() as returned:
        gm(x, w)
    # the plain program holds g_w until it returns, beside h and its sum; the summing one
    # frees it once added: its peak is h and its sum
    assert added.peak_bytes == 256 * 256 * 4 + 256 * 4
    assert returned.peak_bytes == 2 * 256 * 256 * 4 + 256 * 4


class SummedWeights(torch.nn.Module):
    """Two parameters whose gradients are one node of the traced graph (the gradient of
    their sum): one part, one sum, given to both."""

    def __init__(self, width=16):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(width, width) / width)
        self.b = torch.nn.Parameter(torch.randn(width, width) / width)

    def forward(self, x):
        return torch.tanh(x @ (self.a + self.b))


def test_two_parameters_with_one_gradient_node_accumulate_it_once():
    torch.manual_seed(0)
    model = SummedWeights()
    batch = (torch.randn(8, 16),)

    def loss_fn(out, x):
        return (out - x).pow(2).mean()

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    objective, flat = Objective.from_example(batch, None, loss_fn)
    batches = make_batches(flat, 4)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ref_losses, ref_state = reference_train(model, batches, objective, sgd)
    step = autopar.compile(copy.deepcopy(model), None, batch, loss_fn, optimizer=sgd,
                           layout=autopar.Layout(microbatches=4, fusion=False))
    parts = dict(zip((e.name for e in step.program.params), step.program.grad_parts))
    assert parts["a"] == parts["b"], parts  # the case under test
    losses = [step(*b).item() for b in batches]
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)


def test_a_backward_frees_each_saved_activation_after_its_last_use():
    """The runtime gives each stage program the values of the micro-batch's environment
    that no later action reads (PipelineProgram.dying_inputs) in a boxed call, so the
    backward frees a saved activation once the op reading it last has run, as autograd
    does, instead of holding every one to its end. The reference is the same step with
    nothing given up: its peak is higher by at least the largest saved value (the
    log-probabilities, 2 x 31 x 256 fp32), and the memory replay predicts both peaks."""
    from autopar.compiler.analysis.live_bytes import measure_step
    from autopar.compiler.analysis.memory import profile_optimizer
    from autopar.compiler.ir.pipeline_program import PipelineProgram
    from autopar.compiler.planner.pipeline_memory import pipeline_memory
    from autopar.examples import load_example

    ex = load_example("gpt2-tiny")
    optimizer = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    step = autopar.compile(copy.deepcopy(ex.model), example_inputs=ex.batch, loss_fn=ex.loss_fn,
                           layout=autopar.Layout(microbatches=4), optimizer=optimizer)
    step(*ex.batch)
    freed, _ = measure_step(step, *ex.batch)
    predicted = pipeline_memory(step.program, 0, profile_optimizer(optimizer), True).peak_bytes
    dying, step._dying = step._dying, {}
    try:
        held, _ = measure_step(step, *ex.batch)
    finally:
        step._dying = dying
    original = PipelineProgram.dying_inputs
    PipelineProgram.dying_inputs = lambda self, rank: {}
    try:
        predicted_held = pipeline_memory(step.program, 0, profile_optimizer(optimizer),
                                         True).peak_bytes
    finally:
        PipelineProgram.dying_inputs = original
    assert held - freed >= 2 * 31 * 256 * 4, (held, freed)
    assert predicted == pytest.approx(freed, rel=1e-3)
    assert predicted_held == pytest.approx(held, rel=1e-3)


def test_the_inputs_a_program_reads_last_are_its_own_values_never_sent_or_shared():
    """dying_inputs on a zero-bubble schedule of two stages: every dying key is an input
    of its action's program that no later program of the rank reads in that
    micro-batch, never a value the stage sends, a parameter or a micro-batch input; and
    the weight gradient (W, each micro-batch's last program on a stage) frees every
    value an earlier program of the stage made and W reads."""
    from autopar.compiler.ir.pipeline_program import PROGRAM_KINDS
    from autopar.compiler.lowering.lower_pipeline import lower_pipeline
    from autopar.examples import load_example

    ex = load_example("gpt2-tiny")
    layout = autopar.Layout(pp=2, microbatches=2, schedule="zero-bubble")
    tg, _ = autopar.run_passes(autopar.trace(ex.model, ex.batch, ex.loss_fn), layout)
    program = lower_pipeline(tg, layout)
    by_stage = {p.stage: p for p in program.stages}
    kept = set(program.keys)  # parameters, buffers, micro-batch inputs
    for rank in range(2):
        actions = program.schedule.ranks[rank]
        dying = program.dying_inputs(rank)
        kinds = set()
        for i, keys in dying.items():
            action = actions[i]
            assert action.kind in PROGRAM_KINDS
            stage = by_stage[action.stage]
            _, inputs, _ = stage.program(action.kind)
            sent = {k for keys in (*stage.send_forward.values(), *stage.send_backward.values())
                    for k in keys}
            assert set(keys) <= set(inputs) and not set(keys) & (kept | sent), action
            for later in actions[i + 1:]:
                if later.microbatch == action.microbatch and later.kind in PROGRAM_KINDS:
                    assert not set(keys) & set(by_stage[later.stage].program(later.kind)[1])
            kinds.add(action.kind)
        for i, action in enumerate(actions):
            if action.kind != "W":
                continue
            stage = by_stage[action.stage]
            made = {k for kind in "FI" for k in stage.program(kind)[2]}
            sent = {k for keys in (*stage.send_forward.values(), *stage.send_backward.values())
                    for k in keys}
            reads = set(stage.program("W")[1]) & made - sent
            assert reads and reads == set(dying[i]), action
        assert "W" in kinds, kinds
