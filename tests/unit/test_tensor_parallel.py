"""TensorParallel pass: the layout the solver finds, the collectives it inserts, the
solver's optimality against replication, dims that do not divide. Single process: each
rank's program is traced with fake tensors (parity runs in tests/dist/cases_tp.py)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import NamedTuple

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten

import autopar
from autopar.compiler.passes.defaults import run_passes
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.passes.tensor_parallel import (REPLICATED_ALLOWANCE, format_placements,
                                                     plan_tensor_parallel)
from autopar.compiler.passes import tp_solver
from autopar.compiler.passes.tp_rules import R, Strategy, tensor_inputs
from autopar.examples import llama, neox

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
    # the residual stream goes on into a norm, as in a transformer: split by sequence, as
    # the norm takes it (a block whose sum went straight to the loss could split that sum
    # on the hidden dim at the same price)
    model = torch.nn.Sequential(MegatronBlock(), torch.nn.LayerNorm(256))
    tg = trace_train_step(model, (torch.randn(8, 64, 256),), block_loss)
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


@pytest.mark.parametrize("hidden", [256, 512])
def test_local_gloo_keeps_the_residual_stream_whole(hidden):
    """On the cluster `compile` takes without one (`ClusterSpec.local`: gloo over
    loopback, where a reduce-scatter or an all-gather costs about an all-reduce of the
    whole tensor and each call ~0.4 ms), Llama gets Megatron's layout: an all-reduce
    after each row-parallel projection, none of the residual stream reduce-scattered and
    gathered again: on gloo the split stream's extra collectives cost more than the
    elementwise work they save (docs/performance.md, the grid's tp row)."""
    ex = llama(layers=2, hidden=hidden, heads=8, kv_heads=4, vocab=4096, batch=16, seq=128)
    out, _ = tp_graph(ex.model, ex.batch, ex.loss_fn, cluster=autopar.ClusterSpec.local(2))
    forward, backward = collectives(out, backward=False), collectives(out, backward=True)
    assert "reduce_scatter_tensor" not in forward + backward, (forward, backward)
    assert set(backward) == {"all_reduce"}, backward
    placed = params(out)
    for layer in range(2):
        assert placed[f"model.layers.{layer}.self_attn.o_proj.weight"] == 1
        assert placed[f"model.layers.{layer}.mlp.down_proj.weight"] == 1
        assert placed[f"model.layers.{layer}.input_layernorm.weight"] == R


def _split_by_heads(out, seq: int) -> list[tuple[int, ...]]:
    """Every matmul of the attention runs on a block of heads and the scores (..., seq,
    seq) are never gathered. Returns the shapes of the tp all-gathers."""
    # the attention's matmuls (a rotary embedding's frequencies may be a matmul too, of
    # positions: replicated, as they should be)
    rows = [r for r in out.attrs["tp"]["ops"] if r["op"] == "aten.matmul.default"
            and any(part in (r["module"] or "") for part in (".attention", ".attn"))]
    assert rows and all(r["strategy"] == "S(1), S(1) -> S(1)" for r in rows), rows
    gathered = [tuple(n.meta[M.VAL].shape) for n in out.call_nodes()
                if n.target == c10d.all_gather_into_tensor.default]
    assert not [s for s in gathered if s[-2:] == (seq, seq)], gathered
    return gathered


def test_eager_attention_split_by_heads_in_megatron_layout():
    """GPT-NeoX's eager attention (torch.matmul, softmax, torch.matmul; per-head fused
    q/k/v, as Megatron-LM lays it out): column-parallel q/k/v and MLP up projection,
    row-parallel output and down projections, heads split through rotary embedding,
    the 4-D matmuls, mask and softmax; one all-reduce per block each way, as Megatron."""
    ex = neox(hidden=256, heads=8, vocab=1024, batch=4, seq=64)
    out, _ = tp_graph(ex.model, ex.batch, ex.loss_fn)
    placed = params(out)
    for layer in range(2):
        block = f"gpt_neox.layers.{layer}"
        assert placed[f"{block}.attention.query_key_value.weight"] == 0
        assert placed[f"{block}.attention.dense.weight"] == 1
        assert placed[f"{block}.mlp.dense_h_to_4h.weight"] == 0
        assert placed[f"{block}.mlp.dense_4h_to_h.weight"] == 1
    # nothing 4-D (q, k, v, their gradients) is gathered: only around the linears
    assert all(len(shape) < 4 for shape in _split_by_heads(out, 64))
    # Megatron's two all-reduces per block each way, less any the solver turned into a
    # reduce-scatter + all-gather pair (same bytes); none of the 4-D attention tensors
    forward = collectives(out, backward=False)
    assert forward["all_reduce"] + forward["reduce_scatter_tensor"] <= 2 * 2 + 2, forward


def test_gpt2_eager_attention_split_by_heads():
    """GPT-2's eager attention: q @ k^T and scores @ v on blocks of heads (its fused
    q/k/v projection then splits by q/k/v first, so it cannot be column-parallel
    without a strided placement: docs/tensor_parallel.md)."""
    # (at seq 64 the solver keeps this small attention whole: splitting saves less)
    ex = autopar.examples.gpt2(layers=2, hidden=256, heads=8, vocab=1024, batch=8, seq=256,
                               attention="eager")
    out, _ = tp_graph(ex.model, ex.batch, ex.loss_fn)
    _split_by_heads(out, 256)
    assert params(out)["transformer.h.0.attn.c_proj.weight"] == 0  # Conv1D: row-parallel


def test_gpt2_fused_qkv_split_in_pieces_gives_megatron_layout():
    """GPT-2's c_attn (Conv1D to 3h, then split into q, k, v): its weight and bias are
    split in 3 pieces (rank r holds its block of each of q, k and v), so q, k and v come
    out split by heads, sdpa runs on blocks of heads and c_proj is row-parallel. Nothing
    of c_attn's output or the attention is gathered: Megatron's layout."""
    ex = autopar.examples.gpt2(layers=2, hidden=256, heads=8, vocab=1024, batch=8, seq=256)
    out, result = tp_graph(ex.model, ex.batch, ex.loss_fn)
    placed = params(out)
    for i in range(2):
        assert placed[f"transformer.h.{i}.attn.c_attn.weight"] == "S(1)x3"
        assert placed[f"transformer.h.{i}.attn.c_attn.bias"] == "S(0)x3"
        assert placed[f"transformer.h.{i}.attn.c_proj.weight"] == 0  # Conv1D: row-parallel
    sdpa = [r["strategy"] for r in out.attrs["tp"]["ops"]
            if r["op"] == "aten.scaled_dot_product_attention.default"]
    assert sdpa == ["S(1), S(1), S(1) -> S(1)"] * 2
    gathered = [tuple(n.meta[M.VAL].shape) for n in out.call_nodes()
                if n.target == c10d.all_gather_into_tensor.default]
    assert not [s for s in gathered if len(s) == 4 or s[-1] == 3 * 256], gathered
    spec = {p.name: p for p in out.signature.params}["transformer.h.0.attn.c_attn.weight"]
    assert (spec.shape, spec.shard_dim, spec.shard_pieces) == ((256, 384), 1, 3)
    assert result.stats["params"]["S(1)x3"] == 2


@pytest.mark.parametrize("kv_heads,pieces", [(8, "3"), (2, "(256+64+64)")])
def test_phi3_sliced_qkv_in_pieces_gives_megatron_layout(kv_heads, pieces):
    """Phi-3 slices q, k and v out of its fused projection (`qkv[..., :h]`, `qkv[...,
    h:h + kv]`, `qkv[..., h + kv:]`): 3 equal pieces with as many key-value heads as
    heads, pieces of h, kv and kv with grouped ones. qkv_proj's weight is held in those
    pieces, each slice gives its piece split by heads, o_proj is row-parallel, and the
    projection's output is not gathered."""
    ex = autopar.examples.hf_tiny("phi3", num_key_value_heads=kv_heads, num_attention_heads=8,
                                  hidden_size=256, intermediate_size=512, seq=256)
    out, _ = tp_graph(ex.model, ex.batch, ex.loss_fn)
    placed = params(out)
    for i in range(2):
        assert placed[f"model.layers.{i}.self_attn.qkv_proj.weight"] == f"S(0)x{pieces}"
        assert placed[f"model.layers.{i}.self_attn.o_proj.weight"] == 1
    sliced = [r["strategy"] for r in out.attrs["tp"]["ops"]
              if r["op"] == "aten.slice.Tensor" and "S(2)x" in r["strategy"]]
    assert sliced == [f"S(2)x{pieces} -> S(2)"] * 6
    width = 256 + 2 * 256 * kv_heads // 8
    gathered = [tuple(n.meta[M.VAL].shape) for n in out.call_nodes()
                if n.target == c10d.all_gather_into_tensor.default]
    assert not [s for s in gathered if s[-1] == width], gathered


class FusedProjection(torch.nn.Module):
    """One linear to `pieces` x width, cut into its pieces by `cut`, then combined."""

    def __init__(self, cut, width=16, pieces=3):
        super().__init__()
        self.proj = torch.nn.Linear(width, pieces * width)
        self.out = torch.nn.Linear(width, width)
        self.cut = cut

    def forward(self, x):
        parts = self.cut(torch.relu(self.proj(x) * 2))
        return self.out(parts[0] * parts[1] + parts[-1])


def _exported(module, x):
    return torch.export.export(module, (x,), strict=False).graph


@pytest.mark.parametrize("cut", [lambda y: y.split(16, dim=-1), lambda y: y.chunk(3, dim=2),
                                 lambda y: torch.split(y, [16, 16, 16], -1),
                                 lambda y: (y[..., :16], y[..., 16:32], y[..., 32:]),
                                 lambda y: (y.narrow(2, 0, 16), y.narrow(-1, 16, 16),
                                            y[:, :, -16:])],
                         ids=["split", "chunk", "split_with_sizes", "slices", "narrow"])
def test_strided_demand_reaches_the_weight_through_ops_that_keep_the_dim(cut):
    """A split into equal pieces, or slices of such pieces (Phi-3's `qkv[..., :h]`), asks
    its input for the pieces placement; ops that map
    the dim index by index (relu, a scalar mul, the linear's output dim) pass the ask on
    to the weight and bias, and nothing else is asked."""
    from autopar.compiler.passes.tp_rules import Strided, strided_demand

    graph = _exported(FusedProjection(cut), torch.randn(2, 4, 16))
    demand = {name: sorted(p for p in ps) for name, ps in strided_demand(graph, 2).items()
              if ps}
    linear, mul, relu = (n.name for n in graph.nodes if n.target in (
        torch.ops.aten.linear.default, torch.ops.aten.mul.Tensor, torch.ops.aten.relu.default)
        and n.meta["val"].shape[-1] == 48)
    assert demand == {"p_proj_weight": [Strided(0, 3)], "p_proj_bias": [Strided(0, 3)],
                      linear: [Strided(2, 3)], mul: [Strided(2, 3)], relu: [Strided(2, 3)]}


def test_a_view_that_cuts_the_dim_asks_nothing_in_pieces():
    """(b, s, 3w) viewed as (b, s, 3, w) then unbound: the view splits the dim, so its
    pieces no longer lie side by side along one dim: nothing is offered in pieces."""
    from autopar.compiler.passes.tp_rules import strided_demand

    module = FusedProjection(lambda y: y.view(2, 4, 3, 16).unbind(2))
    assert not any(strided_demand(_exported(module, torch.randn(2, 4, 16)), 2).values())


@pytest.mark.parametrize("cut", [lambda y: (y[..., :24], y[..., 24:36], y[..., 36:]),
                                 lambda y: y.split([24, 12, 12], dim=-1)],
                         ids=["slices", "split_with_sizes"])
def test_unequal_pieces_ask_for_their_sizes(cut):
    """Slices that tile the dim in unequal pieces (q and the narrower k and v of grouped
    key-value heads), or a split into them, ask for pieces of those sizes."""
    from autopar.compiler.passes.tp_rules import Strided, strided_demand

    class Unequal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = cut(self.proj(x))
            return (q[..., :12] * k + v).sum()

    graph = _exported(Unequal(), torch.randn(2, 4, 16))
    demand = strided_demand(graph, 2)
    assert demand["p_proj_weight"] == {Strided(0, (24, 12, 12))}


@pytest.mark.parametrize("cut", [lambda y: (y[..., 1:17], y[..., 17:33], y[..., 31:47]),
                                 lambda y: (y[..., ::3], y[..., 1::3], y[..., 2::3])],
                         ids=["off_the_pieces", "strided"])
def test_a_slice_that_is_not_one_equal_piece_asks_nothing_in_pieces(cut):
    """Slices off the pieces' bounds, or with a step, do not cut the dim into pieces that
    lie side by side: nothing is offered in pieces."""
    from autopar.compiler.passes.tp_rules import strided_demand

    module = FusedProjection(cut)
    assert not any(strided_demand(_exported(module, torch.randn(2, 4, 16)), 2).values())


def test_an_ask_that_stops_at_a_view_offers_nothing():
    """Rotary embeddings slice each head in halves (`x[..., :d // 2]`, `x[..., d // 2:]`)
    after a view that cut the projection's dim into heads: the halves' ask stops at the
    view, reaches no parameter, and no value is offered pieces."""
    from autopar.compiler.passes.tp_rules import strided_demand

    class HalvesOfHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 48)

        def forward(self, x):
            heads = self.proj(x).view(2, 4, 3, 16)
            first, second = heads[..., :8], heads[..., 8:]
            return torch.cat([-second, first], dim=-1).sum()

    assert not any(strided_demand(_exported(HalvesOfHeads(), torch.randn(2, 4, 16)), 2).values())


def test_pieces_are_offered_only_where_each_piece_divides():
    """3 pieces of 6 do not split over tp=4: no pieces placement for the weight."""
    from autopar.compiler.passes.tp_rules import strided_demand

    module = FusedProjection(lambda y: y.split(6, dim=-1), width=6)
    assert not any(strided_demand(_exported(module, torch.randn(2, 4, 6)), 4).values())
    assert any(strided_demand(_exported(module, torch.randn(2, 4, 6)), 2).values())


@pytest.mark.parametrize("cut", [lambda y: y.split(256, dim=-1),
                                 lambda y: (y[..., :256], y[..., 256:512], y[..., 512:])],
                         ids=["split", "slices"])
def test_fused_projection_split_in_pieces_by_the_solver(cut):
    """The solver takes the pieces placement on a plain module too: the projection's
    weight in 3 pieces, each piece's consumers on blocks, the output linear row-parallel,
    and no gather of the projection's output."""
    module = FusedProjection(cut, width=256)
    out, _ = tp_graph(module, (torch.randn(8, 64, 256),), lambda y, x: y.square().mean())
    placed = params(out)
    assert placed["proj.weight"] == "S(0)x3" and placed["out.weight"] == 1
    assert collectives(out, backward=False) == {"all_reduce": 1}


def test_matmul_rule_broadcasts_batch_dims():
    """torch.matmul's strategies: a batch dim is split where an operand has it and the
    operand that broadcasts it stays whole; m, n split one operand; k is a partial sum."""
    from autopar.compiler.passes.tp_rules import P, strategies

    class Matmuls(torch.nn.Module):
        def forward(self, x, y, w):
            return torch.matmul(torch.matmul(x, y), w).sum()

    x, y, w = torch.randn(2, 4, 6, 8), torch.randn(4, 8, 6), torch.randn(6, 10)
    ep = torch.export.export(Matmuls(), (x, y, w), strict=False)
    nodes = [n for n in ep.graph.nodes if n.target == torch.ops.aten.matmul.default]
    first = {(s.inputs, s.output) for s in strategies(nodes[0], 2)}
    # out (2, 4, 6, 6): dim 0 only x has, dim 1 both; m from x, n from y, k contracted
    assert first == {((R, R), R), ((0, R), 0), ((1, 0), 1), ((2, R), 2), ((R, 2), 3),
                     ((3, 1), P)}
    second = {(s.inputs, s.output) for s in strategies(nodes[1], 2)}
    assert ((0, R), 0) in second and ((1, R), 1) in second and ((3, 0), P) in second


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


# -- the placement program itself, against enumerating every choice ----------------------

_PRICES = (0.0, 0.25, 1.0, 3.5, math.inf)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_placement_program_finds_the_cheapest_consistent_choice(data):
    """Random ops, each with 1-3 placements of its own cost (one: a fixed choice, folded
    into a constant), and redistributions between them priced per pair of placements
    (inf: not convertible): the program's optimum is the least total over every
    combination of choices that converts nothing unconvertible, and it says so when
    there is none."""
    # seconds as a CPU's ops cost them, or as a GPU's (microseconds: HiGHS's tolerances)
    unit = data.draw(st.sampled_from((1.0, 1e-6)), label="unit")
    count = data.draw(st.integers(2, 5), label="ops")
    opts = [[(Strategy((), p), unit * data.draw(st.sampled_from((0.0, 0.5, 2.0)), label="cost"))
             for p in data.draw(st.lists(st.sampled_from((R, 0, 1)), min_size=1, max_size=3,
                                         unique=True), label="placements")]
            for _ in range(count)]
    pairs = data.draw(st.lists(st.tuples(st.integers(0, count - 1), st.integers(0, count - 1))
                               .filter(lambda e: e[0] < e[1]), max_size=6, unique=True),
                      label="edges")
    price = {e: {(p, q): unit * data.draw(st.sampled_from(_PRICES), label="price")
                 for p in (R, 0, 1) for q in (R, 0, 1)} for e in pairs}

    best = math.inf
    for combo in itertools.product(*opts):
        total = sum(c for _, c in combo) + sum(
            price[a, b][combo[a][0].output, combo[b][0].output] for a, b in pairs)
        best = min(best, total)

    model = tp_solver._Model()
    x = [model.choose(str(i), o) for i, o in enumerate(opts)]
    try:
        for a, b in pairs:
            model.edge(tp_solver._placement_expr(x[a], lambda s: s.output),
                       tp_solver._placement_expr(x[b], lambda s: s.output),
                       lambda p, q, t=price[a, b]: t[p, q])
        model.solve(2)
    except (tp_solver._NoPlan, tp_solver.TensorParallelPlanError):
        assert best == math.inf
        return
    assert best < math.inf
    assert model.objective() == pytest.approx(best, rel=1e-6)
    chosen = [model.chosen(v) for v in x]  # and the choice it returns costs that
    total = sum(dict(o)[s] for o, s in zip(opts, chosen)) + sum(
        price[a, b][chosen[a].output, chosen[b].output] for a, b in pairs)
    assert total == pytest.approx(best, rel=1e-6)


class _Pair(NamedTuple):
    first: object
    second: object


def test_tensor_inputs_in_pytree_order():
    """The solver's fast walk over an op's arguments gives pytree's order (args, then
    kwargs by key order), through tuples, lists, dicts and a namedtuple, and only the
    tensor-valued nodes."""
    g = fx.Graph()
    a, b, c, d, e = (g.placeholder(n) for n in "abcde")
    for n in (a, b, c, d):
        n.meta["val"] = torch.empty(2)
    e.meta["val"] = 3  # not a tensor
    node = g.call_function(torch.ops.aten.cat.default, ((d, [c, e]), _Pair(b, 1)),
                           {"z": a, "y": {"k": (c, b)}})
    expected = [x for x in tree_flatten((node.args, node.kwargs))[0]
                if isinstance(x, fx.Node) and isinstance(x.meta["val"], torch.Tensor)]
    assert tensor_inputs(node) == expected == [d, c, b, a, c, b]
