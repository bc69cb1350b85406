"""Sharding rules of views and slicing ops (tp_rules.py) against the ops themselves.

Random chains of views, written as users write them, are exported as autopar captures
a forward (`torch.export.export(..., strict=False)`). For every op of the graph that has
a rule and every strategy that splits or partially sums an input (in pieces too, where a
split into equal pieces asks for them: `strided_demand`), each rank runs the op on its
part of a global input (with the size arguments rewritten by `local_view_args` and
`local_split_args`, as the TensorParallel hook does) and must get its part of the global
output under the strategy's output placement; the vector-Jacobian product of the local op
on the rank's part of a cotangent must be the rank's part of the global one (what
autograd derives for the backward). Single process: the ranks are simulated."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten, tree_unflatten

import autopar
from autopar.compiler.passes.defaults import run_passes
from autopar.compiler.passes import tp_rules
from autopar.compiler.passes.tensor_parallel import local_split_args, local_view_args
from autopar.compiler.passes.tp_rules import (P, R, ShardingRuleError, Strategy, Strided,
                                              is_tensor_node, strategies)
from autopar.examples import hf_tiny, llama
from autopar.runtime.shards import tp_block

aten = torch.ops.aten
TP = 2
MAX_NUMEL = 1024  # a chain's tensors stay small (the checks run every op per rank)
MAX_DIMS = 5

# the ops the chains must reach: every view the rules know, and the slicing ops
COVERED_OPS = tp_rules.VIEWS | {aten.slice.Tensor, aten.narrow.default, aten.select.int,
                                aten.unbind.int, aten.split.Tensor,
                                aten.split_with_sizes.default, aten.chunk.default,
                                aten.cat.default}


# -- view chains as users write them -----------------------------------------------------------
# A form draws its arguments for an input shape with `choose` (one of a finite list: hypothesis
# draws it in the property test, a seeded random.Random in the coverage test) and gives
# (text, fn), or None where it does not apply to that shape.

Choose = Callable[[Sequence], object]
Step = tuple[str, Callable[[torch.Tensor], torch.Tensor]]


def _dim(choose: Choose, n: int) -> int:
    """A dim of an n-dim tensor, written positive or negative."""
    d = choose(range(n))
    return choose([d, d - n])


def _factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _regroup(choose: Choose, sizes: Sequence[int]) -> list[int]:
    """A shape of the same numel: the prime factors of the sizes, in order, cut into
    consecutive groups (merging dims, splitting them, or both across a boundary), with
    size-1 dims put in here and there."""
    out = [1]
    for f in [f for s in sizes for f in _factors(s)]:
        if out[-1] != 1 and choose([False, True]):
            out.append(1)
        out[-1] *= f
    for _ in range(choose([0, 0, 1])):
        out.insert(choose(range(len(out) + 1)), 1)
    return out


def _with_minus_one(choose: Choose, shape: list[int]) -> list[int]:
    shape = list(shape)
    shape[choose(range(len(shape)))] = -1
    return shape


def _flatten(c: Choose, s):
    if not s:
        return None
    a = c(range(len(s)))
    b = c(range(a, len(s)))
    a, b = c([(a, b), (a, b - len(s))])
    return f"x.flatten({a}, {b})", lambda x: x.flatten(a, b)


def _unflatten(c: Choose, s):
    if not s:
        return None
    d = _dim(c, len(s))
    sizes = _regroup(c, [s[d]])
    if len(sizes) == 1:
        sizes = c([[1, sizes[0]], [sizes[0], 1]])
    sizes = c([sizes, _with_minus_one(c, sizes)])
    return f"x.unflatten({d}, {tuple(sizes)})", lambda x: x.unflatten(d, sizes)


def _view(c: Choose, s):
    shape = _with_minus_one(c, _regroup(c, s))
    return f"x.view({shape})", lambda x: x.view(shape)


def _reshape(c: Choose, s):
    shape = _regroup(c, s)
    shape = c([shape, _with_minus_one(c, shape)])
    return f"x.reshape({shape})", lambda x: x.reshape(shape)


def _squeeze(c: Choose, s):
    return "x.squeeze()", lambda x: x.squeeze()


def _squeeze_dim(c: Choose, s):
    if not s:
        return None
    d = _dim(c, len(s))
    return f"x.squeeze({d})", lambda x: x.squeeze(d)


def _squeeze_dims(c: Choose, s):
    if len(s) < 2:
        return None
    a = c(range(len(s)))
    b = c([d for d in range(len(s)) if d != a])
    dims = (a, c([b, b - len(s)]))
    return f"x.squeeze({dims})", lambda x: x.squeeze(dims)


def _unsqueeze(c: Choose, s):
    d = c(range(-len(s) - 1, len(s) + 1))
    return f"x.unsqueeze({d})", lambda x: x.unsqueeze(d)


def _permute(c: Choose, s):
    if not s:
        return None
    order = list(range(len(s)))
    random.Random(c(range(1000))).shuffle(order)
    order = [c([d, d - len(s)]) for d in order]
    return f"x.permute({order})", lambda x: x.permute(order)


def _transpose(c: Choose, s):
    if len(s) < 2:
        return None
    a, b = c([(-1, -2), (_dim(c, len(s)), _dim(c, len(s)))])
    return f"x.transpose({a}, {b})", lambda x: x.transpose(a, b)


def _t(c: Choose, s):
    if len(s) > 2:
        return None
    return "x.t()", lambda x: x.t()


def _expand(c: Choose, s):
    lead = c([[], [2], [3]] if 1 in s else [[2], [3]])  # expand a size-1 dim or a new one
    sizes = lead + [c([2, 3, 4]) if n == 1 else c([-1, n]) for n in s]
    return f"x.expand({sizes})", lambda x: x.expand(sizes)


def _movedim(c: Choose, s):
    if not s:
        return None
    if len(s) >= 2 and c([False, True]):
        src = [c(range(len(s)))]
        src.append(c([d for d in range(len(s)) if d != src[0]]))
        dst = [c(range(len(s)))]
        dst.append(c([d for d in range(len(s)) if d != dst[0]]))
        src, dst = tuple(src), tuple(dst)
    else:
        src, dst = _dim(c, len(s)), _dim(c, len(s))
    return f"x.movedim({src}, {dst})", lambda x: x.movedim(src, dst)


def _split(c: Choose, s):
    if not s:
        return None
    d = _dim(c, len(s))
    k = c(range(1, s[d] + 1))
    i = c(range(math.ceil(s[d] / k)))
    return f"x.split({k}, {d})[{i}]", lambda x: x.split(k, d)[i]


def _split_sizes(c: Choose, s):
    if not s:
        return None
    d = _dim(c, len(s))
    sizes = [1]
    for _ in range(s[d] - 1):
        sizes[-1:] = c([[sizes[-1] + 1], [sizes[-1], 1]])
    i = c(range(len(sizes)))
    return f"x.split({sizes}, {d})[{i}]", lambda x: x.split(sizes, d)[i]


def _chunk(c: Choose, s):
    if not s:
        return None
    d = _dim(c, len(s))
    n = c(range(1, s[d] + 1))
    i = c(range(len(torch.empty(s).chunk(n, d))))
    return f"x.chunk({n}, {d})[{i}]", lambda x: x.chunk(n, d)[i]


def _slice(c: Choose, s):
    dims = [d for d in range(1, len(s)) if s[d] > 1]  # x[:, 1:], x[:, :, 2:], ...
    if not dims:
        return None
    d = c(dims)
    start = c(range(1, s[d]))
    index = (slice(None),) * d + (slice(start, None),)
    return f"x[{':, ' * d}{start}:]", lambda x: x[index]


def _select(c: Choose, s):
    if not s:
        return None
    d = _dim(c, len(s))
    i = c(range(-s[d], s[d]))
    return f"x.select({d}, {i})", lambda x: x.select(d, i)


def _narrow(c: Choose, s):
    dims = [d for d in range(len(s)) if s[d] > 1]
    if not dims:
        return None
    d = c(dims)
    start = c(range(0, s[d] - 1))
    length = c(range(1, s[d] - start + 1))
    return f"x.narrow({d}, {start}, {length})", lambda x: x.narrow(d, start, length)


def _unbind(c: Choose, s):
    if not s:
        return None
    d = _dim(c, len(s))
    i = c(range(s[d]))
    return f"x.unbind({d})[{i}]", lambda x: x.unbind(d)[i]


def _swapaxes(c: Choose, s):
    if len(s) < 2:
        return None
    a, b, name = _dim(c, len(s)), _dim(c, len(s)), c(["swapaxes", "swapdims"])
    return f"x.{name}({a}, {b})", lambda x: getattr(x, name)(a, b)


def _mT(c: Choose, s):
    if len(s) < 2:
        return None
    name = c(["mT", "adjoint()"])
    return f"x.{name}", lambda x: x.mT if name == "mT" else x.adjoint()


def _repeat(c: Choose, s):
    sizes = c([[], [], [2]]) + [c([1, 1, 2]) for _ in s]
    return f"x.repeat({sizes})", lambda x: x.repeat(sizes)


def _cat(c: Choose, s):
    if not s:
        return None
    d = _dim(c, len(s))
    return f"torch.cat((x, x), {d})", lambda x: torch.cat((x, x), d)


# views no torch method records (the aten ops other passes' decompositions leave behind)
def _unsafe_view(c: Choose, s):
    shape = _regroup(c, s)
    return f"aten._unsafe_view(x, {shape})", lambda x: aten._unsafe_view(x, shape)


def _view_copy(c: Choose, s):
    shape = _regroup(c, s)
    return f"aten.view_copy(x, {shape})", lambda x: aten.view_copy(x, shape)


def _alias(c: Choose, s):
    return "aten.alias(x)", lambda x: aten.alias(x)


FORMS = {f.__name__[1:]: f for f in (
    _flatten, _unflatten, _view, _reshape, _squeeze, _squeeze_dim, _squeeze_dims, _unsqueeze,
    _permute, _transpose, _t, _expand, _movedim, _split, _split_sizes, _chunk, _slice, _select,
    _repeat, _cat, _unsafe_view, _view_copy, _alias, _narrow, _unbind, _swapaxes, _mT)}


def apply_step(form: str, choose: Choose, x: torch.Tensor) -> tuple[Step, torch.Tensor] | None:
    """The step `form` draws for x and its result, or None where it does not apply or
    makes too big a tensor. A view that x's strides do not allow (after an expand or a
    permute) is drawn again as a reshape, as a user would write it."""
    step = FORMS[form](choose, list(x.shape))
    if step is None:
        return None
    try:
        y = step[1](x)
    except RuntimeError:
        if form not in ("view", "unsafe_view") or x.is_contiguous():
            raise
        return apply_step("reshape", choose, x)
    if y.numel() > MAX_NUMEL or y.dim() > MAX_DIMS:
        return None
    return step, y


class Chain(torch.nn.Module):
    def __init__(self, steps: Sequence[Step]):
        super().__init__()
        self.steps = list(steps)

    def forward(self, x):
        for _, fn in self.steps:
            x = fn(x)
        return x


def export_chain(steps: Sequence[Step], x: torch.Tensor) -> fx.Graph:
    return torch.export.export(Chain(steps), (x,), strict=False).graph


# -- the check: one op, one strategy, every rank ----------------------------------------------

def part(t: torch.Tensor, p, r: int) -> torch.Tensor:
    """Rank r's block of t when split on dim p (in pieces: its block of each piece, as the
    runtime cuts a parameter); t itself when replicated or a partial sum's cotangent."""
    if isinstance(p, Strided):
        return tp_block(t, p.dim, p.pieces, r, TP)
    return torch.tensor_split(t, TP, p)[r] if isinstance(p, int) else t


def run_op(node: fx.Node, tensors: Sequence[torch.Tensor], s: Strategy | None = None) -> tuple:
    """node's op on `tensors` in place of its tensor arguments; with a strategy, on local
    blocks, its size arguments rewritten as the TensorParallel hook does."""
    flat, spec = tree_flatten((node.args, node.kwargs))
    values = iter(tensors)
    flat = [next(values) if is_tensor_node(a) else a for a in flat]
    args, kwargs = tree_unflatten(flat, spec)
    if s is not None:
        args = local_view_args(node, args, s.output, TP)
        args = local_split_args(node, args, s.inputs[0], TP)
    out = node.target(*args, **kwargs)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check_strategy(node: fx.Node, s: Strategy, where: str) -> None:
    """Each rank's op on its parts gives its part of the global output, and its VJP the
    part of the global VJP."""
    gen = torch.Generator().manual_seed(0)
    shapes = [a.meta["val"].shape for a in tp_rules.tensor_inputs(node)]
    xs = [torch.randn(sh, dtype=torch.float64, generator=gen).requires_grad_() for sh in shapes]
    outs = run_op(node, xs)
    cots = [torch.randn(o.shape, dtype=torch.float64, generator=gen) for o in outs]
    grads = _vjp(outs, xs, cots)
    # a partial-sum input: rank 0 holds x - noise, rank 1 the noise
    noise = [torch.randn(sh, dtype=torch.float64, generator=gen) for sh in shapes]
    summed_outs = [torch.zeros_like(o) for o in outs]
    summed_grads = [torch.zeros_like(g) for g in grads]
    for r in range(TP):
        ins = [(x.detach() - n if r == 0 else n) if p == P else part(x.detach(), p, r)
               for x, n, p in zip(xs, noise, s.inputs)]
        ins = [t.contiguous().requires_grad_() for t in ins]
        local = run_op(node, ins, s)
        assert len(local) == len(outs), where
        for k, (lo, o, p) in enumerate(zip(local, outs, s.outputs())):
            if p == P:
                summed_outs[k] += lo.detach()
            else:
                assert lo.shape == part(o, p, r).shape and torch.equal(lo, part(o, p, r)), \
                    f"{where}: rank {r} output {k}"
        local_cots = [part(c, p, r) for c, p in zip(cots, s.outputs())]
        for k, (lg, g, p) in enumerate(zip(_vjp(local, ins, local_cots), grads, s.inputs)):
            if p == R:  # a replicated input of split work: its gradient is a partial sum
                summed_grads[k] += lg
            else:  # a split input: its block's; a partial sum's term: the whole gradient
                # (close, not equal: the VJP of expand or repeat sums in another order)
                torch.testing.assert_close(lg, part(g, p, r),
                                           msg=lambda m: f"{where}: rank {r} gradient {k}: {m}")
    for k, p in enumerate(s.outputs()):
        if p == P:
            torch.testing.assert_close(summed_outs[k], outs[k].detach(),
                                       msg=lambda m: f"{where}: partial sums: {m}")
    for k, p in enumerate(s.inputs):
        if p == R:
            torch.testing.assert_close(summed_grads[k], grads[k],
                                       msg=lambda m: f"{where}: gradient sum: {m}")


def _vjp(outs, xs, cots) -> list[torch.Tensor]:
    grads = torch.autograd.grad(outs, xs, cots, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads)]


def check_graph(graph: fx.Graph, text: str) -> dict:
    """Every non-replicated strategy of every op with a rule; op -> strategies checked."""
    checked: dict = {}
    demand = tp_rules.strided_demand(graph, TP)  # each split's pieces, back through views
    for node in graph.nodes:
        if node.op != "call_function" or tp_rules._rule_for(node.target) is None:
            continue
        checked.setdefault(node.target, 0)
        for s in strategies(node, TP, demand.get(node.name, ())):
            if all(p == R for p in s.inputs) or s.lowering:
                continue
            shapes = [list(a.meta["val"].shape) for a in tp_rules.tensor_inputs(node)]
            where = (f"{node.target}{tuple(node.args[1:])} on {shapes}, "
                     f"strategy {s.describe()}, in chain {text}")
            check_strategy(node, s, where)
            checked[node.target] += 1
    return checked


# -- the property ------------------------------------------------------------------------------

SIZES = [1, 2, 3, 4, 6]


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), shape=st.lists(st.sampled_from(SIZES), min_size=1, max_size=4),
       length=st.integers(1, 4))
def test_random_view_chains_run_on_local_blocks(data, shape, length):
    def choose(options):
        return data.draw(st.sampled_from(list(options)))

    x = torch.randn(shape)
    steps: list[Step] = []
    while len(steps) < length:
        made = apply_step(choose(list(FORMS)), choose, x)
        if made is not None:
            steps.append(made[0])
            x = made[1]
    text = f"x = torch.randn({shape}); " + "; ".join(t for t, _ in steps)
    check_graph(export_chain(steps, torch.randn(shape)), text)


# -- coverage: one example per op form ---------------------------------------------------------

# on x of shape COVERAGE_SHAPE: a size-1 dim, dims that divide by tp and one that does not
COVERAGE_SHAPE = [4, 1, 6, 3]
EXAMPLES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "x.flatten(0, 1)": lambda x: x.flatten(0, 1),
    "x.flatten(-2)": lambda x: x.flatten(-2),
    "x.unflatten(2, (2, -1))": lambda x: x.unflatten(2, (2, -1)),
    "x.view(-1, 3)": lambda x: x.view(-1, 3),
    "x.view(2, 2, 18)": lambda x: x.view(2, 2, 18),
    "x.reshape(4, 18)": lambda x: x.reshape(4, 18),
    "x.squeeze()": lambda x: x.squeeze(),
    "x.squeeze(1)": lambda x: x.squeeze(1),
    "x.squeeze((1, -1))": lambda x: x.squeeze((1, -1)),
    "x.unsqueeze(-1)": lambda x: x.unsqueeze(-1),
    "x.permute(2, 0, 3, 1)": lambda x: x.permute(2, 0, 3, 1),
    "x.transpose(-1, -2)": lambda x: x.transpose(-1, -2),
    "x[:, 0, :, 0].t()": lambda x: x[:, 0, :, 0].t(),
    "x.expand(-1, 4, -1, -1)": lambda x: x.expand(-1, 4, -1, -1),
    "x.expand(2, 4, 1, 6, 3)": lambda x: x.expand(2, 4, 1, 6, 3),
    "x.movedim(0, 2)": lambda x: x.movedim(0, 2),
    "x.movedim((0, 2), (3, 0))": lambda x: x.movedim((0, 2), (3, 0)),
    "x.split(2, -1)[0]": lambda x: x.split(2, -1)[0],
    "x.split([1, 2], 3)[1]": lambda x: x.split([1, 2], 3)[1],
    "x.chunk(3, 2)[2]": lambda x: x.chunk(3, 2)[2],
    "x[:, :, 1:]": lambda x: x[:, :, 1:],
    "x.select(2, -1)": lambda x: x.select(2, -1),
    "x[1]": lambda x: x[1],
    "x.repeat(1, 2, 1, 1)": lambda x: x.repeat(1, 2, 1, 1),
    "torch.cat((x, x), 3)": lambda x: torch.cat((x, x), 3),
    # the aten views no torch method records (decompositions and other passes leave them)
    "aten._unsafe_view(x, [4, 18])": lambda x: aten._unsafe_view(x, [4, 18]),
    "aten.view_copy(x, [24, 3])": lambda x: aten.view_copy(x, [24, 3]),
    "aten.alias(x)": lambda x: aten.alias(x),
    "x.narrow(2, 1, 4)": lambda x: x.narrow(2, 1, 4),
    "x.unbind(1)[0]": lambda x: x.unbind(1)[0],
    "x.swapaxes(0, 2)": lambda x: x.swapaxes(0, 2),
    "x.swapdims(-1, 0)": lambda x: x.swapdims(-1, 0),
    "x.mT": lambda x: x.mT,
    "x.adjoint()": lambda x: x.adjoint(),
}


@pytest.mark.parametrize("text", list(EXAMPLES))
def test_example_has_a_split_strategy_that_holds(text):
    graph = export_chain([(text, EXAMPLES[text])], torch.randn(COVERAGE_SHAPE))
    checked = check_graph(graph, text)
    assert checked and all(checked.values()), f"{text}: no split strategy in {checked}"


def test_examples_and_random_forms_reach_every_view_and_slicing_op():
    def ops(step: Step, shape: list[int]) -> set:
        graph = export_chain([step], torch.randn(shape))
        return {n.target for n in graph.nodes if n.op == "call_function"}

    missing = COVERED_OPS - set().union(*(ops(s, COVERAGE_SHAPE) for s in EXAMPLES.items()))
    assert not missing, f"no example exports to {sorted(map(str, missing))}"
    # the property's forms too: a few seeded draws of each, on this shape and on a matrix
    reached = set()
    for form in FORMS:
        for seed, shape in zip(range(4), [COVERAGE_SHAPE, [4, 6]] * 2):
            made = apply_step(form, random.Random(seed).choice, torch.randn(shape))
            reached |= ops(made[0], shape) if made is not None else set()
    missing = COVERED_OPS - reached
    assert not missing, f"no random form exports to {sorted(map(str, missing))}"


# -- a rule that fails -------------------------------------------------------------------------

def test_failing_rule_names_the_op_and_the_users_line(monkeypatch):
    def broken(node, tp):
        raise KeyError("no such dim")

    monkeypatch.setitem(tp_rules._RULES, aten.view.default, broken)
    graph = export_chain([("x.view(-1)", lambda x: x.view(-1))], torch.randn(4, 6))
    node = next(n for n in graph.nodes if n.target == aten.view.default)
    with pytest.raises(ShardingRuleError) as info:
        strategies(node, TP)
    message = str(info.value)
    assert "aten.view.default" in message
    assert re.search(r"test_tp_views\.py:\d+", message), message
    assert "Layout(tp=1)" in message and "KeyError" in message and "Tensor[4, 6]" in message


# -- regression: Llama and Qwen2 with the flattened cross-entropy ------------------------------

def flat_cross_entropy(output, ids):
    return F.cross_entropy(output.logits.flatten(0, 1).float(), ids.flatten())


@pytest.mark.parametrize("make", [lambda: llama(batch=4, seq=16),
                                  lambda: hf_tiny("qwen2", batch=4, seq=16)],
                         ids=["llama", "qwen2"])
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_flattened_cross_entropy_plans_on_hf_models(make, amp):
    ex = make()
    tg = autopar.trace(ex.model, ex.batch, flat_cross_entropy)
    out, results = run_passes(tg, autopar.Layout(tp=2, amp=amp))
    assert results[0].name == "tensor_parallel" and results[0].changed
    assert any(isinstance(p, int) for p in out.attrs["tp"]["params"].values())
