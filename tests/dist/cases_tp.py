"""Tensor parallelism: parity with single-process PyTorch (tp=2 on 2 processes,
dp=2 x tp=2 on 4), shards held per rank, and the redistributions on real gloo groups."""

from __future__ import annotations

import copy
import random

import torch
import torch.distributed as dist

import autopar
from autopar.compiler.passes import tp_comm
from autopar.compiler.passes.tp_rules import P, R
from autopar.examples import gpt2, llama, mlp
from tests.dist.cases_dp import adamw, check_parity, sgd
from tests.dist.registry import case


def _check_sharded(step, tp: int) -> None:
    """The step holds about 1/tp of the model's weights, and AdamW's state of those."""
    held = sum(p.numel() for p in step.params)
    whole = sum(e.numel for e in (_whole_entry(e, tp) for e in step.program.params))
    assert held <= 0.55 * whole, f"this rank holds {held} of {whole} parameter elements"
    for p in step.params:  # optimizer state lives only for the block
        for t in step.optimizer.state[p].values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                assert t.shape == p.shape, (t.shape, p.shape)


def _whole_entry(entry, tp):
    from autopar.compiler.ir.graph import TensorSpec

    shape = list(entry.shape)
    if entry.shard_dim is not None:
        shape[entry.shard_dim] *= tp
    return TensorSpec(entry.name, tuple(shape), entry.dtype)


def tp_case(name, factory, optimizer, world=2, **layout):
    def run():
        step = check_parity(factory(), optimizer, autopar.Layout(**layout))
        _check_sharded(step, layout["tp"])
    run.__name__ = name
    case(world=world)(run)


for _name, _factory in {"gpt2_tied": gpt2, "llama_gqa": llama, "mlp": mlp}.items():
    for _opt in (adamw, sgd):
        tp_case(f"tp2_parity_{_name}_{_opt.__name__}", _factory, _opt, tp=2)
    tp_case(f"dp2_tp2_parity_{_name}_adamw", _factory, adamw, world=4, dp=2, tp=2)
tp_case("dp2_tp2_parity_llama_gqa_sgd", llama, sgd, world=4, dp=2, tp=2)
tp_case("tp2_sequence_parallel_parity_llama_gqa_adamw", llama, adamw, tp=2, sequence_parallel=True)
tp_case("tp2_sequence_parallel_parity_gpt2_tied_sgd", gpt2, sgd, tp=2, sequence_parallel=True)
tp_case("dp2_tp2_sequence_parallel_parity_gpt2_tied_adamw", gpt2, adamw, world=4, dp=2, tp=2,
        sequence_parallel=True)


@case(world=2)
def tp2_redistributions_are_exact():
    """Shard-then-gather is the identity, partial sums add up, for random shapes and dims
    (a seeded loop rather than hypothesis: every rank must draw the same cases)."""
    group = tp_comm.TPGroup(dist.group.WORLD.group_name, 2, dist.get_rank())
    rng = random.Random(7)
    for _ in range(25):
        shape = [2 * rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randint(0, 99)))
        a, b = rng.randrange(len(shape)), rng.randrange(len(shape))
        block = tp_comm.redistribute(whole, R, a, group)
        assert torch.equal(tp_comm.redistribute(block, a, R, group), whole)
        assert torch.equal(tp_comm.redistribute(block, a, b, group),
                           tp_comm.redistribute(whole, R, b, group))
        term = whole * (dist.get_rank() + 1) / 3  # the terms sum to `whole`
        assert torch.allclose(tp_comm.redistribute(term, P, R, group), whole, atol=1e-6)
        assert torch.allclose(tp_comm.redistribute(term, P, b, group),
                              tp_comm.redistribute(whole, R, b, group), atol=1e-6)


@case(world=2)
def tp2_checkpoint_is_refused_with_a_message():
    example = mlp()
    step = autopar.compile(copy.deepcopy(example.model), None, example.batch, example.loss_fn,
                           layout=autopar.Layout(tp=2))
    try:
        step.save("/nonexistent/never-written")
    except NotImplementedError as exc:
        assert "tensor-parallel" in str(exc) and "full_state_dict" in str(exc), exc
    else:
        raise AssertionError("a tensor-parallel checkpoint was accepted")
