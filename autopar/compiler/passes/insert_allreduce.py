"""InsertAllReduce: sum gradients over the data-parallel ranks, in buckets, overlapped.

Rewrites, in order:

1. Averaging: the backward pass is seeded with 1/dp instead of 1, so every
   gradient comes out already divided by dp (DDP divides before summing too, which
   keeps half-precision sums in range) without a pass over the buckets. A graph
   without that seed gets the division on each bucket instead.
2. Embedding tables: an `embedding_dense_backward` whose table is larger than the
   rows that produce it is computed from all-gathered (indices, row gradients)
   instead of all-reducing the dense table: for GPT-2 (vocabulary 50,257, 16 x 128
   tokens) that is 2 MiB gathered instead of 49 MiB reduced, and a tied weight's
   other term (the output head) is then reduced on its own, early in the backward.
3. Buckets: the remaining per-rank gradient terms, in the order the backward pass
   produces them, are packed into buckets of about `layout.bucket_mb` MiB. Right
   after a bucket's last term is computed the bucket is flattened and all-reduced
   (`_c10d_functional.all_reduce`, asynchronous); its `wait_tensor` is placed just
   before the graph's output, so the all-reduce runs while the backward goes on.
   The loss is averaged the same way. With `Layout.grad_comm_dtype="bf16"` (or
   "fp16") a bucket is cast to that dtype after the division and back to the
   gradients' dtype after the wait: half the bytes on the wire, one rounding of the
   summed gradient (embedding rows are still gathered in their own dtype).
4. ZeRO-2/3 (`Layout.zero>=2`): a gradient with at least dp rows goes into buckets
   that are reduce-scattered instead: laid out block-major ([dp, n/dp], row r holding
   every gradient's r-th dim-0 block of ceil(rows/dp) rows, the last padded with zero
   rows), so each rank receives exactly its blocks, and the step returns that block
   (`GraphSignature.grad_blocks`). A reduce-scatter holds its input, a whole bucket,
   until its wait: each is waited for right before the reduce-scatter
   SCATTERS_IN_FLIGHT buckets later starts, so a rank holds a couple of whole buckets
   at a time, not the whole gradient. An embedding table whose gradient comes from
   gathered rows (step 2) builds only this rank's block from them (rows of other
   blocks masked out; PassOptions.dp_rank says which block). The runtime's
   optimizer updates the block and gathers the blocks back into the parameter.
   Gradients with fewer rows than dp are all-reduced whole, as listed in `declined`.
5. Hierarchical (`Layout.allreduce="hierarchical"`, docs/communication.md): each whole
   bucket is summed in three levels over the "dp.local" and "dp.node" groups (_Chain):
   inside each node, among the nodes, back inside each node. On gloo the first and
   last are a reduce to the node's first rank and a broadcast from it, and only those
   first ranks cross the network; on NCCL a reduce-scatter and an all-gather, with each
   rank's shard crossing the network. The loss, gathered embedding rows and ZeRO's
   reduce-scatters stay flat (`declined`).

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

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.compiler.ir import comm_ops
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import tensor_bytes
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.program import block_rows, mesh_group_tag
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult, writable
from autopar.compiler.passes.builder import NodeBuilder, scale_backward_seed
from autopar.compiler.passes.manager import register_pass
from autopar.costs import dp_node_split
from autopar.layout import LayoutError

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
prims = torch.ops.prims
# Layout.grad_comm_dtype -> the dtype gradient buckets travel in
_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MiB = 1 << 20
# ZeRO-2/3: a reduce-scatter is waited for right before the one this many buckets later
# starts (its input, a whole bucket, is held until its wait; FSDP also keeps a few)
SCATTERS_IN_FLIGHT = 2


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


def gradient_terms(node: fx.Node) -> list[fx.Node]:
    """The terms autograd summed into a gradient (a weight used in several places)."""
    if node.target == aten.add.Tensor and node.meta.get("is_gradient_acc") \
            and all(isinstance(a, fx.Node) for a in node.args[:2]) and len(node.args) == 2:
        return gradient_terms(node.args[0]) + gradient_terms(node.args[1])
    return [node]


@dataclass
class _GatheredRows:
    """An embedding table's gradient as all ranks' (row gradients, indices) in flight."""

    rows_job: fx.Node
    indices_job: fx.Node
    table_args: tuple  # num_weights, padding_idx, scale_grad_by_freq
    module_path: str | None


@dataclass
class _Grad:
    """One parameter's gradient: per-rank terms to all-reduce, and embedding terms
    whose rows are being all-gathered."""

    param: int
    local: list[fx.Node]
    gathered: list[_GatheredRows] = field(default_factory=list)


def _block_shape(term: fx.Node, blocks: int) -> torch.Size:
    shape = term.meta[M.VAL].shape
    return torch.Size((block_rows(shape[0], blocks), *shape[1:])) if blocks > 1 else shape


def _padded(build: NodeBuilder, term: fx.Node, blocks: int, extra: dict) -> fx.Node:
    """A gradient with zero rows appended so that its dim 0 splits into `blocks` blocks."""
    rows = term.meta[M.VAL].shape[0] if blocks > 1 else 0
    missing = block_rows(rows, blocks) * blocks - rows if blocks > 1 else 0
    if not missing:
        return term
    pad = [0, 0] * (term.meta[M.VAL].dim() - 1) + [0, missing]  # last pair: dim 0
    return build.call(aten.constant_pad_nd.default, (term, pad), **extra)


@dataclass(frozen=True)
class _Levels:
    """A hierarchical all-reduce's shape for this rank (Layout.allreduce="hierarchical")."""

    local: int  # ranks of the dp group on each node ("dp.local")
    nodes: int  # nodes the dp group spans: ranks of each "dp.node" group
    form: str  # "leaders" or "shards" (_Chain)
    leader: bool  # this rank is the first of its node's ranks of the dp group

    def describe(self) -> str:
        steps = ("reduce to each node's leader, all-reduce among the leaders, broadcast"
                 if self.form == "leaders" else
                 "reduce-scatter in each node, all-reduce of each shard among the nodes, "
                 "all-gather in each node")
        return f"hierarchical over {self.nodes} nodes x {self.local} ranks: {steps}"


class _Chain:
    """One bucket's hierarchical all-reduce: three collectives. The first starts when the
    bucket is complete, the second (over the network) when the backward completes the
    next bucket: the compute waits there only for the first, a transfer inside the
    node. The third starts at the end of the backward, after the second's wait, so no
    compute waits on the network before the flat all-reduce's would; its result is
    waited for at the output.

    - "leaders" (gloo, where reduce_scatter_tensor is an all-reduce in disguise): a
      reduce to the node's first rank over "dp.local", an all-reduce among the nodes'
      first ranks over "dp.node" (the others send nothing over the network), and a
      broadcast from the first rank over "dp.local".
    - "shards" (NCCL): a reduce-scatter over "dp.local" (the bucket padded to a multiple
      of the local ranks), an all-reduce of each rank's shard over "dp.node" (one per
      network port), an all-gather over "dp.local"; the padding is cut at the output.
    """

    LOCAL, NODE = mesh_group_tag("dp.local"), mesh_group_tag("dp.node")
    BACK = 2  # the stage of the third collective, back inside the node

    def __init__(self, packed: fx.Node, levels: _Levels, extra: dict) -> None:
        self.node, self.levels, self.extra, self.stage = packed, levels, extra, 0

    @property
    def done(self) -> bool:
        return self.stage == 3

    def advance(self, build: NodeBuilder, until: int = 3) -> None:
        """Start the next level, unless it is stage `until` or later (or all are done)."""
        if self.stage >= until:
            return
        levels, extra = self.levels, {**self.extra, M.COMM_KIND: "grad_bucket"}
        local, shards = levels.local, levels.form == "shards"
        if self.stage == 0:
            if shards:
                packed = self.node
                missing = -packed.meta[M.VAL].numel() % local
                if missing:
                    packed = build.call(aten.constant_pad_nd.default, (packed, [0, missing]),
                                        **self.extra)
                self.node = build.call(c10d.reduce_scatter_tensor.default,
                                       (packed, "sum", local, self.LOCAL), **extra)
            else:
                self.node = build.call(comm_ops.reduce, (self.node, 0, self.LOCAL), **extra)
        elif self.stage == 1:
            waited = build.call(c10d.wait_tensor.default, (self.node,))
            self.node = build.call(c10d.all_reduce.default, (waited, "sum", self.NODE), **extra) \
                if shards or levels.leader else waited
        elif self.stage == 2:
            summed = self.node if self.node.target is c10d.wait_tensor.default else \
                build.call(c10d.wait_tensor.default, (self.node,))
            self.node = build.call(c10d.all_gather_into_tensor.default,
                                   (summed, local, self.LOCAL), **extra) if shards else \
                build.call(c10d.broadcast.default, (summed, 0, self.LOCAL), **extra)
        else:
            return
        self.stage += 1


@register_pass
class InsertAllReduce(GraphPass):
    name = "insert_allreduce"
    requires = frozenset({"traced"})
    provides = frozenset({"dp_grad_sync"})
    layout_fields = frozenset({"dp", "tp", "zero", "bucket_mb", "overlap_comm", "grad_comm_dtype",
                               "allreduce"})

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        dp = ctx.layout.dp
        if dp == 1:
            return tg, PassResult(self.name, changed=False,
                                  declined=[("all-reduce", "dp=1: gradients are already global")])
        tg = writable(tg, ctx)
        build = NodeBuilder(tg.graph, self.name)
        tag = mesh_group_tag("dp")
        divisor = 1 if scale_backward_seed(tg, build, dp) else dp
        wire = _WIRE_DTYPES.get(ctx.layout.grad_comm_dtype)  # None: the gradients' own dtype
        grads = [_Grad(i, [g]) for i, g in enumerate(tg.grad_nodes())]
        gathered = self._gather_embedding_grads(tg, build, grads, dp, divisor, tag)
        # ZeRO-2/3: the gathered rows build only this rank's block of the table
        self._rank = ctx.options.dp_rank
        order = {n: i for i, n in enumerate(tg.graph.nodes)}
        pieces = sorted(((t, g) for g in grads for t in g.local), key=lambda p: order[p[0]])
        blocked = self._zero2_blocked(tg, grads, dp) if ctx.layout.zero >= 2 else set()
        buckets = []  # (pieces, blocks): whole buckets all-reduced, blocked ones reduce-scattered
        for blocks in (1, dp):
            mine = [p for p in pieces if (p[1].param in blocked) == (blocks > 1)]
            sizes = [tensor_bytes(t.meta[M.VAL]) for t, _ in mine]
            buckets += [([mine[k] for k in b], blocks)
                        for b in plan_buckets(sizes, ctx.layout.bucket_mb * MiB)]
        buckets.sort(key=lambda b: order[b[0][-1][0]])  # in the order backward completes them
        waited: dict[fx.Node, fx.Node] = {}  # reduce-scatters waited for early: their waits
        levels = self._levels(ctx)
        chains: list[_Chain] = []  # hierarchical all-reduces in flight, one level each call
        if ctx.layout.overlap_comm:  # each bucket starts right after its last term
            pending, scattering = [], []
            for i, (b, blocks) in enumerate(buckets):
                build.at(max((t for t, _ in b), key=order.__getitem__))
                for chain in chains:  # the earlier buckets' network level, as this one starts
                    chain.advance(build, until=_Chain.BACK)
                if blocks > 1:
                    if len(scattering) >= SCATTERS_IN_FLIGHT:
                        early = scattering.pop(0)
                        waited[early] = build.call(c10d.wait_tensor.default, (early,))
                pending.append(self._launch_bucket(build, b, i, divisor, tag, wire, blocks, levels))
                if blocks > 1:
                    scattering.append(pending[-1][1])
                elif levels is not None:
                    chains.append(pending[-1][1])
        else:  # a baseline: all buckets start after the whole backward pass
            build.at(tg.output_node().prev)
            pending = [self._launch_bucket(build, b, i, divisor, tag, wire, blocks, levels)
                       for i, (b, blocks) in enumerate(buckets)]
            chains = [reduced for _, reduced, blocks in pending if isinstance(reduced, _Chain)]
        if chains:  # the levels left, before the waits at the output
            build.at(tg.output_node().prev)
            while any(not c.done for c in chains):
                for chain in chains:
                    chain.advance(build)
            pending = [(b, r.node if isinstance(r, _Chain) else r, blocks)
                       for b, r, blocks in pending]
        loss = self._launch_loss(tg, build, dp, tag)
        tg.output_node().args = (tuple(self._wait_all(tg, build, pending, loss, grads,
                                                      {i: dp for i in blocked}, waited)),)
        tg.graph.eliminate_dead_code()
        tg.gm.recompile()
        if blocked:
            tg.signature = dataclasses.replace(tg.signature, grad_blocks=tuple(
                dp if i in blocked else 1 for i in range(len(tg.signature.params))))
        if levels is not None:  # the runtime makes the two levels' process groups
            tg.attrs["dp_node_split"] = levels.local
        stats = {"buckets": len(buckets), "bucket_mb": ctx.layout.bucket_mb,
                 "overlap": ctx.layout.overlap_comm,
                 "allreduce_bytes": sum(tensor_bytes(r.meta[M.VAL]) for _, r, _ in pending),
                 "grad_comm_dtype": str(wire or "same as the gradients"), "dp": dp,
                 "averaging": "backward seed / dp" if divisor == 1 else "bucket / dp",
                 "embedding_grads_gathered": gathered,
                 "allreduce": "flat" if levels is None else levels.describe()}
        declined = []
        if levels is not None:
            declined += [(what, "summed flat over dp: too small to gain from two levels") for what
                         in ["the loss", *[f"embedding rows of {g}" for g in gathered]]]
            if blocked:
                declined.append(("ZeRO's gradient reduce-scatters",
                                 "run flat over dp: only whole buckets are summed in two levels"))
        if ctx.layout.zero >= 2:
            stats["reduce_scattered_grads"] = len(blocked)
            declined += [(f"reduce-scatter of {tg.signature.params[g.param].name}'s gradient",
                          "it has fewer rows than dp: all-reduced whole")
                         for g in grads if g.param not in blocked]
        return tg, PassResult(self.name, changed=True, stats=stats, declined=declined)

    @staticmethod
    def _zero2_blocked(tg, grads, dp) -> set[int]:
        """ZeRO-2: the parameters whose gradient the step returns as this rank's dim-0
        block (every one with at least dp rows; the last block is padded when dp does not
        divide them): reduce-scattered, or built from gathered embedding rows."""
        return {g.param for g in grads
                if tg.signature.params[g.param].shape
                and tg.signature.params[g.param].shape[0] >= dp}

    def _gather_embedding_grads(self, tg, build, grads, dp, divisor, tag) -> list[str]:
        """All-gather the rows of each embedding table's gradient (see module doc)."""
        done = []
        for grad in grads:
            terms = gradient_terms(grad.local[0])
            kept = []
            for term in terms:
                if self._rows_are_cheaper(term, dp):
                    grad.gathered.append(self._gather_rows(tg, build, term, dp, divisor, tag))
                else:
                    kept.append(term)
            if grad.gathered:  # the old accumulation adds become dead code
                grad.local = kept
                done.append(tg.signature.params[grad.param].name)
        return done

    @staticmethod
    def _rows_are_cheaper(term: fx.Node, dp: int) -> bool:
        if term.target != aten.embedding_dense_backward.default:
            return False
        rows, indices = term.args[0], term.args[1]
        gathered = dp * (tensor_bytes(rows.meta[M.VAL]) + tensor_bytes(indices.meta[M.VAL]))
        return gathered < tensor_bytes(term.meta[M.VAL])

    def _gather_rows(self, tg, build, term, dp, divisor, tag) -> _GatheredRows:
        rows, indices = term.args[0], term.args[1]
        # indices are known from the forward pass on: gather them at once
        build.at(tg.placeholders()[-1] if indices.op == "placeholder" else indices)
        indices_job = build.call(c10d.all_gather_into_tensor.default, (indices, dp, tag),
                                 **{M.COMM_KIND: "embedding_indices"})
        build.at(rows)
        if divisor != 1:
            rows = build.call(aten.div.Tensor, (rows, divisor))
        rows_job = build.call(c10d.all_gather_into_tensor.default, (rows, dp, tag),
                              **{M.COMM_KIND: "embedding_rows"})
        return _GatheredRows(rows_job, indices_job, tuple(term.args[2:]), term.meta[M.MODULE_PATH])

    @staticmethod
    def _levels(ctx: PassContext) -> _Levels | None:
        """Layout.allreduce="hierarchical": the two levels of this rank's dp group."""
        if ctx.layout.allreduce != "hierarchical":
            return None
        if ctx.cluster is None:
            raise LayoutError("Layout.allreduce='hierarchical' sums inside each node first and "
                              "needs the cluster's devices per node: pass cluster=ClusterSpec(...) "
                              "(nodes, devices_per_node) to compile")
        local, nodes = dp_node_split(ctx.layout, ctx.cluster)
        form = ctx.options.hierarchy_form
        if form == "auto":
            form = "shards" if ctx.cluster.backend == "nccl" else "leaders"
        return _Levels(local, nodes, form, ctx.options.dp_rank % local == 0)

    def _launch_bucket(self, build, bucket, index, divisor, tag, wire=None, blocks=1,
                       levels=None):
        """Pack a bucket and start its reduction: an all-reduce, or (blocks = dp, ZeRO-2) a
        reduce-scatter of the gradients laid out block-major ([dp, ...]: row r holds
        every gradient's r-th dim-0 block), so that each rank receives its blocks. With
        `levels` a whole bucket starts a _Chain, its first level launched."""
        extra = {M.BUCKET: index}
        shape = [blocks, -1] if blocks > 1 else [-1]
        flat = [build.call(aten.reshape.default, (_padded(build, t, blocks, extra), shape), **extra)
                for t, _ in bucket]
        along = (flat,) if blocks == 1 else (flat, 1)
        packed = build.call(aten.cat.default, along, **extra) if len(flat) > 1 else flat[0]
        if divisor != 1:
            packed = build.call(aten.div.Tensor, (packed, divisor), **extra)
        if wire is not None and packed.meta[M.VAL].dtype != wire:
            # divided first (as DDP's bf16 compression hook does): the sum stays in range
            packed = build.call(prims.convert_element_type.default, (packed, wire), **extra)
        if blocks > 1:
            reduced = build.call(c10d.reduce_scatter_tensor.default, (packed, "sum", blocks, tag),
                                 **extra, **{M.COMM_KIND: "grad_bucket"})
        elif levels is not None:
            reduced = _Chain(packed, levels, extra)
            reduced.advance(build)
        else:
            reduced = build.call(c10d.all_reduce.default, (packed, "sum", tag),
                                 **extra, **{M.COMM_KIND: "grad_bucket"})
        return bucket, reduced, blocks

    def _launch_loss(self, tg, build, dp, tag):
        scaled = build.at(tg.loss_node()).call(aten.div.Tensor, (tg.loss_node(), dp))
        return build.call(c10d.all_reduce.default, (scaled, "sum", tag), **{M.COMM_KIND: "loss"})

    def _wait_all(self, tg, build, pending, loss, grads, blocked, waited) -> list[fx.Node]:
        """Waits just before the output for every collective not `waited` for already (a
        reduce-scatter -> its wait): the all-reduces stay in flight until then."""
        outputs = tg.outputs()
        build.at(tg.output_node().prev)
        summed: dict[fx.Node, fx.Node] = {}
        for bucket, reduced, blocks in pending:
            done = waited.get(reduced) or build.call(c10d.wait_tensor.default, (reduced,))
            grad_dtype = bucket[0][0].meta[M.VAL].dtype
            if done.meta[M.VAL].dtype != grad_dtype:  # back from grad_comm_dtype
                done = build.call(prims.convert_element_type.default, (done, grad_dtype))
            if blocks > 1:  # [1, n]: this rank's block of every gradient, in bucket order
                done = build.call(aten.reshape.default, (done, [-1]))
            sizes = [_block_shape(t, blocks).numel() for t, _ in bucket]
            if done.meta[M.VAL].numel() > sum(sizes):  # a hierarchical bucket's padding
                done = build.call(aten.slice.Tensor, (done, 0, 0, sum(sizes)))
            parts = build.call(aten.split_with_sizes.default, (done, sizes)) \
                if len(bucket) > 1 else None
            for k, (term, _) in enumerate(bucket):
                piece = build.call(operator.getitem, (parts, k)) if parts is not None else done
                summed[term] = build.call(aten.view.default,
                                          (piece, list(_block_shape(term, blocks))))
        outputs[0] = build.call(c10d.wait_tensor.default, (loss,))
        params = tg.signature.params
        for grad in grads:
            value = None
            for term in [summed[t] for t in grad.local]:
                value = term if value is None else build.call(aten.add.Tensor, (value, term))
            for gathered in grad.gathered:
                if grad.param in blocked:
                    value = self._add_block_rows(build, value, gathered, params[grad.param],
                                                 blocked[grad.param], self._rank)
                else:
                    value = self._add_rows(build, value, gathered)
            value.meta[M.GRAD_OF] = params[grad.param].name
            outputs[tg.signature.grad_output_index(grad.param)] = value
        return outputs

    @staticmethod
    def _add_block_rows(build, value, gathered: _GatheredRows, param, dp: int,
                        rank: int) -> fx.Node:
        """ZeRO: value + this rank's dim-0 block of the table gradient of the gathered rows
        (rows of other blocks masked out), into a zero block when there is no value."""
        rows = build.call(c10d.wait_tensor.default, (gathered.rows_job,))
        indices = build.call(c10d.wait_tensor.default, (gathered.indices_job,))
        _, padding_idx, scale_by_freq = gathered.table_args
        where = {M.MODULE_PATH: gathered.module_path}
        block = block_rows(param.shape[0], dp)
        if scale_by_freq:  # the counts need every row: the whole table, then this block
            table = build.call(aten.embedding_dense_backward.default,
                               (rows, indices, *gathered.table_args), role=M.Role.BACKWARD, **where)
            pad = [0, 0] * (len(param.shape) - 1) + [0, block * dp - param.shape[0]]
            table = build.call(aten.constant_pad_nd.default, (table, pad))
            mine = build.call(aten.slice.Tensor, (table, 0, rank * block, (rank + 1) * block))
            return mine if value is None else build.call(aten.add.Tensor, (value, mine))
        width = rows.meta[M.VAL].shape[-1]
        flat_rows = build.call(aten.reshape.default, (rows, [-1, width]))
        local = build.call(aten.sub.Tensor, (build.call(aten.reshape.default, (indices, [-1])),
                                             rank * block))
        keep = build.call(aten.bitwise_and.Tensor, (build.call(aten.ge.Scalar, (local, 0)),
                                                    build.call(aten.lt.Scalar, (local, block))))
        if padding_idx >= 0:  # the padding row gets no gradient
            keep = build.call(aten.bitwise_and.Tensor, (keep, build.call(
                aten.ne.Scalar, (local, padding_idx - rank * block))))
        local = build.call(aten.where.self, (keep, local, build.call(aten.zeros_like.default, (local,))))
        flat_rows = build.call(aten.mul.Tensor, (flat_rows, build.call(
            aten.unsqueeze.default, (keep, -1))))
        if value is None:
            value = build.call(aten.new_zeros.default, (flat_rows, [block, *param.shape[1:]]))
        return build.call(aten.index_add.default, (value, 0, local, flat_rows),
                          role=M.Role.BACKWARD, **where)

    @staticmethod
    def _add_rows(build, value, gathered: _GatheredRows) -> fx.Node:
        """value + the table gradient of the gathered rows. Added straight into `value`
        (index_add) when there is one, saving a zero-filled table and a pass over it."""
        rows = build.call(c10d.wait_tensor.default, (gathered.rows_job,))
        indices = build.call(c10d.wait_tensor.default, (gathered.indices_job,))
        num_weights, padding_idx, scale_by_freq = gathered.table_args
        where = {M.MODULE_PATH: gathered.module_path}
        if value is None or scale_by_freq:
            table = build.call(aten.embedding_dense_backward.default, (rows, indices, *gathered.table_args),
                               role=M.Role.BACKWARD, **where)
            return table if value is None else build.call(aten.add.Tensor, (value, table))
        width = rows.meta[M.VAL].shape[-1]
        flat_rows = build.call(aten.reshape.default, (rows, [-1, width]))
        flat_indices = build.call(aten.reshape.default, (indices, [-1]))
        if padding_idx >= 0:  # the padding row gets no gradient
            keep = build.call(aten.ne.Scalar, (flat_indices, padding_idx))
            keep = build.call(aten.unsqueeze.default, (keep, -1))
            flat_rows = build.call(aten.mul.Tensor, (flat_rows, keep))
        return build.call(aten.index_add.default, (value, 0, flat_indices, flat_rows),
                          role=M.Role.BACKWARD, **where)
