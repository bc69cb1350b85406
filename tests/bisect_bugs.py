"""Test-only passes that each inject one bug into a correct program, for autopar.bisect's
tests: each names the node it made wrong, so a test can check bisect names it."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph, new_node_meta
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.defaults import default_passes
from autopar.layout import Layout

aten = torch.ops.aten


def with_bug(layout: Layout, bug: GraphPass) -> list[GraphPass]:
    """The default passes of `layout` with `bug` run right before fusion (or last)."""
    passes = default_passes(layout)
    at = next((k for k, p in enumerate(passes) if p.name == "fuse_regions"), len(passes))
    return passes[:at] + [bug] + passes[at:]


class _Bug(GraphPass):
    requires = frozenset({"traced"})
    made: str | None = None  # the node the bug made wrong (set by run)

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        tg = tg.copy()
        made = self.inject(tg.graph, ctx)
        type(self).made = made.name
        tg.gm.recompile()
        return tg, PassResult(self.name, changed=True, stats={"node": made.name})

    def inject(self, graph: fx.Graph, ctx: PassContext) -> fx.Node:
        raise NotImplementedError


class ScaleOneGradient(_Bug):
    """One parameter's gradient times 1.0001, before it is synchronised."""

    name = "scale_one_gradient"

    def inject(self, graph, ctx):
        grad = next(n for n in graph.nodes if n.meta.get(M.GRAD_OF) and n.op == "call_function"
                    and n.meta[M.VAL].dim() == 2)
        with graph.inserting_after(grad):
            scaled = graph.call_function(aten.mul.Tensor, (grad, 1.0001))
        scaled.meta = new_node_meta(grad.meta[M.VAL], M.Role.BACKWARD, self.name,
                                    grad.meta.get(M.MODULE_PATH))
        grad.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        return scaled


class DropOneAllReduce(_Bug):
    """The first gradient bucket's all-reduce left out: its users read the local sum."""

    name = "drop_one_allreduce"

    def inject(self, graph, ctx):
        reduce = next(n for n in graph.nodes if "all_reduce" in str(n.target)
                      and n.meta.get(M.COMM_KIND) == "grad_bucket")
        wait = next(iter(reduce.users))
        users = list(wait.users)
        wait.replace_all_uses_with(reduce.args[0])
        graph.erase_node(wait)
        graph.erase_node(reduce)
        return users[0]


class WrongShardOffset(_Bug):
    """Tensor-parallel rank 0 reads its block of one split weight one row off (rolled)."""

    name = "wrong_shard_offset"

    def inject(self, graph, ctx):
        weight = next(n for n in graph.nodes if n.op == "placeholder" and "mlp" in n.name
                      and n.name.endswith("weight") and n.meta[M.VAL].dim() == 2)
        if ctx.options.tp_rank != 0:
            return weight
        with graph.inserting_after(weight):
            rolled = graph.call_function(aten.roll.default, (weight, [1], [0]))
        rolled.meta = new_node_meta(weight.meta[M.VAL], M.Role.FORWARD, self.name)
        weight.replace_all_uses_with(rolled, delete_user_cb=lambda user: user is not rolled)
        return rolled


class StaleRecomputeInput(_Bug):
    """A recomputed copy reads the value of the same op one layer earlier instead of its
    own input's recomputed copy."""

    name = "stale_recompute_input"

    def inject(self, graph, ctx):
        nodes = list(graph.nodes)
        for copy in nodes:
            original = copy.meta.get(M.RECOMPUTED)
            layer = copy.meta.get(M.LAYER)
            if not original or not layer:
                continue
            for arg in copy.all_input_nodes:
                if not arg.meta.get(M.RECOMPUTED):
                    continue
                stale = next((n for n in nodes if n.op == "call_function"
                              and n.meta.get(M.LAYER) == layer - 1
                              and not n.meta.get(M.RECOMPUTED) and n.target == arg.target
                              and n.meta[M.VAL].shape == arg.meta[M.VAL].shape), None)
                if stale is not None:
                    copy.replace_input_with(arg, stale)
                    return copy
        raise AssertionError("no recomputed copy reads another copy")
