"""The checkpoint matrix: a step saved in one layout resumes bit for bit in the same
layout and loads into another (resharded by torch.distributed.checkpoint), training on
within rounding of the uninterrupted run. Pipelined schedules, ZeRO, tensor parallelism
with ZeRO on the same dim, and fp16's loss scaler."""

from __future__ import annotations

import autopar
from autopar.examples import gpt2, hf_tiny, llama
from tests.dist.cases_dp import adamw, sgd
from tests.dist.cases_tp import check_resume_and_reshard
from tests.dist.registry import case

L = autopar.Layout
PP_1F1B = dict(pp=2, microbatches=4)
PP_INTERLEAVED = dict(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2)
PP_ZERO_BUBBLE = dict(pp=2, microbatches=4, schedule="zero-bubble")


def _gpt2(seed=0):
    return gpt2(layers=4, seed=seed)  # tied embeddings: held by both pipeline stages


def _gpt2_odd(seed=0):
    return gpt2(layers=4, vocab=255, seed=seed)  # ZeRO's last block padded


def _llama(seed=0):
    return llama(layers=4, seed=seed)


def _phi3(seed=0):
    return hf_tiny("phi3", seed=seed)


def matrix_case(name, factory, saved, loaded, world=2, optimizer=adamw, atol=1e-6,
                background=False, pieces=False):
    def run():
        check_resume_and_reshard(factory, L(**saved), L(**loaded), optimizer=optimizer,
                                 atol=atol, background=background, pieces=pieces)
    run.__name__ = name
    case(world=world)(run)


matrix_case("ckpt_pp2_1f1b_to_dp2_gpt2_tied_sgd", _gpt2, PP_1F1B, dict(dp=2), optimizer=sgd)
# written in the background (async_save) while the run trains on
matrix_case("ckpt_background_pp2_zero_bubble_to_tp2_llama", _llama, PP_ZERO_BUBBLE, dict(tp=2),
            background=True)
matrix_case("ckpt_pp2_interleaved_to_pp2_zero_bubble_llama", _llama, PP_INTERLEAVED,
            PP_ZERO_BUBBLE)
matrix_case("ckpt_pp2_zero_bubble_to_dp2_zero3_gpt2_odd", _gpt2_odd, PP_ZERO_BUBBLE,
            dict(dp=2, zero=3))
matrix_case("ckpt_dp2_zero3_to_pp2_1f1b_llama_sgd", _llama, dict(dp=2, zero=3), PP_1F1B,
            optimizer=sgd)
matrix_case("ckpt_tp2_to_pp2_interleaved_gpt2_tied", _gpt2, dict(tp=2), PP_INTERLEAVED,
            pieces=True)
matrix_case("ckpt_fp16_dp2_to_fp16_pp2_llama", _llama, dict(dp=2, amp="fp16"),
            dict(**PP_1F1B, amp="fp16"), atol=1e-4)
# tensor parallelism and ZeRO both cut dim 0 (column-parallel weights, embeddings)
matrix_case("ckpt_dp2_tp2_zero2_to_dp2_pp2_zero1_llama", _llama, dict(dp=2, tp=2, zero=2),
            dict(dp=2, **PP_1F1B, zero=1), world=4, background=True)
matrix_case("ckpt_dp4_to_dp2_pp2_gpt2_odd_sgd", _gpt2_odd, dict(dp=4),
            dict(dp=2, **PP_1F1B), world=4, optimizer=sgd)
matrix_case("ckpt_dp2_pp2_zero3_to_dp2_tp2_zero3_gpt2_tied", _gpt2, dict(dp=2, **PP_1F1B, zero=3),
            dict(dp=2, tp=2, zero=3), world=4)
# GPT-2's fused q/k/v weight and bias split in 3 pieces (tp_rules.Strided) and, under
# ZeRO, their dim-0 blocks: stored as plain blocks of the whole (shards.recut)
matrix_case("ckpt_dp2_tp2_zero3_to_dp2_pp2_zero1_gpt2_tied_sgd", _gpt2, dict(dp=2, tp=2, zero=3),
            dict(dp=2, **PP_1F1B, zero=1), world=4, optimizer=sgd, pieces=True)
matrix_case("ckpt_dp2_tp2_zero2_to_dp4_gpt2_tied", _gpt2, dict(dp=2, tp=2, zero=2), dict(dp=4),
            world=4, pieces=True)
# Phi-3's fused q/k/v with grouped key-value heads: pieces of unequal sizes (64, 32, 32)
matrix_case("ckpt_tp2_to_dp2_phi3_gqa_unequal_pieces_sgd", _phi3, dict(tp=2), dict(dp=2),
            optimizer=sgd, pieces=True)
