"""ZeRO stages 1, 2 and 3: parity with single-process PyTorch, optimizer state held as
dim-0 blocks over the data-parallel ranks, checkpoints that reshard."""

from __future__ import annotations

import math

import torch

import autopar
from autopar.examples import gpt2, llama, mlp
from tests.dist.cases_dp import adamw, check_parity, sgd, tied_padded_lm
from tests.dist.cases_tp import check_resume_and_reshard
from tests.dist.registry import case


def _check_state_is_blocks(step, dp: int) -> None:
    """AdamW's / momentum's state exists only for this rank's blocks: about 1/dp."""
    held = sum(t.numel() for s in step.optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    whole = _whole_elements(step, dp)
    per_element = 2 if isinstance(step.optimizer, torch.optim.AdamW) else 1
    assert held <= per_element * whole * (1 / dp + 0.05), (held, whole)


def _check_params_are_blocks(step, dp: int) -> None:
    """ZeRO-3: the parameters this rank holds between steps are about 1/dp of the model."""
    distinct = {id(t): t for t in [*step.params, *step.updated]}  # whole ones are emptied
    held = sum(t.numel() for t in distinct.values())
    whole = _whole_elements(step, dp)
    assert held <= whole * (1 / dp + 0.05), (held, whole)


def _whole_elements(step, dp: int) -> int:
    """Elements of the whole model's trainable parameters (ZeRO-3 entries are blocks)."""
    blocks = getattr(step, "in_graph_block", [False] * len(step.program.params))
    return sum(math.prod(e.shape) * (dp if b else 1) for e, b in zip(step.program.params, blocks))


def zero_case(name, factory, optimizer, world=2, rows_gathered=None, **layout):
    def run():
        step = check_parity(factory(), optimizer, autopar.Layout(**layout))
        if rows_gathered is not None:
            stats = {r.name: r.stats for r in step.pass_results}["insert_allreduce"]
            assert stats["embedding_grads_gathered"] == rows_gathered, stats
        _check_state_is_blocks(step, layout["dp"])
        pipelined = layout.get("pp", 1) > 1 or layout.get("microbatches", 1) > 1
        if layout.get("zero", 0) >= 2 and not pipelined:  # the pipeline runtime scatters
            stats = {r.name: r.stats for r in step.pass_results}
            assert stats["insert_allreduce"]["reduce_scattered_grads"] > 0
        if layout.get("zero") == 3:
            _check_params_are_blocks(step, layout["dp"])
    run.__name__ = name
    case(world=world)(run)


for _zero in (1, 2, 3):
    zero_case(f"dp2_zero{_zero}_parity_gpt2_tied_adamw", gpt2, adamw, dp=2, zero=_zero)
    zero_case(f"dp2_zero{_zero}_parity_gpt2_tied_sgd", gpt2, sgd, dp=2, zero=_zero)
    zero_case(f"dp2_zero{_zero}_parity_llama_adamw", llama, adamw, dp=2, zero=_zero)
zero_case("dp2_zero2_parity_mlp_sgd", mlp, sgd, dp=2, zero=2)
zero_case("dp2_zero3_parity_mlp_sgd", mlp, sgd, dp=2, zero=3)
zero_case("dp4_zero3_parity_llama_adamw", lambda: llama(batch=8), adamw, world=4, dp=4, zero=3)
# a table larger than its rows: the gathered rows build each rank's block of it
zero_case("dp2_zero2_embedding_rows_into_blocks_llama_sgd", lambda: llama(vocab=1024), sgd,
          rows_gathered=["model.embed_tokens.weight"], dp=2, zero=2)
zero_case("dp2_zero3_embedding_rows_into_blocks_tied_padded_sgd", tied_padded_lm, sgd,
          rows_gathered=["embed.weight"], dp=2, zero=3)
# an odd vocabulary: the last rank's block of the tied table is padded with a zero row
zero_case("dp2_zero2_odd_rows_padded_gpt2_tied_sgd", lambda: gpt2(vocab=255), sgd, dp=2, zero=2)
zero_case("dp2_zero3_odd_rows_padded_gpt2_tied_adamw", lambda: gpt2(vocab=255), adamw, dp=2,
          zero=3)
zero_case("dp2_tp2_zero2_parity_llama_adamw", llama, adamw, world=4, dp=2, tp=2, zero=2)


@case(world=2)
def dp2_zero2_checkpoint_resume_equals_uninterrupted_and_loads_without_zero():
    check_resume_and_reshard(gpt2, autopar.Layout(dp=2, zero=2), autopar.Layout(dp=2))


@case(world=2)
def dp2_zero3_checkpoint_resume_equals_uninterrupted_and_loads_without_zero():
    check_resume_and_reshard(llama, autopar.Layout(dp=2, zero=3), autopar.Layout(dp=2))


@case(world=2)
def dp2_zero3_padded_blocks_checkpoint_resume_and_reshard():
    check_resume_and_reshard(lambda seed=0: gpt2(vocab=255, seed=seed),
                             autopar.Layout(dp=2, zero=3), autopar.Layout(dp=2))
zero_case("dp2_tp2_zero3_parity_llama_adamw", llama, adamw, world=4, dp=2, tp=2, zero=3)
zero_case("dp2_tp2_zero3_parity_gpt2_tied_sgd", gpt2, sgd, world=4, dp=2, tp=2, zero=3)

# ZeRO-1/2 with pipelining and gradient accumulation (the pipeline runtime's optimizer)
zero_case("dp2_microbatches4_zero2_parity_gpt2_tied_adamw", gpt2, adamw, dp=2, microbatches=4,
          zero=2)
zero_case("dp2_microbatches4_zero1_parity_llama_sgd", llama, sgd, dp=2, microbatches=4, zero=1)
zero_case("dp2_pp2_zero2_parity_gpt2_tied_adamw", lambda: gpt2(layers=4), adamw, world=4, dp=2,
          pp=2, microbatches=4, zero=2)
zero_case("dp2_pp2_zero1_parity_llama_sgd", lambda: llama(layers=4), sgd, world=4, dp=2, pp=2,
          microbatches=4, zero=1)
zero_case("dp2_pp2_zero3_parity_llama_adamw", lambda: llama(layers=4), adamw, world=4, dp=2,
          pp=2, microbatches=4, zero=3)
zero_case("dp2_microbatches4_zero3_parity_gpt2_tied_sgd", gpt2, sgd, dp=2, microbatches=4, zero=3)

# SGD with momentum where the layout had only AdamW, which is nearly blind to gradient
# scale (a sum where a mean belongs passes under Adam, not under SGD)
zero_case("dp2_tp2_zero2_parity_llama_sgd", llama, sgd, world=4, dp=2, tp=2, zero=2)
zero_case("dp4_zero3_parity_llama_sgd", lambda: llama(batch=8), sgd, world=4, dp=4, zero=3)
zero_case("dp2_pp2_zero2_parity_gpt2_tied_sgd", lambda: gpt2(layers=4), sgd, world=4, dp=2,
          pp=2, microbatches=4, zero=2)
zero_case("dp2_pp2_zero3_parity_llama_sgd", lambda: llama(layers=4), sgd, world=4, dp=2, pp=2,
          microbatches=4, zero=3)
zero_case("dp2_microbatches4_zero2_parity_gpt2_tied_sgd", gpt2, sgd, dp=2, microbatches=4,
          zero=2)
zero_case("dp2_zero3_odd_rows_padded_gpt2_tied_sgd", lambda: gpt2(vocab=255), sgd, dp=2, zero=3)
