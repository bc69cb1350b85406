"""Split a traced step into a parameter-server trainer program and its tables.

Over the joint FX graph, by rules per aten op (no module names):

- a **table** is a parameter every use of which is the weight of an embedding lookup
  (`LOOKUPS`); `tables=None` takes every such parameter, or the user names them;
- each distinct index tensor a table is looked up with gets one `autopar::ps_pull`
  right after it is computed: the lookups read the pulled rows at local indices, so the
  trainer holds the batch's rows and never the table;
- the table's gradient output is a sum (`aten.add`) of backward ops (`GRADS`); each
  backward op is re-pointed at its pull's local indices and row count, and the step
  returns, per pull, the gradient of its rows and their ids, which the trainer pushes.

Anything else that reads a table (a tied output projection, a weight-decay term, a
cast) is refused with the op and the user's source line: the servers would be the only
holders of the table, so nothing on a trainer may read it whole.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TensorSpec, TrainGraph
from autopar.compiler.ir.program import TensorEntry
from autopar.compiler.ir.ps_ops import PS_PULL
from autopar.compiler.ir.ps_program import PSProgram, Pull, TableSpec

aten = torch.ops.aten


class PSSplitError(ValueError):
    """A step that cannot be split into a trainer and server program; the message
    names the table, the op and the user's line."""


@dataclass(frozen=True)
class _Rule:
    """Argument positions of one embedding op: the table's (weight), the ids',
    the row count's (backward ops), and the padding index's with its default."""

    weight: int | None
    indices: int
    num_weights: int | None = None
    padding: int | None = None
    padding_default: int = -1


# forward lookups: weight[indices] in some form
LOOKUPS = {
    aten.embedding.default: _Rule(weight=0, indices=1, padding=2),
    aten._embedding_bag.default: _Rule(weight=0, indices=1, padding=8),
    aten._embedding_bag_forward_only.default: _Rule(weight=0, indices=1, padding=8),
}
# backward ops whose output is (part of) the table's gradient, or that read the table
# for another input's gradient (per-sample weights)
GRADS = {
    aten.embedding_dense_backward.default: _Rule(weight=None, indices=1, num_weights=2,
                                                 padding=3),
    aten._embedding_bag_backward.default: _Rule(weight=None, indices=1, num_weights=6,
                                                padding=11),
    aten._embedding_bag_dense_backward.default: _Rule(weight=None, indices=1,
                                                      num_weights=5, padding=9),
}
READS_TABLE = {
    aten._embedding_bag_per_sample_weights_backward.default: _Rule(weight=1, indices=2,
                                                                   padding=6),
}


def _where(node: fx.Node) -> str:
    path = node.meta.get(M.MODULE_PATH) or "the model"
    source = node.meta.get(M.SOURCE)
    return f"{path}" + (f" ({source})" if source else "")


def _arg(node: fx.Node, pos: int | None, default=None):
    if pos is None:
        return default
    return node.args[pos] if pos < len(node.args) else default


def _set_arg(node: fx.Node, pos: int, value) -> None:
    args = list(node.args)
    while len(args) <= pos:  # fill defaults up to pos from the schema
        args.append(node.target._schema.arguments[len(args)].default_value)
    args[pos] = value
    node.args = tuple(args)


def table_candidates(tg: TrainGraph) -> list[str]:
    """Parameters read only as the weight of embedding lookups, in parameter order."""
    out = []
    for spec, ph in zip(tg.signature.params, tg.placeholders()):
        users = list(ph.users)
        if any(u.target in LOOKUPS for u in users) and all(_reads_as_table(u, ph) for u in users):
            out.append(spec.name)
    return out


def _reads_as_table(user: fx.Node, ph: fx.Node) -> bool:
    """`user` reads `ph` as an embedding table: a lookup's weight, or the weight the
    per-sample-weights gradient of a bag lookup reads."""
    if user.target in LOOKUPS:
        return user.args[0] is ph
    rule = READS_TABLE.get(user.target)
    return rule is not None and user.args[rule.weight] is ph


def split_for_ps(tg: TrainGraph, tables: Sequence[str] | None = None) -> PSProgram:
    """The trainer program of `tg` with `tables` (default: `table_candidates`) held
    by the servers. `tg` is left as it was."""
    sig = tg.signature
    names = sig.param_names()
    if sig.grad_blocks or sig.param_blocks:
        raise PSSplitError("parameter-server tables cannot be combined with ZeRO blocks")
    if tables is None:
        found = table_candidates(tg)
        if not found:
            raise PSSplitError(
                "Layout(ps=...) holds embedding tables on parameter servers, but this "
                "model has no parameter that is read only by embedding lookups "
                "(nn.Embedding / nn.EmbeddingBag or F.embedding / F.embedding_bag). "
                "Parameter-server training is for models whose large sparse tables are "
                "mostly untouched in a batch; train a dense model with a dp layout")
        tables = found
    for name in tables:
        if name not in names:
            raise PSSplitError(f"PS table {name!r} is not a parameter of the model; its "
                               f"parameters are {names}")
    tg = tg.copy()
    graph = tg.graph
    placeholders = tg.placeholders()
    outputs = tg.outputs()
    table_specs: list[TableSpec] = []
    pulls: list[Pull] = []
    pull_outputs: list[tuple[fx.Node, fx.Node]] = []
    pull_nodes: list[fx.Node] = []
    table_index = {name: i for i, name in enumerate(tables)}
    for name in tables:
        p = names.index(name)
        ph = placeholders[p]
        spec = sig.params[p]
        if len(spec.shape) != 2:
            raise PSSplitError(f"PS table {name!r} has shape {spec.shape}; a table is a "
                               f"2-D [rows, dim] embedding weight")
        lookups, readers = [], []
        for user in ph.users:
            if user.target in LOOKUPS and user.args[0] is ph:
                lookups.append(user)
            elif user.target in READS_TABLE and user.args[READS_TABLE[user.target].weight] is ph:
                readers.append(user)
            else:
                raise PSSplitError(
                    f"PS table {name!r} is read by {user.target} at {_where(user)}, not only "
                    f"by embedding lookups; the servers hold the table, so a trainer cannot "
                    f"read it whole (untie it, or leave it out of Layout.ps.tables)")
        if not lookups:
            raise PSSplitError(f"PS table {name!r} is never looked up by an embedding op")
        pads = {_arg(u, LOOKUPS[u.target].padding, -1) for u in lookups}
        if len(pads) > 1:
            raise PSSplitError(f"PS table {name!r} is looked up with different padding "
                               f"indices {sorted(pads)}; one table has one padding row")
        pad = pads.pop()
        pad = -1 if pad is None or pad < 0 else pad
        table = TableSpec(name, spec.shape[0], spec.shape[1], spec.dtype, pad, spec.aliases)
        table_specs.append(table)
        t = table_index[name]
        # one pull per distinct id tensor: index tensors that are views of one tensor
        # (each EmbeddingBag call flattens its ids anew) share it
        pull_of: dict[fx.Node, _PullNodes] = {}
        local_of: dict[fx.Node, tuple[_PullNodes, fx.Node]] = {}
        for lookup in sorted(lookups, key=_order):
            idx = lookup.args[LOOKUPS[lookup.target].indices]
            if idx in local_of:
                continue
            root = _id_root(idx)
            if root not in pull_of:
                pull_of[root] = _insert_pull(graph, idx, t, table, lookup, pulls)
                local_of[idx] = (pull_of[root], pull_of[root].local)
            else:
                pn = pull_of[root]
                with graph.inserting_before(lookup):
                    local = graph.call_function(aten.reshape.default,
                                                (pn.local_flat, list(idx.meta[M.VAL].shape)))
                local.meta.update(_meta(M.Role.FORWARD))
                local_of[idx] = (pn, local)
        for node in lookups + readers:
            rule = LOOKUPS.get(node.target) or READS_TABLE[node.target]
            idx = node.args[rule.indices]
            if idx not in local_of:
                raise PSSplitError(f"PS table {name!r} is read at {_where(node)} with ids "
                                   f"that none of its lookups takes")
            pn, local = local_of[idx]
            _set_arg(node, rule.weight, pn.rows)
            _set_arg(node, rule.indices, local)
            if pad >= 0:
                _set_arg(node, rule.padding, pn.cap)
        grads_by_idx = _table_grads(outputs[1 + p], name, table, local_of)
        leaves_of: dict[int, list[fx.Node]] = {id(pn): [] for pn in pull_of.values()}
        for idx, (pn, local) in local_of.items():
            for leaf in grads_by_idx.get(idx, []):
                rule = GRADS[leaf.target]
                _set_arg(leaf, rule.indices, local)
                _set_arg(leaf, rule.num_weights, pn.cap + 1)
                if pad >= 0:
                    _set_arg(leaf, rule.padding, pn.cap)
                leaves_of[id(pn)].append(leaf)
        for pn in pull_of.values():
            leaves = sorted(leaves_of[id(pn)], key=_order)
            if not leaves:  # looked up but no gradient flows back: push zero rows
                with graph.inserting_before(pn.rows.next):
                    total = graph.call_function(aten.zeros_like.default, (pn.rows,))
            else:
                total = leaves[0]
                with graph.inserting_before(leaves[-1].next):
                    for leaf in leaves[1:]:
                        total = graph.call_function(aten.add.Tensor, (total, leaf))
            total.meta.update(_meta(M.Role.BACKWARD))
            pull_outputs.append((total, pn.ids))
            pull_nodes.append(pn.pull)
    keep = [i for i, n in enumerate(names) if n not in table_index]
    loss, grads, rest = outputs[0], outputs[1:1 + len(names)], outputs[1 + len(names):]
    new_out = [loss] + [grads[i] for i in keep]
    for grad, ids in pull_outputs:
        new_out += [grad, ids]
    new_out += rest
    out_node = tg.output_node()
    out_node.args = (tuple(new_out),)
    _erase_dead(graph, out_node)
    for name in tables:
        graph.erase_node(placeholders[names.index(name)])
    graph.lint()
    tg.gm.recompile()
    return PSProgram(
        gm=tg.gm,
        dense=tuple(_entry(sig.params[i]) for i in keep),
        buffers=tuple(_entry(b) for b in sig.buffers),
        inputs=tuple(_entry(i) for i in sig.inputs),
        batch_dims=sig.batch_dims,
        mutated_buffers=sig.mutated_buffers,
        tables=tuple(table_specs),
        pulls=tuple(pulls),
        prefetch=_prefetch_module(tg.gm, pull_nodes),
        normalizers=tg.loss_normalizers,
    )


def _prefetch_module(gm: fx.GraphModule, pull_nodes: list[fx.Node]) -> fx.GraphModule:
    """A graph of the same inputs that computes only the ids of every pull (their
    ancestors, usually a slice and a reshape of a batch input): the trainer runs it
    first and asks each server for all of a step's rows in one request."""
    needed: set[fx.Node] = set()
    stack = [n.args[0] for n in pull_nodes]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in needed:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n.args[0]] for n in pull_nodes))
    return fx.GraphModule(gm, graph)


def _entry(spec: TensorSpec) -> TensorEntry:
    return TensorEntry(spec.name, spec.shape, spec.dtype, spec.aliases, spec.shard_dim,
                       spec.shard_pieces)


def _meta(role: M.Role) -> dict:
    return {M.ROLE: role, M.MODULE_PATH: None, M.CREATED_BY: "lower_ps", M.FLOPS: 0,
            M.BYTES: 0}


def _order(node: fx.Node) -> int:
    return list(node.graph.nodes).index(node)


@dataclass
class _PullNodes:
    pull: fx.Node  # the ps_pull
    rows: fx.Node  # [cap + 1, dim]
    local_flat: fx.Node  # [cap]
    local: fx.Node  # local_flat in the shape of the first index tensor
    ids: fx.Node  # [cap]
    cap: int


# ops that keep a tensor's elements in row-major order (and so its flattened ids)
_SAME_ORDER = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
               aten.unsqueeze.default, aten.squeeze.dim, aten.flatten.using_ints}


def _id_root(idx: fx.Node) -> fx.Node:
    while idx.op == "call_function" and idx.target in _SAME_ORDER:
        idx = idx.args[0]
    return idx


def _insert_pull(graph: fx.Graph, idx: fx.Node, t: int, table: TableSpec,
                 lookup: fx.Node, pulls: list) -> _PullNodes:
    val = idx.meta.get(M.VAL)
    if val is None or val.dtype not in (torch.int64, torch.int32):
        raise PSSplitError(f"PS table {table.name!r} is looked up at {_where(lookup)} with "
                           f"ids of unknown shape or dtype {getattr(val, 'dtype', None)}")
    cap = val.numel()
    shape = list(val.shape)
    with graph.inserting_before(idx.next):
        flat = graph.call_function(aten.reshape.default, (idx, [-1]))
        if val.dtype != torch.int64:
            flat = graph.call_function(aten._to_copy.default, (flat,),
                                       {"dtype": torch.int64})
        pull = graph.call_function(PS_PULL, (flat, t, table.dim, table.dtype,
                                             table.padding_idx))
        rows = graph.call_function(operator.getitem, (pull, 0))
        local_flat = graph.call_function(operator.getitem, (pull, 1))
        ids = graph.call_function(operator.getitem, (pull, 2))
        local = graph.call_function(aten.reshape.default, (local_flat, shape))
    for n in (flat, pull, rows, local_flat, ids, local):
        n.meta.update(_meta(M.Role.FORWARD))
        n.meta[M.MODULE_PATH] = lookup.meta.get(M.MODULE_PATH)
        n.meta[M.SOURCE] = lookup.meta.get(M.SOURCE)
    pulls.append(Pull(t, cap, lookup.meta.get(M.SOURCE)))
    return _PullNodes(pull, rows, local_flat, local, ids, cap)


def _table_grads(grad: fx.Node, name: str, table: TableSpec,
                 local_of: dict) -> dict[fx.Node, list[fx.Node]]:
    """The backward ops whose sum is a table's gradient output, by the pull whose ids
    they take."""
    leaves: list[fx.Node] = []
    stack = [grad]
    while stack:
        node = stack.pop()
        if node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2 \
                and all(isinstance(a, fx.Node) for a in node.args):
            stack.extend(node.args)
        elif node.op == "call_function" and node.target in GRADS:
            leaves.append(node)
        else:
            raise PSSplitError(
                f"the gradient of PS table {name!r} is computed by {node.target} at "
                f"{_where(node)}, not by embedding backward ops alone; a table on the "
                f"servers takes only row gradients from its lookups")
    by_idx: dict[fx.Node, list[fx.Node]] = {}
    for leaf in sorted(leaves, key=_order):
        idx = leaf.args[GRADS[leaf.target].indices]
        if idx not in local_of or leaf.args[GRADS[leaf.target].num_weights] != table.rows:
            raise PSSplitError(f"a gradient op of PS table {name!r} at {_where(leaf)} takes "
                               f"ids that none of the table's lookups reads")
        by_idx.setdefault(idx, []).append(leaf)
    return by_idx


def _erase_dead(graph: fx.Graph, out_node: fx.Node) -> None:
    """Erase the `aten.add` nodes that summed a table's gradient and are now unused."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op == "call_function" and not node.users and node is not out_node \
                    and node.target is aten.add.Tensor:
                graph.erase_node(node)
                changed = True
