"""Grouped-query attention given its grouped keys and values, as eager runs it.

transformers' attention repeats each key/value head for the query heads that share it
(`repeat_kv`: unsqueeze, expand, reshape) unless it can call

    scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=..., enable_gqa=True)

which it does when the attention has no mask (`use_gqa_in_sdpa`), as a causal model
without padding has when run eagerly. Traced (torch.export) the mask is built, so the
trace takes the repeat; once `causal_mask.recover_causal_masks` has given the mask back
as `is_causal`, the attention is the eager one except for the repeat. The repeated
k and v (query heads x sequence x head dim each, a copy: the reshape of an expanded
value cannot be a view) are what its backward keeps, where eager keeps the grouped ones:
on Llama with 8 query heads and 4 key/value heads, 2 x batch x 4 x s x d values more
per layer.

`group_repeated_kv` gives every attention without a mask whose k and v are both such
a repeat, by the same factor, the repeat's inputs and `enable_gqa=True`.
`enable_gqa` maps query head i to key/value head i // groups, the head a repeat made by
expanding a new dim after the heads puts there, so the function is unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.compiler.ir.causal_mask import SDPA, bound

aten = torch.ops.aten
_RESHAPES = frozenset({aten.reshape.default, aten.view.default, aten._unsafe_view.default})


def group_repeated_kv(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """(`gm` with each unmasked attention's repeated k and v given back grouped, how many
    attentions changed): a copy if any did, `gm` itself if not; `gm` is never changed."""
    found = []
    for node in gm.graph.nodes:
        if node.target is not SDPA:
            continue
        q, k, v, mask, _, _, _, gqa = bound(node)
        if mask is not None or gqa:
            continue
        pair = _repeated(k), _repeated(v)
        if pair[0] and pair[1] and pair[0][1] == pair[1][1]:
            found.append((node, pair[0][0], pair[1][0]))
    if not found:
        return gm, 0
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, remap))
    for node, k_source, v_source in found:
        new = remap[node]
        q, k, v, mask, dropout, causal, scale, _ = bound(new)
        new.args = (q, remap[k_source], remap[v_source])
        new.kwargs = {"attn_mask": None, "dropout_p": dropout, "is_causal": causal,
                      "scale": scale, "enable_gqa": True}
        for repeat in (k, v):
            _erase_if_dead(graph, repeat)
    graph.lint()
    return fx.GraphModule(gm, graph), len(found)


def _repeated(node) -> tuple[fx.Node, int] | None:
    """(x, groups) where `node` is `x` (batch, kv heads, s, d) with each head repeated
    `groups` times in place (reshape(expand(unsqueeze(x, 2), (b, kv, groups, s, d)),
    (b, kv * groups, s, d))), else None."""
    if not (isinstance(node, fx.Node) and node.target in _RESHAPES):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is aten.expand.default
            and len(expand.users) == 1):
        return None
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target is aten.unsqueeze.default
            and unsqueeze.args[1] == 2 and len(unsqueeze.users) == 1):
        return None
    source = unsqueeze.args[0]
    x, out = source.meta.get("val"), node.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.dim() == 4):
        return None
    b, kv, s, d = x.shape
    groups = out.shape[1] // kv if out.dim() == 4 else 0
    if groups < 1 or tuple(out.shape) != (b, kv * groups, s, d):
        return None
    if tuple(expand.meta["val"].shape) != (b, kv, groups, s, d):
        return None
    return source, groups


def _erase_if_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` and the ops feeding only it, up the chain, once nothing uses them."""
    while isinstance(node, fx.Node) and node.op == "call_function" and not node.users:
        parent = node.args[0] if node.args else None
        graph.erase_node(node)
        node = parent
