"""ZeRO stages 1 and 2: parity with single-process PyTorch, optimizer state held as
dim-0 blocks over the data-parallel ranks, checkpoints that reshard."""

from __future__ import annotations

import torch

import autopar
from autopar.examples import gpt2, llama, mlp
from tests.dist.cases_dp import adamw, check_parity, sgd
from tests.dist.cases_tp import check_resume_and_reshard
from tests.dist.registry import case


def _check_state_is_blocks(step, dp: int) -> None:
    """AdamW's / momentum's state exists only for this rank's blocks: about 1/dp."""
    held = sum(t.numel() for s in step.optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)
    whole = sum(p.numel() for p in step.params)
    per_element = 2 if isinstance(step.optimizer, torch.optim.AdamW) else 1
    assert held <= per_element * whole * (1 / dp + 0.05), (held, whole)


def zero_case(name, factory, optimizer, world=2, **layout):
    def run():
        step = check_parity(factory(), optimizer, autopar.Layout(**layout))
        _check_state_is_blocks(step, layout["dp"])
        if layout.get("zero") == 2:
            assert step.pass_results[-1].stats["reduce_scattered_grads"] > 0
    run.__name__ = name
    case(world=world)(run)


for _zero in (1, 2):
    zero_case(f"dp2_zero{_zero}_parity_gpt2_tied_adamw", gpt2, adamw, dp=2, zero=_zero)
    zero_case(f"dp2_zero{_zero}_parity_gpt2_tied_sgd", gpt2, sgd, dp=2, zero=_zero)
    zero_case(f"dp2_zero{_zero}_parity_llama_adamw", llama, adamw, dp=2, zero=_zero)
zero_case("dp2_zero2_parity_mlp_sgd", mlp, sgd, dp=2, zero=2)
zero_case("dp2_zero2_embedding_rows_gathered_llama_sgd", lambda: llama(vocab=1024), sgd,
          dp=2, zero=2)
zero_case("dp2_tp2_zero2_parity_llama_adamw", llama, adamw, world=4, dp=2, tp=2, zero=2)


@case(world=2)
def dp2_zero2_checkpoint_resume_equals_uninterrupted_and_loads_without_zero():
    check_resume_and_reshard(gpt2, autopar.Layout(dp=2, zero=2), autopar.Layout(dp=2))
