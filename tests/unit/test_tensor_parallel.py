"""TensorParallel pass: the layout the solver finds, the collectives it inserts, the
solver's optimality against replication, dims that do not divide. Single process: each
rank's program is traced with fake tensors (parity runs in tests/dist/cases_tp.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.api import run_passes
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.passes.tensor_parallel import (REPLICATED_ALLOWANCE, format_placements,
                                                     plan_tensor_parallel)
from autopar.compiler.passes.tp_rules import R
from autopar.examples import llama

c10d = torch.ops._c10d_functional
DGX = autopar.ClusterSpec.preset("dgx-a100-80gb")


class MegatronBlock(torch.nn.Module):
    """norm -> up projection -> GELU -> down projection, with a residual."""

    def __init__(self, width=256, hidden=1024):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def block_loss(out, x):
    return F.mse_loss(out, torch.roll(x, 1, dims=-1))


def tp_graph(model, batch, loss_fn, cluster=DGX, tp=2, rank=0):
    tg = trace_train_step(model, batch, loss_fn)
    out, results = run_passes(tg, autopar.Layout(tp=tp), cluster, options={"tp_rank": rank})
    return out, results[0]


def collectives(tg, backward: bool):
    """Collectives of the forward side (forward and loss roles) or of the backward."""
    side = {M.Role.BACKWARD} if backward else {M.Role.FORWARD, M.Role.LOSS}
    return Counter(n.target._opname for n in tg.call_nodes()
                   if n.target in (c10d.all_reduce.default, c10d.all_gather_into_tensor.default,
                                   c10d.reduce_scatter_tensor.default)
                   and n.meta[M.ROLE] in side)


def params(tg):
    return tg.attrs["tp"]["params"]


def test_megatron_mlp_block_one_all_reduce_each_way():
    out, result = tp_graph(MegatronBlock(), (torch.randn(8, 64, 256),), block_loss)
    placed = params(out)
    assert placed["up.weight"] == 0 and placed["up.bias"] == 0  # column-parallel
    assert placed["down.weight"] == 1 and placed["down.bias"] == R  # row-parallel
    assert collectives(out, backward=False) == {"all_reduce": 1}
    assert collectives(out, backward=True) == {"all_reduce": 1}  # Megatron's "f"
    shapes = {p.name: p.shape for p in out.signature.params}
    assert shapes["up.weight"] == (512, 256) and shapes["down.weight"] == (256, 512)
    assert result.stats["predicted_speedup"] > 1


def test_sequence_parallel_gathers_and_scatters_instead_of_all_reduce():
    tg = trace_train_step(MegatronBlock(), (torch.randn(8, 64, 256),), block_loss)
    out, _ = run_passes(tg, autopar.Layout(tp=2, sequence_parallel=True), DGX,
                        options={"tp_rank": 0})
    ops = {r["node"]: r["strategy"] for r in out.attrs["tp"]["ops"]}
    assert ops["layer_norm"].startswith("S(1)")  # the norm runs on a sequence block
    assert ops["add"] == "S(1), S(1) -> S(1)"  # and the residual add
    forward = collectives(out, backward=False)
    # gathered before the column-parallel matmul (and for the loss), reduce-scattered after
    # the row-parallel one: no all-reduce
    assert forward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}, forward
    shapes = {n.name: tuple(n.meta[M.VAL].shape) for n in out.call_nodes()
              if n.target == c10d.reduce_scatter_tensor.default}
    # forward and backward (the gathered input's gradient): half the sequence per rank
    assert set(shapes.values()) == {(32, 8, 256)}, shapes


def test_llama_attention_by_heads_and_vocabulary_parallel_loss():
    ex = llama(layers=2, hidden=256, heads=8, kv_heads=4, vocab=8192, batch=4, seq=64)
    out, _ = tp_graph(ex.model, ex.batch, ex.loss_fn)
    placed = params(out)
    for layer in range(2):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        for proj in ("q", "k", "v"):  # grouped-query: 8 query heads, 4 key/value heads
            assert placed[f"{attn}.{proj}_proj.weight"] == 0
        assert placed[f"{attn}.o_proj.weight"] == 1
        assert placed[f"{mlp}.gate_proj.weight"] == 0 and placed[f"{mlp}.up_proj.weight"] == 0
        assert placed[f"{mlp}.down_proj.weight"] == 1
    assert placed["lm_head.weight"] == 0  # vocabulary-parallel head ...
    lowerings = " ".join(r["strategy"] for r in out.attrs["tp"]["ops"])
    assert "vocab_parallel_cross_entropy" in lowerings  # ... and loss
    # the logits (..., 8192) are never gathered whole
    for node in out.call_nodes():
        if node.target == c10d.all_gather_into_tensor.default:
            assert 8192 not in node.meta[M.VAL].shape, node.name
    table = format_placements(out.attrs["tp"])
    assert "model.layers.0.self_attn.q_proj.weight" in table and "S(0)" in table


def test_ranks_hold_their_own_vocabulary_rows():
    ex = llama(layers=1, hidden=128, heads=4, kv_heads=2, vocab=512, batch=2, seq=32)
    graphs = [tp_graph(ex.model, ex.batch, ex.loss_fn, rank=r)[0] for r in (0, 1)]
    text = [g.gm.code for g in graphs]
    assert text[0] != text[1]  # the rank is baked into each program (its row offset)
    for g in graphs:
        assert collectives(g, backward=True) == collectives(graphs[0], backward=True)


@settings(max_examples=12, deadline=None)
@given(width=st.integers(3, 48), hidden=st.integers(3, 96), batch=st.integers(1, 16),
       tp=st.sampled_from([2, 4]))
def test_solver_never_worse_than_replicating(width, hidden, batch, tp):
    torch.manual_seed(0)
    tg = trace_train_step(MegatronBlock(width, hidden), (torch.randn(batch, width),), block_loss)
    # without the parameter budget (which rules replication out), replicating every op is
    # one of the plans the program weighs: the optimum is never predicted slower
    plan, names = plan_tensor_parallel(tg, tp, None, tp, param_budget=False)
    assert plan.cost_s <= plan.replicated_cost_s * (1 + 1e-9)
    for name in names:  # a split parameter's dim divides
        p = plan.placement[name]
        if isinstance(p, int):
            node = next(n for n in tg.source.exported.graph.nodes if n.name == name)
            assert node.meta["val"].shape[p] % tp == 0


@settings(max_examples=8, deadline=None)
@given(width=st.sampled_from([8, 16, 48]), hidden=st.sampled_from([8, 32, 96]),
       tp=st.sampled_from([2, 4]))
def test_split_weights_fit_the_budget(width, hidden, tp):
    tg = trace_train_step(MegatronBlock(width, hidden), (torch.randn(4, width),), block_loss)
    plan, names = plan_tensor_parallel(tg, tp, None, tp)
    whole = {n.name: n.meta["val"].numel() for n in tg.source.exported.graph.nodes if n.name in names}
    held = sum(v / tp if isinstance(plan.placement[n], int) else v for n, v in whole.items())
    assert held <= (1 / tp + REPLICATED_ALLOWANCE) * sum(whole.values()) + 1e-6


def test_dims_that_do_not_divide_stay_whole_and_are_reported():
    model = MegatronBlock(width=33, hidden=63)
    out, result = tp_graph(model, (torch.randn(4, 33),), block_loss)
    placed = params(out)
    assert all(p == R for p in placed.values()), placed
    declined = dict(result.declined)
    assert "no dim of [63, 33] divides by tp=2" in declined["split of up.weight"]
    assert all(p.shard_dim is None for p in out.signature.params)


def test_compile_refuses_a_world_size_that_does_not_fit_tp():
    ex = llama(layers=2)
    with pytest.raises(autopar.LayoutError, match=r"needs dp\*tp\*pp = 4 processes.*"
                                                  r"torchrun --nproc-per-node 4"):
        autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=autopar.Layout(tp=2, pp=2))
