"""Attention written out op by op, found in an exported graph and replaced by one
`scaled_dot_product_attention`: how a planner costs a GPU cluster that runs it fused.

Transformers' `eager` attention (and any model's hand-written attention) exports as

    scores = matmul(q, kT)                      # b h s s
    scores = scores * c | scores / c            # any number of scalings ...
    scores = scores + mask | where(m, scores, -inf) | masked_fill(scores, m, -inf)
    probs  = softmax(scores, -1)  [.to(dtype)]  # ... masks and casts, in any order
    probs  = dropout(probs, p, train)           # optional (or native_dropout's output 0)
    out    = matmul(probs, v)

A GPU cluster runs that as one fused kernel (FlashAttention, or the memory-efficient
kernel where a mask is arbitrary): it keeps the output and one log-sum-exp per row, not
the b x h x s x s scores, probabilities and dropout mask the decomposition keeps for its
backward. `fuse_eager_attention` rewrites each such chain into

    sdpa(q * t, transpose(kT, -2, -1), v, attn_mask=b, dropout_p=p, scale=a)

where the chain computes a * q kT + b before the softmax (a: the product of its numeric
scalings, t: its tensor ones; b: its masks, each scaled by the scalings after it, a
boolean masking made additive: 0 where kept, -inf where masked). The values are the
eager chain's up to rounding (tests/unit/test_eager_attention.py runs both).

A chain is taken only when nothing else reads its intermediate values (a model that
returns its attention probabilities keeps them, so its decomposition is what it runs),
q, kT and v are 4-d with the same leading dims, and q's head dim is v's (the fused
kernels' constraint). Every other chain is left as it is: `fuse_eager_attention` says
how many it rewrote and, for the softmaxes it could not take, why.
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

_MATMULS = frozenset({aten.matmul.default, aten.bmm.default})
_SOFTMAXES = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
_CASTS = frozenset({aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
                    aten.type_as.default, aten.clone.default, aten.contiguous.default})
_DROPOUT = aten.dropout.default
# dropout as export may record it, (output, mask): the probabilities are its output 0
_NATIVE_DROPOUT = aten.native_dropout.default
_WHERES = frozenset({aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf})
# ops that only check a value's traced metadata: they go with the value they check
_ASSERTS = frozenset({aten._assert_tensor_metadata.default})
# a fill at or below this before a softmax is a masking: exp() of it is 0 in fp32
_MASKING_FILL = -1e4
SDPA = aten.scaled_dot_product_attention.default


@dataclass
class Chain:
    """One attention chain of the graph, from its first matmul to its last."""

    start: fx.Node  # matmul(q, kT)
    end: fx.Node  # matmul(probs, v)
    nodes: list[fx.Node]  # every node of the chain, start to end
    # what the chain does to the scores before the softmax, in order:
    # ("scale", number | node, divide?) or ("mask", node, how) with how "add",
    # "keep_where_true", "fill_where_true"
    steps: list[tuple] = field(default_factory=list)
    dropout: Any = 0.0  # the dropout probability (a number or a node)
    train: Any = True


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target not in _ASSERTS]


def _is_last_dim(dim: Any, node: fx.Node) -> bool:
    val = _val(node)
    return isinstance(dim, int) and val is not None and dim in (-1, val.dim() - 1)


def _masking_fill(value: Any) -> bool:
    """Whether `value` fills masked scores: a number at or below _MASKING_FILL, or a
    0-d tensor (models write torch.finfo(dtype).min as one; a fake value has no number)."""
    if isinstance(value, (int, float)):
        return value <= _MASKING_FILL
    val = _val(value)
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _scalar(value: Any) -> bool:
    """A number, or a tensor of one element (a scale q can take instead of the scores)."""
    val = _val(value)
    return isinstance(value, (int, float)) or (isinstance(val, torch.Tensor) and val.numel() == 1)


def _pre_softmax_step(node: fx.Node, x: fx.Node) -> tuple | None | str:
    """The step `node` applies to the scores `x` before the softmax: a tuple for
    Chain.steps, None for a cast, or why it is not an attention step."""
    t, args = node.target, node.args
    if t in _CASTS:
        return None
    other = args[1] if len(args) > 1 and args[0] is x else args[0]
    if t in (aten.mul.Tensor, aten.div.Tensor) and not _scalar(other):
        return f"{t} by a tensor of more than one element before the softmax"
    if t is aten.mul.Tensor and x in args[:2]:
        return ("scale", other, False)
    if t is aten.div.Tensor and args[0] is x:
        return ("scale", other, True)
    if t is aten.add.Tensor and x in args[:2] and node.kwargs.get("alpha", 1) == 1:
        return ("mask", other, "add")
    if t in _WHERES and args[1] is x and _masking_fill(args[2]):
        return ("mask", args[0], "keep_where_true")
    if t in _WHERES and args[2] is x and _masking_fill(args[1]):
        return ("mask", args[0], "fill_where_true")
    if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and args[0] is x \
            and _masking_fill(args[2]):
        return ("mask", args[1], "fill_where_true")
    return f"{t} before the softmax"


def _chain_from_softmax(softmax: fx.Node) -> Chain | str:
    """The attention chain through `softmax`, or why it is none."""
    if softmax.target not in _SOFTMAXES or not _is_last_dim(softmax.args[1], softmax):
        return "a softmax over a dim other than the last"
    # after the softmax: casts and a dropout, to the matmul with v
    nodes, dropout, train, node = [softmax], 0.0, True, softmax
    while True:
        users = _users(node)
        if len(users) != 1:
            return "its probabilities are read by more than the matmul with v"
        user = users[0]
        if user.target in _MATMULS and user.args[0] is node:
            end = user
            break
        if user.target is _DROPOUT and user.args[0] is node:
            dropout, train = user.args[1], user.args[2] if len(user.args) > 2 else True
        elif user.target is _NATIVE_DROPOUT and user.args[0] is node:
            outputs = {u.args[1]: u for u in _users(user) if u.target is operator.getitem}
            if len(outputs) != len(_users(user)) or 0 not in outputs or \
                    (1 in outputs and _users(outputs[1])):
                return "its dropout's mask is read (native_dropout's second output)"
            train = user.args[2] if len(user.args) > 2 else user.kwargs.get("train")
            dropout, train = user.args[1], True if train is None else train
            nodes.append(user)
            if 1 in outputs:  # the mask, read by nothing: it goes with the chain
                nodes.append(outputs[1])
            user = outputs[0]
        elif user.target not in _CASTS:
            return f"{user.target} after the softmax"
        nodes.append(user)
        node = user
    if not isinstance(dropout, (int, float)) or not isinstance(train, bool):
        return "its dropout probability is not a constant"
    # before it: scalings, masks and casts, back to the matmul of q and kT
    steps, x = [], softmax.args[0]
    before: list[fx.Node] = []
    while not (isinstance(x, fx.Node) and x.target in _MATMULS):
        if not isinstance(x, fx.Node) or len(_users(x)) != 1:
            return "its scores are read by more than the softmax"
        source = _scores_arg(x)
        if source is None:
            return f"{x.target} before the softmax"
        step = _pre_softmax_step(x, source)
        if isinstance(step, str):
            return step
        if step is not None:
            steps.append(step)
        before.append(x)
        x = source
    start = x
    if len(_users(start)) != 1:
        return "its scores are read by more than the softmax"
    chain = Chain(start, end, [start, *reversed(before), *nodes, end], list(reversed(steps)),
                  dropout, train)
    why = _shapes_refused(chain)
    return why if why else chain


def _scores_arg(node: fx.Node) -> fx.Node | None:
    """The argument of `node` that carries the scores (the one computed from the matmul
    of q and kT), or None when not exactly one can."""
    t, args = node.target, node.args
    if t in _WHERES:
        candidates = list(args[1:3])
    elif t in (aten.mul.Tensor, aten.add.Tensor):
        candidates = list(args[:2])
    else:
        candidates = args[:1]
    on = [a for a in candidates if isinstance(a, fx.Node) and _on_chain(a)]
    return on[0] if len(on) == 1 else None


def _on_chain(node: Any) -> bool:
    """Whether `node` can be the scores: computed from a matmul through the ops a chain
    takes (a mask or a scale is not: it does not come from a matmul of 4-d values)."""
    seen = 0
    while isinstance(node, fx.Node) and seen < 64:
        if node.target in _MATMULS:
            return True
        if node.target in _CASTS or node.target in (aten.mul.Tensor, aten.div.Tensor):
            node = node.args[0]
        elif node.target is aten.add.Tensor:
            return _on_chain(node.args[0]) or _on_chain(node.args[1])
        elif node.target in _WHERES:
            return _on_chain(node.args[1]) or _on_chain(node.args[2])
        elif node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            node = node.args[0]
        else:
            return False
        seen += 1
    return False


def _shapes_refused(chain: Chain) -> str | None:
    q, kt = (_val(a) for a in chain.start.args[:2])
    v = _val(chain.end.args[1])
    if not all(isinstance(t, torch.Tensor) for t in (q, kt, v)):
        return "its q, k or v has no traced value"
    if not (q.dim() == kt.dim() == v.dim() == 4):
        return f"q, kT and v are {q.dim()}-, {kt.dim()}- and {v.dim()}-d, not 4-d"
    if q.shape[:2] != kt.shape[:2] or q.shape[:2] != v.shape[:2]:
        return "q, k and v differ in their leading dims (broadcast)"
    if q.shape[-1] != kt.shape[-2] or kt.shape[-1] != v.shape[-2]:
        return "q, kT and v do not chain as q kT v"
    if q.shape[-1] != v.shape[-1]:
        return f"q's head dim {q.shape[-1]} is not v's {v.shape[-1]}"
    return None


def _fake_value(node: fx.Node) -> Any:
    """The value `node` computes, on the fake values of its inputs (what export records
    as "val", which the hooks read of the exported nodes: AMP probes ops on them)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), _val)
    mode = torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves((args, kwargs)))
    if mode is None:
        return None
    with mode:
        return node.target(*args, **kwargs)


@dataclass
class Fused:
    """What `fuse_eager_attention` did: the chains it rewrote, the softmaxes it left."""

    rewritten: int = 0
    left: list[tuple[str, str]] = field(default_factory=list)  # (softmax node, why)


def fuse_eager_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, Fused]:
    """A copy of `gm` (an exported forward graph) with each attention chain replaced by
    one scaled_dot_product_attention (module docstring); `gm` is not changed."""
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, remap)
    graph.output(out)
    order = {node: i for i, node in enumerate(graph.nodes)}
    masks: dict[tuple, tuple[fx.Node, fx.Node]] = {}
    result = Fused()
    for softmax in [n for n in graph.nodes if n.target in _SOFTMAXES]:
        chain = _chain_from_softmax(softmax)
        if isinstance(chain, str):
            result.left.append((softmax.name, chain))
            continue
        _rewrite(graph, chain, masks, order)
        result.rewritten += 1
    graph.lint()
    return fx.GraphModule(gm, graph), result


def _call(graph: fx.Graph, meta: dict, target, args, kwargs=None) -> fx.Node:
    """A new node of `graph` (at its insert point) with `meta`'s module and source."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    node.meta = {k: copy.copy(meta[k]) for k in ("nn_module_stack", "stack_trace",
                                                 "source_fn_stack", "seq_nr") if k in meta}
    node.meta["val"] = _fake_value(node)
    return node


def _mask_steps(steps: list[tuple]) -> tuple:
    """The steps that make the chain's additive mask: from its first mask on (a scaling
    before it scales only the scores). A key: chains with the same steps on the same
    nodes share one mask."""
    first = next((i for i, step in enumerate(steps) if step[0] == "mask"), len(steps))
    return tuple(steps[first:])


def _build_mask(graph: fx.Graph, steps: tuple, dtype: torch.dtype) -> fx.Node | None:
    """The additive mask the chain's `steps` add to its scaled scores. Its nodes take the
    module of the mask they are made from (model-level code, in a transformer: computed
    once per step, as the model computes its mask, not once per layer)."""
    source = next((v for kind, v, _ in steps if kind == "mask" and isinstance(v, fx.Node)), None)
    meta = source.meta if source is not None else {}
    mask = None
    for kind, value, how in steps:
        if kind == "scale":
            if mask is not None:
                mask = _call(graph, meta, aten.div.Tensor if how else aten.mul.Tensor,
                             (mask, value))
            continue
        if how == "add":
            term = value
        else:
            keep, drop = (0.0, -math.inf) if how == "keep_where_true" else (-math.inf, 0.0)
            term = _call(graph, meta, aten.where.Scalar, (value, keep, drop))
        mask = term if mask is None else _call(graph, meta, aten.add.Tensor, (mask, term))
    if mask is not None and _val(mask).dtype not in (dtype, torch.bool):
        # the chain's casts go with it; sdpa takes a float mask in q's dtype
        mask = _call(graph, meta, aten._to_copy.default, (mask,), {"dtype": dtype})
    return mask


def _rewrite(graph: fx.Graph, chain: Chain, masks: dict[tuple, tuple[fx.Node, fx.Node]],
             order: dict[fx.Node, int]) -> None:
    """Replace `chain` by one sdpa. Its mask is the one an earlier chain made from the
    same steps (`masks`: steps -> (mask, the chain end it was made before)) when that
    comes before this chain, else made here and kept."""
    q, kt = chain.start.args[:2]
    v = chain.end.args[1]
    dtype = _val(q).dtype
    key = (_mask_steps(chain.steps), dtype)
    with graph.inserting_before(chain.end):
        scale = 1.0
        for kind, value, how in chain.steps:
            if kind != "scale":
                continue
            if isinstance(value, (int, float)):
                scale = scale / value if how else scale * value
            else:
                q = _call(graph, chain.end.meta, aten.div.Tensor if how else aten.mul.Tensor,
                          (q, value))
        made = masks.get(key)
        if made is not None and order[made[1]] < order[chain.start]:
            mask = made[0]
        else:
            mask = _build_mask(graph, key[0], dtype)
            if mask is not None:
                masks[key] = (mask, chain.end)
        dropout = float(chain.dropout) if chain.train else 0.0
        k = _call(graph, chain.end.meta, aten.transpose.int, (kt, -2, -1))
        sdpa = _call(graph, chain.end.meta, SDPA, (q, k, v),
                     {"attn_mask": mask, "dropout_p": dropout, "is_causal": False,
                      "scale": scale})
    chain.end.replace_all_uses_with(sdpa)
    for node in reversed(chain.nodes):
        for user in list(node.users):
            if user.target in _ASSERTS:
                graph.erase_node(user)
        graph.erase_node(node)


__all__ = ["Chain", "Fused", "SDPA", "fuse_eager_attention"]
