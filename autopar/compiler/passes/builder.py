"""NodeBuilder: how passes insert nodes with the metadata the verifier requires."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import node_bytes, node_flops
from autopar.compiler.ir.graph import new_node_meta

# what a node inserted in place of another takes from it: where in the model it is
# (module, block, source line), for the cost model's per-block sums and for errors
_PLACE = (M.MODULE_PATH, M.MODULE_TYPE, M.LAYER, M.SOURCE, "nn_module_stack", "stack_trace")


class NodeBuilder:
    """Inserts nodes one after another from a cursor, with complete metadata; each
    node's value is computed by running the op on its inputs' fake values.

    After `.like(node)`, the nodes inserted take `node`'s place in the model (module,
    block, source line) and carry their own FLOPs and bytes: ops that replace part of
    the model's computation, which the cost model prices as it priced the part. Without
    it they are the parallel program's own (collectives, scalings), priced by role."""

    def __init__(self, graph: fx.Graph, created_by: str):
        self.graph = graph
        self.created_by = created_by
        self.cursor: fx.Node | None = None
        self.model_node: fx.Node | None = None

    def at(self, node: fx.Node) -> NodeBuilder:
        """Insert the next nodes right after `node`."""
        self.cursor = node
        return self

    def like(self, node: fx.Node | None) -> NodeBuilder:
        """The next nodes stand for part of `node` (None: for no node of the model)."""
        self.model_node = node
        return self

    def call(self, op, args: tuple, role: M.Role = M.Role.COMM, kwargs: dict | None = None,
             **extra) -> fx.Node:
        kwargs = kwargs or {}
        vals, kvals = fx.node.map_arg((args, kwargs), lambda n: n.meta[M.VAL])
        name = getattr(op, "__name__", "op").split(".")[0]  # "all_reduce", not "..._default"
        with self.graph.inserting_after(self.cursor):
            node = self.graph.create_node("call_function", op, args, kwargs, name=name)
        node.meta = new_node_meta(op(*vals, **kvals), role, self.created_by, **extra)
        if self.model_node is not None:
            node.meta.update({key: self.model_node.meta[key] for key in _PLACE
                              if key in self.model_node.meta})
            node.meta[M.FLOPS] = node_flops(node)
            node.meta[M.BYTES] = node_bytes(node)
        self.cursor = node
        return node

    def cast(self, x: fx.Node, dtype: torch.dtype, role: M.Role) -> fx.Node:
        """`x` in `dtype`: `x` itself when it already is."""
        if x.meta[M.VAL].dtype == dtype:
            return x
        return self.call(torch.ops.aten._to_copy.default, (x,), role, kwargs={"dtype": dtype})


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
