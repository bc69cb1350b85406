"""NodeBuilder: how passes insert nodes with the metadata the verifier requires."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import new_node_meta


class NodeBuilder:
    """Inserts nodes one after another from a cursor, with complete metadata; each
    node's value is computed by running the op on its inputs' fake values."""

    def __init__(self, graph: fx.Graph, created_by: str):
        self.graph = graph
        self.created_by = created_by
        self.cursor: fx.Node | None = None

    def at(self, node: fx.Node) -> NodeBuilder:
        """Insert the next nodes right after `node`."""
        self.cursor = node
        return self

    def call(self, op, args: tuple, role: M.Role = M.Role.COMM, **extra) -> fx.Node:
        vals = fx.node.map_arg(args, lambda n: n.meta[M.VAL])
        name = getattr(op, "__name__", "op").split(".")[0]  # "all_reduce", not "..._default"
        with self.graph.inserting_after(self.cursor):
            node = self.graph.create_node("call_function", op, args, name=name)
        node.meta = new_node_meta(op(*vals), role, self.created_by, **extra)
        self.cursor = node
        return node


def scale_backward_seed(tg, build: NodeBuilder, divisor: int) -> bool:
    """Start the backward pass from d(loss)/divisor instead of d(loss): by linearity every
    gradient comes out divided (averaging over data-parallel ranks or micro-batches
    without a pass over the gradients). False if the graph has no `ones_like(loss)` seed."""
    seeds = [u for u in tg.loss_node().users if u.target == torch.ops.aten.ones_like.default]
    if len(seeds) != 1:
        return False
    seed = seeds[0]
    scaled = build.at(seed).call(torch.ops.aten.div.Tensor, (seed, divisor), role=M.Role.BACKWARD)
    seed.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    return True
