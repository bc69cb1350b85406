"""ShardParameters: ZeRO-3, parameters held as dim-0 blocks and gathered where used.

Runs after `insert_allreduce` with `Layout.zero=3`, which already reduce-scatters each
such parameter's gradient into this rank's dim-0 block (as for zero=2). This pass
makes the step take that parameter as its block too:

1. the parameter's placeholder becomes its block ([n/dp, ...]);
2. an all-gather rebuilds the whole parameter for its forward uses, and another one
   for its backward uses (weight-gradient and input-gradient matmuls): between the
   two the whole parameter is not held, since the generated code drops a value after
   its last use;
3. a forward view or cast of the parameter that the backward reads (a linear layer's
   transposed weight) is made again in the backward from the parameter, so that it
   does not keep the forward's gathered copy alive;
4. each gather is issued one parameter ahead (right before the previous
   parameter's first use, in the order of first uses) and waited for right before
   its own first use, so it runs while the previous layer computes. NOTE: issuing a
   whole layer's gathers at once (up to 16 in flight) crashed gloo with heap
   corruption ("malloc(): unaligned tcache chunk") in 1 of 3 four-process runs;
   one ahead never did (4 of 4), so gathers stay one parameter ahead.

Parameters whose gradient is all-reduced whole (fewer rows than dp) stay whole
inputs, as `declined` lists. When dp does not divide a parameter's rows, the last
block carries zero padding rows, which the gather drops.

Requires: "dp_grad_sync". Provides: "params_sharded".

Before (dp=2):                                After:
    p_w: f32[64, 32]                              p_w: f32[32, 32]     # this rank's block
    mm = mm(x, t(p_w))        # forward           ag = all_gather_into_tensor(p_w, 2, dp)
    mm_2 = mm(g, p_w)         # backward          w = wait_tensor(ag); mm = mm(x, t(w))
                                                  ag_1 = all_gather_into_tensor(p_w, 2, dp)
                                                  w_1 = wait_tensor(ag_1); mm_2 = mm(g, w_1)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph, new_node_meta
from autopar.compiler.ir.program import block_rows, mesh_group_tag
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.manager import register_pass
from autopar.compiler.passes.recompute_rules import derived_from, rewrite

c10d = torch.ops._c10d_functional


@register_pass
class ShardParameters(GraphPass):
    name = "shard_parameters"
    requires = frozenset({"dp_grad_sync"})
    provides = frozenset({"params_sharded"})
    layout_fields = frozenset({"dp", "zero"})

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        dp = ctx.layout.dp
        sig = tg.signature
        blocked = [i for i, b in enumerate(sig.grad_blocks) if b == dp > 1]
        if ctx.layout.zero < 3 or not blocked:
            return tg, PassResult(self.name, changed=False,
                                  declined=[("parameter sharding", "Layout.zero < 3 or no "
                                             "gradient is reduce-scattered")])
        tg = tg.copy()
        placeholders = tg.placeholders()
        remade = self._remake_weight_views_in_backward(tg, [placeholders[i] for i in blocked])
        order = {n: i for i, n in enumerate(tg.graph.nodes)}
        tag = mesh_group_tag("dp")
        uses = {i: self._uses_by_side(placeholders[i]) for i in blocked}
        for i in blocked:
            ph = placeholders[i]
            ph.meta[M.VAL] = ph.meta[M.VAL].new_empty(_block(sig.params[i].shape, dp))
        gathers = 0
        for side in (0, 1):  # forward uses, then backward uses
            users = {i: uses[i][side] for i in blocked if uses[i][side]}
            first = sorted(users, key=lambda i: order[users[i][0]])
            for k, i in enumerate(first):
                issue_before = users[first[k - 1]][0] if k else users[i][0]
                self._gather(tg, placeholders[i], users[i], issue_before, dp, tag,
                             sig.params[i].shape[0])
                gathers += 1
        params = tuple(dataclasses.replace(p, shape=_block(p.shape, dp)) if i in blocked else p
                       for i, p in enumerate(sig.params))
        tg.signature = dataclasses.replace(
            sig, params=params, grad_blocks=tuple(1 for _ in sig.params),
            param_blocks=tuple(dp if i in blocked else 1 for i in range(len(sig.params))))
        tg.gm.recompile()
        declined = [(f"sharding {p.name}", "its gradient is all-reduced whole (see "
                     "insert_allreduce): kept whole") for i, p in enumerate(sig.params)
                    if i not in blocked]
        return tg, PassResult(self.name, changed=True,
                              stats={"params_sharded": len(blocked), "all_gathers": gathers,
                                     "weight_views_remade": remade},
                              declined=declined)

    @staticmethod
    def _remake_weight_views_in_backward(tg: TrainGraph, blocks: list[fx.Node]) -> int:
        """A backward op often reads a forward view of a weight (the transpose a linear
        layer's forward made): that would keep the forward's gathered weight alive
        through the backward. Such views (and casts) are made again in the backward from
        the parameter, so the backward's own gather feeds them."""
        derived = derived_from(tg, blocks) - set(blocks)
        forward = {n for n in derived if n.meta.get(M.ROLE) in (M.Role.FORWARD, M.Role.LOSS)}
        return rewrite(tg.graph, forward)

    @staticmethod
    def _uses_by_side(ph: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
        """The parameter's users in graph order: forward side (forward, loss) and backward."""
        users = [u for u in ph.graph.nodes if ph in u.all_input_nodes]
        backward = [u for u in users if u.meta.get(M.ROLE) == M.Role.BACKWARD]
        return [u for u in users if u not in backward], backward

    @staticmethod
    def _gather(tg: TrainGraph, block: fx.Node, users: list[fx.Node], issue_before: fx.Node,
                dp: int, tag: str, rows: int) -> None:
        graph = tg.graph
        where = users[0].meta.get(M.MODULE_PATH)
        # the gather belongs to the repeated block its first reader is in (a deep model
        # costed from a few traced blocks repeats it with them: planner/scaled.py)
        layer = {M.LAYER: users[0].meta[M.LAYER]} if M.LAYER in users[0].meta else {}
        with graph.inserting_before(issue_before):
            job = graph.call_function(c10d.all_gather_into_tensor.default, (block, dp, tag))
        job.meta = new_node_meta(c10d.all_gather_into_tensor.default(block.meta[M.VAL], dp, tag),
                                 M.Role.COMM, "shard_parameters", where,
                                 **{M.COMM_KIND: "param_gather"}, **layer)
        with graph.inserting_before(users[0]):
            whole = graph.call_function(c10d.wait_tensor.default, (job,))
        whole.meta = new_node_meta(job.meta[M.VAL], M.Role.COMM, "shard_parameters", where,
                                   **layer)
        if whole.meta[M.VAL].shape[0] != rows:  # the last block's padding rows
            with graph.inserting_after(whole):
                trimmed = graph.call_function(torch.ops.aten.slice.Tensor, (whole, 0, 0, rows))
            trimmed.meta = new_node_meta(whole.meta[M.VAL][:rows], M.Role.COMM,
                                         "shard_parameters", where, **layer)
            whole = trimmed
        for user in users:
            user.replace_input_with(block, whole)


def _block(shape: tuple[int, ...], dp: int) -> tuple[int, ...]:
    return (block_rows(shape[0], dp),) + tuple(shape[1:])
