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
4. parameters are gathered in groups, as FSDP gathers a wrapped block: consecutive
   in the order of first uses, of one repeated block (`M.LAYER`) and dtype, at most
   `Layout.bucket_mb` MiB whole (at least one parameter). A group's blocks are
   flattened and concatenated (copy-in), gathered by one collective, and each
   parameter is cut out of the gathered rows (copy-out: rank r's rows of it lie in
   rank r's chunk). One collective per group, not per parameter: each gloo
   collective has a fixed cost (a GPT-2 block has 12 parameters);
5. each group's gather is issued one group ahead (right before the previous
   group's first use) and waited for right before its own first use, so it runs
   while the previous group computes. NOTE: issuing every gather of a layer at once
   (up to 16 in flight) crashed gloo with heap corruption ("malloc(): unaligned
   tcache chunk") in 1 of 3 four-process runs; one ahead never did, so one
   collective stays in flight ahead of the compute.

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
(a group of several parameters gathers cat([view(p_a, [-1]), view(p_b, [-1])]), and
cuts each out of the [dp, n_a + n_b] rows it gets back: slice, clone, view)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import node_bytes
from autopar.compiler.ir.graph import TrainGraph, new_node_meta
from autopar.compiler.ir.program import block_rows, mesh_group_tag
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult, writable
from autopar.compiler.passes.manager import register_pass
from autopar.compiler.passes.recompute_rules import derived_from, rewrite

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
MiB = 2**20


@dataclasses.dataclass
class _Member:
    """One parameter of a gather group: its block placeholder and its users on one side."""

    block: fx.Node
    users: list[fx.Node]
    rows: int  # the whole parameter's rows (its gathered blocks may carry padding)


def gather_groups(members: list[_Member], cap_bytes: float, dp: int) -> list[list[_Member]]:
    """`members` (in the order of first uses) cut into gather groups: consecutive, of one
    repeated block (M.LAYER of the first user) and dtype, at most `cap_bytes` gathered
    (a parameter larger than that is a group of its own)."""
    groups: list[list[_Member]] = []
    size = 0.0
    prev_key = None
    for m in members:
        val = m.block.meta[M.VAL]
        nbytes = val.numel() * val.element_size() * dp
        key = (m.users[0].meta.get(M.LAYER), val.dtype)
        if groups and key == prev_key and size + nbytes <= cap_bytes:
            groups[-1].append(m)
            size += nbytes
        else:
            groups.append([m])
            size = nbytes
        prev_key = key
    return groups


@register_pass
class ShardParameters(GraphPass):
    name = "shard_parameters"
    requires = frozenset({"dp_grad_sync"})
    provides = frozenset({"params_sharded"})
    layout_fields = frozenset({"dp", "zero", "bucket_mb"})

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        dp = ctx.layout.dp
        sig = tg.signature
        blocked = [i for i, b in enumerate(sig.grad_blocks) if b == dp > 1]
        if ctx.layout.zero < 3 or not blocked:
            return tg, PassResult(self.name, changed=False,
                                  declined=[("parameter sharding", "Layout.zero < 3 or no "
                                             "gradient is reduce-scattered")])
        tg = writable(tg, ctx)
        placeholders = tg.placeholders()
        remade = self._remake_weight_views_in_backward(tg, [placeholders[i] for i in blocked])
        order = {n: i for i, n in enumerate(tg.graph.nodes)}
        tag = mesh_group_tag("dp")
        uses = {i: self._uses_by_side(placeholders[i]) for i in blocked}
        for i in blocked:
            ph = placeholders[i]
            ph.meta[M.VAL] = ph.meta[M.VAL].new_empty(_block(sig.params[i].shape, dp))
        gathers = gathered_params = 0
        cap = ctx.layout.bucket_mb * MiB
        for side in (0, 1):  # forward uses, then backward uses
            users = {i: uses[i][side] for i in blocked if uses[i][side]}
            first = sorted(users, key=lambda i: order[users[i][0]])
            members = [_Member(placeholders[i], users[i], sig.params[i].shape[0]) for i in first]
            groups = gather_groups(members, cap, dp)
            for k, group in enumerate(groups):
                issue_before = groups[k - 1][0].users[0] if k else group[0].users[0]
                self._gather(tg, group, issue_before, dp, tag)
                gathers += 1
                gathered_params += len(group)
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
                                     "params_gathered": gathered_params,
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
    def _gather(tg: TrainGraph, group: list[_Member], issue_before: fx.Node, dp: int,
                tag: str) -> None:
        """One all-gather of `group`'s blocks, issued before `issue_before` and waited for
        before the group's first use; each member's users then read its whole parameter."""
        graph = tg.graph
        lead = group[0].users[0]
        where = lead.meta.get(M.MODULE_PATH)
        # the gather belongs to the repeated block its first reader is in (a deep model
        # costed from a few traced blocks repeats it with them: planner/scaled.py)
        layer = {M.LAYER: lead.meta[M.LAYER]} if M.LAYER in lead.meta else {}

        def add(op, args, copies: bool = False) -> fx.Node:
            node = graph.call_function(op, args)
            node.meta = new_node_meta(op(*fx.node.map_arg(args, lambda a: a.meta[M.VAL])),
                                      M.Role.COMM, "shard_parameters", where, **layer)
            if copies:  # a copy in or out of the gathered buffer moves its bytes
                node.meta[M.BYTES] = node_bytes(node)
            return node

        with graph.inserting_before(issue_before):
            if len(group) == 1:
                source = group[0].block
            else:  # copy-in: the blocks side by side in one flat buffer
                flats = [add(aten.view.default, (m.block, [-1])) for m in group]
                source = add(aten.cat.default, (flats,), copies=True)
            job = add(c10d.all_gather_into_tensor.default, (source, dp, tag))
            job.meta[M.COMM_KIND] = "param_gather"
        with graph.inserting_before(lead):
            gathered = add(c10d.wait_tensor.default, (job,))
            if len(group) > 1:  # rank r's chunk of the gathered buffer is its blocks
                table = add(aten.view.default, (gathered, [dp, source.meta[M.VAL].numel()]))
            offset = 0
            for m in group:
                shape = tuple(m.block.meta[M.VAL].shape)
                if len(group) == 1:
                    whole = gathered
                else:  # copy-out: every rank's rows of this parameter, in rank order
                    numel = m.block.meta[M.VAL].numel()
                    piece = add(aten.slice.Tensor, (table, 1, offset, offset + numel))
                    dense = add(aten.clone.default, (piece,), copies=True)
                    whole = add(aten.view.default, (dense, [dp * shape[0], *shape[1:]]))
                    offset += numel
                if whole.meta[M.VAL].shape[0] != m.rows:  # the last block's padding rows
                    whole = add(aten.slice.Tensor, (whole, 0, 0, m.rows))
                for user in m.users:
                    user.replace_input_with(m.block, whole)


def _block(shape: tuple[int, ...], dp: int) -> tuple[int, ...]:
    return (block_rows(shape[0], dp),) + tuple(shape[1:])
