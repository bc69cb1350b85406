"""InsertAllReduce: average gradients over the data-parallel ranks, in buckets, overlapped.

Rewrites: the gradients, taken in the order the backward pass produces them, are
packed into buckets of about `layout.bucket_mb` MiB. Right after a bucket's last
gradient is computed, the bucket is flattened and all-reduced
(`_c10d_functional.all_reduce`, asynchronous); its `wait_tensor` is placed as late
as possible, just before the graph's output, so the all-reduce runs while the rest
of the backward pass computes. The loss is averaged the same way.
Averaging: the backward pass is seeded with 1/dp instead of 1, so every gradient
is already divided by dp before the sum (as DDP's default hook divides before
summing, keeping half-precision sums in range) without an extra pass over the
buckets; a graph without that seed gets the division on each bucket instead.

Requires: "traced". Provides: "dp_grad_sync".

Before:                                   After (dp=2, one bucket of two gradients):
    seed = ones_like(loss)                    seed = div(ones_like(loss), 2)
    mm_3: f32[64, 64] = mm(...)               mm_3: f32[64, 64] = mm(...)
    sum_2: f32[64] = sum(...)                 sum_2: f32[64] = sum(...)
    return (loss, mm_3, sum_2)                cat: f32[4160] = cat([reshape(mm_3), reshape(sum_2)])
                                              ar = all_reduce(cat, sum, autopar.mesh.dp)
                                              w = wait_tensor(ar); split_with_sizes(w, [4096, 64]) ...
                                              return (loss_avg, view(getitem_0), view(getitem_1))
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph, new_node_meta
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.manager import register_pass
from autopar.runtime.program import mesh_group_tag

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
MiB = 1 << 20


def plan_buckets(sizes_in_order: list[int], cap_bytes: float) -> list[list[int]]:
    """Group consecutive gradients (by position) into buckets of at least cap_bytes
    (the last may be smaller); cap 0 gives one bucket per gradient."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, size in enumerate(sizes_in_order):
        current.append(index)
        filled += size
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class _Builder:
    """Inserts nodes one after another from a cursor, with complete metadata; each
    node's value is computed on its inputs' fake values."""

    def __init__(self, graph: fx.Graph, created_by: str):
        self.graph = graph
        self.created_by = created_by
        self.cursor: fx.Node | None = None

    def call(self, op, args: tuple, role: M.Role = M.Role.COMM, **extra) -> fx.Node:
        vals = fx.node.map_arg(args, lambda n: n.meta[M.VAL])
        name = op.__name__.split(".")[0]  # "all_reduce", not "all_reduce_default"
        with self.graph.inserting_after(self.cursor):
            node = self.graph.create_node("call_function", op, args, name=name)
        node.meta = new_node_meta(op(*vals), role, self.created_by, **extra)
        self.cursor = node
        return node


@register_pass
class InsertAllReduce(GraphPass):
    name = "insert_allreduce"
    requires = frozenset({"traced"})
    provides = frozenset({"dp_grad_sync"})

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        dp = ctx.layout.dp
        if dp == 1:
            return tg, PassResult(self.name, changed=False,
                                  declined=[("all-reduce", "dp=1: gradients are already global")])
        tg = tg.copy()
        order = {n: i for i, n in enumerate(tg.graph.nodes)}
        grads = tg.grad_nodes()
        by_time = sorted(range(len(grads)), key=lambda i: order[grads[i]])
        sizes = [tg.signature.params[i].nbytes for i in by_time]
        buckets = [[by_time[k] for k in b] for b in plan_buckets(sizes, ctx.layout.bucket_mb * MiB)]
        tag = mesh_group_tag("dp")
        build = _Builder(tg.graph, self.name)
        seed_scaled = self._scale_backward_seed(tg, build, dp)
        bucket_divisor = 1 if seed_scaled else dp
        pending = [self._launch_bucket(tg, build, order, grads, b, i, bucket_divisor, tag)
                   for i, b in enumerate(buckets)]
        pending.append(self._launch_loss(tg, build, dp, tag))
        outputs = self._wait_all(tg, build, pending)
        tg.output_node().args = (tuple(outputs),)
        tg.graph.eliminate_dead_code()
        tg.gm.recompile()
        stats = {"buckets": len(buckets), "bucket_mb": ctx.layout.bucket_mb,
                 "grad_bytes": sum(sizes), "dp": dp,
                 "averaging": "backward seed / dp" if seed_scaled else "bucket / dp"}
        return tg, PassResult(self.name, changed=True, stats=stats)

    def _scale_backward_seed(self, tg, build, dp) -> bool:
        """Start the backward pass from d(loss/dp) instead of d(loss): every gradient
        comes out already divided by dp (linearity), so no pass over the gradient
        buckets is needed. False if the graph has no `ones_like(loss)` seed."""
        loss = tg.loss_node()
        seeds = [u for u in loss.users if u.target == aten.ones_like.default]
        if len(seeds) != 1:
            return False
        seed = seeds[0]
        build.cursor = seed
        scaled = build.call(aten.div.Tensor, (seed, dp), role=M.Role.BACKWARD)
        seed.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        return True

    def _launch_bucket(self, tg, build, order, grads, bucket, index, divisor, tag):
        build.cursor = max((grads[i] for i in bucket), key=order.__getitem__)
        extra = {M.BUCKET: index}
        flat = [build.call(aten.reshape.default, (grads[i], [-1]), **extra) for i in bucket]
        packed = build.call(aten.cat.default, (flat,), **extra) if len(flat) > 1 else flat[0]
        if divisor != 1:
            packed = build.call(aten.div.Tensor, (packed, divisor), **extra)
        reduced = build.call(c10d.all_reduce.default, (packed, "sum", tag),
                             **extra, **{M.COMM_KIND: "grad_bucket"})
        return bucket, reduced

    def _launch_loss(self, tg, build, dp, tag):
        build.cursor = tg.loss_node()
        scaled = build.call(aten.div.Tensor, (build.cursor, dp))
        reduced = build.call(c10d.all_reduce.default, (scaled, "sum", tag),
                             **{M.COMM_KIND: "loss"})
        return None, reduced

    def _wait_all(self, tg, build, pending) -> list[fx.Node]:
        """Waits just before the output: every all-reduce stays in flight until then."""
        outputs = tg.outputs()
        params = tg.signature.params
        build.cursor = tg.output_node().prev
        for bucket, reduced in pending:
            done = build.call(c10d.wait_tensor.default, (reduced,))
            if bucket is None:
                outputs[0] = done
                continue
            sizes = [params[i].numel for i in bucket]
            parts = build.call(aten.split_with_sizes.default, (done, sizes)) \
                if len(bucket) > 1 else None
            for k, i in enumerate(bucket):
                piece = build.call(operator.getitem, (parts, k)) if parts is not None else done
                view = build.call(aten.view.default, (piece, list(params[i].shape)),
                                  **{M.GRAD_OF: params[i].name})
                outputs[tg.signature.grad_output_index(i)] = view
        return outputs
