"""Pipeline parallelism and micro-batching: parity with single-process PyTorch."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from autopar.examples import gpt2, hf_tiny, llama, load_example
from tests.dist.cases_dp import adamw, check_parity, sgd
from tests.dist.registry import case


def pp_case(name, factory, optimizer, world=2, cuts=None, **layout):
    """`cuts`: PassOptions.pipeline_cuts, module paths where stages start."""
    def run():
        options = {"pass_options": {"pipeline_cuts": cuts}} if cuts else {}
        step = check_parity(factory(), optimizer, autopar.Layout(**layout), **options)
        if cuts:  # the stages start where asked: a block by its index, else the module
            stats = {r.name: r for r in step.pass_results}["assign_stages"].stats
            tails = [c.rsplit(".", 1)[1] for c in cuts]
            assert stats["first_block_of_stage"] == \
                [int(t) if t.isdigit() else c for t, c in zip(tails, cuts)], stats
    run.__name__ = name
    case(world=world)(run)


pp_case("pp2_1f1b_gpt2_tied_sgd", lambda: gpt2(layers=4), sgd, pp=2, microbatches=4)
pp_case("pp2_1f1b_gpt2_tied_adamw", lambda: gpt2(layers=4), adamw, pp=2, microbatches=4)
pp_case("pp2_1f1b_llama_sgd", lambda: llama(layers=4), sgd, pp=2, microbatches=4)
pp_case("pp2_gpipe_llama_adamw", lambda: llama(layers=4), adamw, pp=2, microbatches=4,
        schedule="gpipe")
pp_case("pp2_gpipe_gpt2_tied_sgd", lambda: gpt2(layers=4), sgd, pp=2, microbatches=4,
        schedule="gpipe")
pp_case("pp2_interleaved_llama_adamw", lambda: llama(layers=4), adamw, pp=2, microbatches=4,
        schedule="interleaved", virtual_stages=2)
pp_case("pp2_interleaved_gpt2_sgd", lambda: gpt2(layers=4), sgd, pp=2, microbatches=4,
        schedule="interleaved", virtual_stages=2)
pp_case("dp2_microbatches4_gradient_accumulation_llama_sgd", lambda: llama(layers=2), sgd,
        dp=2, microbatches=4)
pp_case("dp2_pp2_1f1b_gpt2_sgd", lambda: gpt2(layers=4), sgd, world=4, dp=2, pp=2, microbatches=2)
pp_case("dp2_pp2_1f1b_llama_adamw", lambda: llama(layers=4), adamw, world=4, dp=2, pp=2,
        microbatches=2)
# a vocabulary large enough that the last stage holds only final norm, head and loss
pp_case("pp2_1f1b_gpt2_head_only_last_stage_sgd", lambda: gpt2(layers=2, vocab=16384), sgd,
        pp=2, microbatches=4)
pp_case("tp2_pp2_1f1b_gpt2_tied_sgd", lambda: gpt2(layers=4), sgd, world=4, tp=2, pp=2,
        microbatches=2)
pp_case("tp2_pp2_1f1b_llama_adamw", lambda: llama(layers=4), adamw, world=4, tp=2, pp=2,
        microbatches=4)
pp_case("tp2_pp2_zero_bubble_llama_sgd", lambda: llama(layers=4), sgd, world=4, tp=2, pp=2,
        microbatches=2, schedule="zero-bubble")
# stages that start inside a block (pinned cuts at a module in it): what crosses is the
# residual and the module's inputs
pp_case("pp2_1f1b_cut_inside_a_block_gpt2_tied_sgd", lambda: gpt2(layers=4), sgd, pp=2,
        microbatches=4, cuts=["transformer.h.2.mlp"])
pp_case("pp2_zero_bubble_cut_inside_a_block_llama_adamw", lambda: llama(layers=4), adamw, pp=2,
        microbatches=4, schedule="zero-bubble", cuts=["model.layers.1.self_attn.o_proj"])
pp_case("pp2_interleaved_cuts_inside_blocks_gpt2_sgd", lambda: gpt2(layers=4), sgd, pp=2,
        microbatches=4, schedule="interleaved", virtual_stages=2,
        cuts=["transformer.h.1.mlp", "transformer.h.2", "transformer.h.3.attn"])
pp_case("tp2_pp2_cut_inside_a_block_llama_sgd", lambda: llama(layers=4), sgd, world=4, tp=2,
        pp=2, microbatches=2, cuts=["model.layers.2.mlp"])


@case(world=2)
def pp2_1f1b_default_cut_inside_a_block_bert_sgd():
    """No cut pinned: the balanced cut moves inside a block by itself (BERT's stages are
    more even cut at a module of a block), and the step keeps parity. (SGD: BERT's key
    biases get a gradient of rounding noise, which AdamW scales to a full step.)"""
    step = check_parity(hf_tiny("bert"), sgd, autopar.Layout(pp=2, microbatches=2))
    stats = {r.name: r for r in step.pass_results}["assign_stages"].stats
    assert isinstance(stats["first_block_of_stage"][0], str), stats


@case(world=2)
def pp2_1f1b_default_cut_inside_a_block_gpt2_256_sgd():
    """The same on GPT-2 4 x 256 (vocabulary 4,096), whose cut moves from before block 3
    to block 2's ln_2 on this cluster. (Not AdamW: on this model some gradient elements
    are rounding noise that AdamW scales to a full step, under dp=2 as much as here.)"""
    example = load_example("gpt2-small4", vocab=4096, hidden=256, layers=4)
    step = check_parity(example, sgd, autopar.Layout(pp=2, microbatches=4), steps=2)
    stats = {r.name: r for r in step.pass_results}["assign_stages"].stats
    assert stats["first_block_of_stage"] == ["transformer.h.2.ln_2"], stats


@case(world=2)
def pp2_1f1b_default_cut_inside_a_block_mixtral_adamw():
    """With AdamW: Mixtral's cut moves by itself to a module of block 1 (its rotary
    embeddings and mask, read by every block's attention, then cross no stage)."""
    step = check_parity(hf_tiny("mixtral"), adamw, autopar.Layout(pp=2, microbatches=2))
    stats = {r.name: r for r in step.pass_results}["assign_stages"].stats
    assert stats["first_block_of_stage"] == ["model.layers.1.post_attention_layernorm"], stats


@case(world=2)
def pp2_planned_from_a_template_compiles_its_cut_between_blocks_gpt2_sgd():
    """A Plan whose pipeline was costed from a two-block template carries
    cut_inside_blocks=False, and compile(layout=plan) applies it: the stages start at
    the block the template's cut stands for, where the same layout compiled alone (this
    model on this cluster) starts its second stage inside block 2."""
    from autopar.compiler.passes.assign_stages import AssignStages
    from autopar.compiler.passes.base import PassContext

    example = load_example("gpt2-small4", vocab=4096, hidden=256, layers=4)
    local = autopar.ClusterSpec.local(2)
    plan = autopar.plan(example.model, local, example.batch, example.loss_fn, pp=2,
                        microbatches=4, schedule="1f1b", workers=0)
    assert plan.pass_options == {"cut_inside_blocks": False}, plan.pass_options
    assert autopar.Plan.from_dict(plan.to_dict()).pass_options == plan.pass_options
    micro = tuple(t[:len(t) // 4] for t in example.batch)
    alone = AssignStages().run(autopar.trace(example.model, micro, example.loss_fn),
                               PassContext(plan.layout, local))[1].stats
    assert alone["first_block_of_stage"] == ["transformer.h.2.ln_2"], alone
    step = check_parity(example, sgd, plan, steps=2)
    stats = {r.name: r for r in step.pass_results}["assign_stages"].stats
    assert stats["first_block_of_stage"] == [3], stats


pp_case("tp2_microbatches4_gradient_accumulation_gpt2_adamw", lambda: gpt2(layers=2), adamw,
        tp=2, microbatches=4)
pp_case("tp2_microbatches4_gradient_accumulation_llama_sgd", lambda: llama(layers=2), sgd,
        tp=2, microbatches=4)


@case(world=2)
def pp2_bad_inputs_say_what_would_work():
    from autopar.compiler.passes.assign_stages import StageError

    example = gpt2(layers=1)
    for layout, message in ((autopar.Layout(pp=2, microbatches=2), "use pp*virtual_stages <= 1"),
                            (autopar.Layout(pp=2, microbatches=3), "multiple of")):
        try:
            autopar.compile(example.model, None, example.batch, example.loss_fn, layout=layout)
        except (StageError, autopar.LayoutError) as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError(f"{layout} was accepted")
pp_case("pp2_zero_bubble_gpt2_tied_sgd", lambda: gpt2(layers=4), sgd, pp=2, microbatches=4,
        schedule="zero-bubble")
pp_case("pp2_zero_bubble_llama_adamw", lambda: llama(layers=4), adamw, pp=2, microbatches=4,
        schedule="zero-bubble")


@case(world=2)
def pp2_cut_to_fit_the_memory_budget_llama_sgd():
    """On a device whose memory the time-balanced cut's first stage exceeds (1F1B keeps
    pp micro-batches there), AssignStages takes the fastest cut that fits; the pipeline
    stays equivalent."""
    _fitted_cut_parity(llama(layers=8), sgd)


def _fitted_cut_parity(example, optimizer):
    from autopar.compiler.analysis.memory import profile_optimizer
    from autopar.compiler.passes.assign_stages import AssignStages
    from autopar.compiler.passes.base import PassContext

    layout = autopar.Layout(pp=2, microbatches=4)
    local = autopar.ClusterSpec.local(2)
    micro = tuple(t[:len(t) // 4] for t in example.batch)  # what each program runs
    tg = autopar.trace(example.model, micro, example.loss_fn)
    options = {"optimizer_memory": profile_optimizer(optimizer)}
    free = AssignStages().run(tg, PassContext(layout, local, options))[1].stats
    budget = max(free["weighed_stage_bytes"]) - 1  # the time-balanced cut misses by a byte
    small = local.model_copy(update={"device": local.device.model_copy(
        update={"memory_bytes": budget})})
    step = check_parity(example, optimizer, layout, cluster=small)
    stats = {r.name: r for r in step.pass_results}["assign_stages"].stats
    assert stats["first_block_of_stage"] != free["first_block_of_stage"], (stats, free)
    assert max(stats["weighed_stage_bytes"]) <= budget, (stats, budget)


@case(world=2)
def pp2_cut_to_fit_the_memory_budget_gpt2_tied_adamw():
    """The same on GPT-2 (tied embeddings on both end stages) with AdamW, whose two
    moments weigh on each stage's parameters."""
    _fitted_cut_parity(gpt2(layers=8), adamw)


@case(world=2)
def pp2_1f1b_llama_8_layers_float64_adamw():
    """In fp32, accumulating 4 micro-batches moves Llama's (8 layers) embedding 4.4% of its
    move away from the full-batch AdamW step, in plain PyTorch as in the pipeline: Adam
    turns rounding of gradients that cancel to near zero into moves of up to lr. In
    float64 the pipeline keeps parity; the rank without the loss stage also all-reduces
    its zero loss in float64."""
    example = llama(layers=8)
    example.model.to(torch.float64)
    check_parity(example, adamw, autopar.Layout(pp=2, microbatches=4))


class _Shifted(torch.nn.Module):
    """x + shift, then a residual MLP: with micro-batches of one row, shift's (1, width)
    gradient is the block's input gradient itself, one tensor of the graph."""

    def __init__(self, width=16):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.randn(1, width) / 4)
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        h = x + self.shift
        return h + torch.tanh(self.lin(h))


class _ShiftedStack(torch.nn.Module):
    def __init__(self, blocks=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Shifted() for _ in range(blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@case(world=2)
def pp2_parameter_gradient_that_is_the_sent_input_gradient_sgd():
    """The last stage's shift gradient is the input gradient it sends back: it stays in
    the micro-batch's environment for the send and its sum is a copy, which the next
    micro-batches add into in place without touching the tensor being sent."""
    from autopar.examples import Example

    torch.manual_seed(0)
    example = Example(_ShiftedStack(), (torch.randn(4, 16),),
                      lambda out, x: (out - torch.sin(x)).pow(2).mean(), "shifted blocks", None)
    step = check_parity(example, sgd, autopar.Layout(pp=2, microbatches=4, fusion=False))
    last = step.program.stages[-1]
    sent = {k for keys in last.send_backward.values() for k in keys}
    parts = {k for p in step.program.grad_parts for k in p}
    assert sent & parts, (sent, parts)  # the case under test
    # what a rank sends is never changed after: gloo may still be reading it (parity
    # alone cannot tell, when each send happens to finish before the next add)
    isend, sends = dist.isend, []

    def recording(tensor, *args, **kwargs):
        sends.append((tensor, tensor.clone()))
        return isend(tensor, *args, **kwargs)
    dist.isend = recording
    try:
        step(torch.randn(4, 16))
    finally:
        dist.isend = isend
    assert sends or dist.get_rank() == 0
    assert all(torch.equal(tensor, then) for tensor, then in sends)
