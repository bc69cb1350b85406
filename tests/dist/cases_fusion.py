"""Fusion (Layout.fusion=True) composed with dp, tp, pp and ZeRO: parity with single-process
PyTorch. On CPU the fused kernels run their eager fallbacks (the regions' own aten ops),
so these check that the fused graph stays a valid, equivalent program after the comm
passes and the pipeline cut; the kernels themselves are checked in the unit tier."""

from __future__ import annotations

import autopar
from autopar.examples import gpt2, llama
from tests.dist.cases_dp import adamw, check_parity, sgd
from tests.dist.registry import case


def fusion_case(name, factory, optimizer, world=2, **layout):
    def run():
        step = check_parity(factory(), optimizer, autopar.Layout(fusion=True, **layout))
        results = getattr(step, "pass_results", [])
        fusion = [r for r in results if r.name == "fusion"]
        assert fusion and fusion[0].stats.get("kernels", 0) > 0, [r.summary() for r in results]
    run.__name__ = name
    case(world=world)(run)


fusion_case("fusion_dp2_gpt2_sgd", gpt2, sgd, dp=2)
fusion_case("fusion_dp2_zero2_llama_adamw", llama, adamw, dp=2, zero=2)
fusion_case("fusion_tp2_llama_sgd", llama, sgd, tp=2)
fusion_case("fusion_tp2_sequence_parallel_gpt2_sgd", gpt2, sgd, tp=2, sequence_parallel=True)
fusion_case("fusion_pp2_1f1b_gpt2_sgd", lambda: gpt2(layers=4), sgd, pp=2, microbatches=2)
fusion_case("fusion_pp2_zero_bubble_llama_sgd", lambda: llama(layers=4), sgd, pp=2,
            microbatches=2, schedule="zero-bubble")
