"""What a recomputation policy copies, and the rewrite that copies it (the recompute
pass, recompute.py, and ZeRO-3's re-gather, shard_parameters.py, both use it).

`choose` picks, per layer, the forward values the backward reads again instead of
keeping them alive: a value another layer reads is kept, and so are random ops and
ops that are not pure aten ops (each named with the reason). `rewrite` inserts, for
each backward node that reads a chosen value, a copy of the value's op (and of the
chosen ops it needs, recursively) right before the first backward node that needs
it; backward nodes then read the copy, so the forward value dies after its last
forward use. The copies are backward nodes (`M.RECOMPUTED` names the original).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import node_bytes
from autopar.compiler.ir.graph import TrainGraph

aten = torch.ops.aten
_FORWARD = (M.Role.FORWARD, M.Role.LOSS)
_CONTRACTIONS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                 aten.convolution.default, aten._scaled_mm.default}


class RecomputeError(ValueError):
    """Recomputation cannot meet what was asked (the message says what would)."""


def layers_of(tg: TrainGraph) -> list[int | None]:
    """The recompute units: each layer of the repeated stack, or None for a model
    without one (then the whole forward is one layer)."""
    layers = sorted({n.meta[M.LAYER] for n in tg.call_nodes()
                     if n.meta.get(M.LAYER) is not None and n.meta[M.ROLE] in _FORWARD})
    return layers or [None]


def _group(node: fx.Node) -> int | None:
    return node.meta.get(M.LAYER)


def choose(tg: TrainGraph, per_layer: dict[int | None, str]) -> tuple[set[fx.Node], dict[str, str]]:
    """The forward nodes to recompute under a policy per layer ("none", "selective",
    "full"), and the values kept although the policy would recompute them, with why."""
    weights = _weight_derived(tg)
    returned = set(tg.outputs())  # alive to the end anyway (the loss)
    chosen, kept = set(), {}
    for node in tg.call_nodes():
        policy = per_layer.get(_group(node), "none")
        if node.meta[M.ROLE] not in _FORWARD or policy == "none" or node in returned:
            continue
        if policy == "selective" and node.target in _CONTRACTIONS and any(
                a in weights for a in node.all_input_nodes):
            continue  # a weight matmul's output: expensive to redo
        if _read_by_another_layer(node):
            continue  # a layer's input or output: the policy keeps it
        why = _why_kept(node, chosen)
        if why is None:
            chosen.add(node)
        elif any(u.meta[M.ROLE] == M.Role.BACKWARD for u in node.users):
            kept[node.name] = why
    return chosen, kept


def _why_kept(node: fx.Node, chosen: set[fx.Node]) -> str | None:
    target = node.target
    if target is not operator.getitem and not isinstance(target, torch._ops.OpOverload):
        return f"{target} is not an aten op"
    if _random(node) and _kept_mask(node) is None:
        return "made by a random op (a dropout mask): recomputing it would draw new numbers"
    if target is operator.getitem and node.args[0] not in chosen and _kept_mask(node) is None:
        # a copy of the getitem would read the kept op's outputs in the backward: they
        # stay alive from the forward all the same (attention with its dropout inside)
        return "an output of a kept op: its copy would keep the op's outputs alive"
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return "it writes its input in place"
    return None


def _random(node: fx.Node) -> bool:
    """A random op, an in-place op on a random op's result (dropout: bernoulli_, div_),
    or an output of native_dropout (taken by getitem: a copy of the getitem would keep
    the op's tuple, output and mask, alive into the backward)."""
    target = node.target
    if target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and node.args[0].target is _DROPOUT
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return True
    return target._schema.is_mutable and any(_random(a) for a in node.all_input_nodes)


_DROPOUT = aten.native_dropout.default
_DROPOUT_BACKWARD = aten.native_dropout_backward.default


def _kept_mask(node: fx.Node) -> fx.Node | None:
    """For the output of a training `native_dropout` (a GPU's dropout: the output and a
    bool mask, traced by ir.trace.GpuKernels), the node of its mask, which is kept: a
    copy of the output is `native_dropout_backward(input, mask, 1 / (1 - p))`, the same
    product (input * mask * scale) without a new draw, so recomputation keeps 1 byte an
    element, not the output. None for any other node (and where the mask is not taken)."""
    if node.target is not operator.getitem or node.args[1] != 0:
        return None
    op = node.args[0]
    if not isinstance(op, fx.Node) or op.target is not _DROPOUT:
        return None
    p, train = (list(op.args) + [op.kwargs.get("p"), op.kwargs.get("train")])[1:3]
    if not train or not 0 < p < 1:
        return None
    return next((u for u in op.users if u.target is operator.getitem and u.args[1] == 1), None)


def _read_by_another_layer(node: fx.Node) -> bool:
    return bool({_group(u) for u in node.users if u.meta.get(M.ROLE) in _FORWARD}
                - {_group(node)})


def _weight_derived(tg: TrainGraph) -> set[fx.Node]:
    """Nodes computed from parameters and buffers alone (a weight, its transpose, its
    half-precision copy)."""
    n_state = len(tg.signature.params) + len(tg.signature.buffers)
    return derived_from(tg, tg.placeholders()[:n_state])


def derived_from(tg: TrainGraph, sources: list[fx.Node]) -> set[fx.Node]:
    """`sources` and the nodes computed from them alone."""
    derived = set(sources)
    for node in tg.call_nodes():
        inputs = node.all_input_nodes
        if inputs and all(a in derived for a in inputs):
            derived.add(node)
    return derived


def rewrite(graph: fx.Graph, chosen: set[fx.Node]) -> int:
    """Make backward nodes read copies of the chosen forward values, each copy made
    right before the first backward node that needs it. Returns the number of copies."""
    copies: dict[fx.Node, fx.Node] = {}

    def materialize(value: fx.Node, before: fx.Node) -> fx.Node:
        if value not in copies:
            target, args, kwargs = value.target, value.args, value.kwargs
            mask = _kept_mask(value)
            if mask is not None:  # a dropout's output: its input times the kept mask
                x, p = value.args[0].args[:2]
                target, args, kwargs = _DROPOUT_BACKWARD, (x, mask, 1.0 / (1.0 - p)), {}
            args, kwargs = fx.node.map_arg(
                (args, kwargs), lambda a: materialize(a, before) if a in chosen else a)
            with graph.inserting_before(before):
                copy = graph.create_node("call_function", target, args, kwargs,
                                         name=f"{value.name}_recomputed")
            copy.meta = dict(value.meta)
            if mask is not None:
                copy.meta[M.BYTES] = node_bytes(copy)
            copy.meta[M.ROLE] = M.Role.BACKWARD
            copy.meta[M.RECOMPUTED] = value.name
            copies[value] = copy
        return copies[value]

    for node in list(graph.nodes):
        if node.op != "call_function" or node.meta.get(M.ROLE) != M.Role.BACKWARD:
            continue
        for arg in node.all_input_nodes:
            if arg in chosen:
                node.replace_input_with(arg, materialize(arg, node))
    return len(copies)
