"""SyncBatchNorm: a batch norm in training mode normalises by the statistics of the whole
batch, not of this rank's shard.

Data parallelism gives each rank a shard of the batch. Most ops see one sample at a time
and do not care; a batch norm in training mode computes the mean and variance of each
channel over the batch (and the spatial dims), normalises by them and folds them into
its running statistics. On a shard those are the shard's statistics: the loss, every
gradient and the running statistics then differ from the single-device step's (and the
ranks' running statistics from one another). torch's answer is a module swap
(`nn.SyncBatchNorm.convert_sync_batchnorm`) the user has to know to make; here the
compiled step is equivalent by construction.

The pass rewrites, on the joint graph, each training-mode batch norm and its backward
into ops that gather or sum over the data-parallel group (`c10d` collectives on the
"dp" mesh tag, as the gradient sync's): one collective each way, as `nn.SyncBatchNorm`
has (an all-gather of each rank's [2C] statistics, an all-reduce of [2C] sums):

    forward (x: [N, C, *], n = the elements of a channel on this rank, dp * n in all)
        m_r, M_r = this shard's mean and sum((x - m_r)^2)
        [m_r, M_r] of every rank = all_gather([m_r, M_r])
        mean  = mean_r(m_r)
        var   = (sum_r M_r + n sum_r (m_r - mean)^2) / (dp n)  (Chan's merge, as
                                                               nn.SyncBatchNorm's)
        out   = (x - mean) * rsqrt(var + eps) * weight + bias
        running_mean <- (1 - m) running_mean + m mean
        running_var  <- (1 - m) running_var + m var dp n / (dp n - 1)
    backward (g: the gradient of out; xhat = (x - mean) * rstd)
        grad_weight = sum(g xhat), grad_bias = sum(g)          (this rank's part: the
                                                                gradient sync sums them)
        [s1, s2] = all_reduce([sum(g), sum(g xhat)])
        grad_x = (g - s1 / (dp n) - xhat s2 / (dp n)) * rstd * weight

The statistics and the backward's sums are computed in fp32 (torch's kernels accumulate
a half input in fp32 too); each output takes the dtype the replaced op gives it. A batch norm outside
training mode (`model.eval()`: the running statistics, no batch statistics) is left as
it is, as is every other norm (layer, group, instance and RMS norms see one sample).

Requires: "traced". Provides: "batch_stats_synced". Runs for dp > 1 before the gradient
sync (whose backward-seed scaling the rewritten backward, linear in g, follows). Micro-
batches cannot be made equivalent (a micro-batch's statistics are computed before the
next micro-batch exists): lowering a pipelined step refuses a training-mode batch norm
(lower_pipeline).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.program import mesh_group_tag
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult, writable
from autopar.compiler.passes.builder import NodeBuilder
from autopar.compiler.passes.manager import register_pass
from autopar.layout import Layout

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# training-mode batch norms this pass rewrites: (x, weight, bias, running_mean,
# running_var, training, momentum, eps) -> (out, save_mean, save_rstd, new running mean,
# new running var); the no_stats form has no running statistics
_WITH_STATS = aten._native_batch_norm_legit_functional.default
_NO_STATS = aten._native_batch_norm_legit.no_stats
_BACKWARD = aten.native_batch_norm_backward.default

# native_batch_norm without running statistics (a BatchNorm built with
# track_running_stats=False, in eval mode) is rewritten like the no_stats form
_NATIVE = aten.native_batch_norm.default
# batch norms in training mode in other forms (running statistics updated in place):
# refused with dp > 1 rather than left to compute a shard's statistics
_OTHER_TRAINING = frozenset({
    aten._native_batch_norm_legit.default, aten.batch_norm.default,
    aten._batch_norm_with_update.default, aten._batch_norm_with_update_functional.default,
})


class BatchNormError(ValueError):
    """A training-mode batch norm the pass cannot make compute the whole batch's
    statistics."""


def training_batch_norms(tg: TrainGraph) -> list[fx.Node]:
    """The forward batch norms of `tg` that compute batch statistics (training mode), in
    graph order: what a data-parallel or micro-batched step must treat as coupling the
    samples of the batch."""
    found = []
    for node in tg.call_nodes():
        if node.target in (_WITH_STATS, _NO_STATS, _NATIVE, *_OTHER_TRAINING) \
                and _training(node):
            found.append(node)
    return found


def _training(node: fx.Node) -> bool:
    if node.target is _WITH_STATS:
        return bool(node.args[5])
    if node.target is _NO_STATS:
        return bool(node.args[3])
    if node.target is aten._batch_norm_with_update.default \
            or node.target is aten._batch_norm_with_update_functional.default:
        return True
    training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else True)
    return bool(training)


def _bound(node: fx.Node) -> tuple | None:
    """(x, weight, bias, running_mean, running_var, momentum, eps) of a training-mode batch
    norm the pass rewrites, None for one it does not (the running statistics updated in
    place: export's functional form updates them as outputs)."""
    if node.target is _WITH_STATS:
        x, weight, bias, running_mean, running_var, _, momentum, eps = node.args
        return x, weight, bias, running_mean, running_var, momentum, eps
    if node.target is _NO_STATS:
        x, weight, bias, _, momentum, eps = node.args
        return x, weight, bias, None, None, momentum, eps
    if node.target is _NATIVE and node.args[3] is None and node.args[4] is None:
        x, weight, bias, _, _, _, momentum, eps = node.args
        return x, weight, bias, None, None, momentum, eps
    return None


def where(node: fx.Node) -> str:
    """The module and source line of `node`, for an error the user can act on."""
    path = node.meta.get(M.MODULE_PATH)
    kind = node.meta.get(M.MODULE_TYPE)
    source = node.meta.get(M.SOURCE)
    module = (f"module {path}" if path else "the model") + \
        (f" ({kind.rsplit('.', 1)[-1]})" if kind else "")
    # a line inside torch (nn.BatchNorm2d's forward) says less than the module's name
    inside_torch = source is not None and f"{os.sep}torch{os.sep}" in source
    return module + (f" at {source}" if source and not inside_torch else "")


@dataclass
class _Forward:
    """A rewritten forward batch norm: what its backward reads."""

    mean: fx.Node  # [C], as the replaced op saves it for its backward
    rstd: fx.Node  # [C], likewise
    count: int  # elements of a channel over the whole batch (every rank's)


def _emitter(build: NodeBuilder, role: M.Role):
    """`emit(op, *args, **kwargs)`: a node after the builder's cursor, in `role`."""
    return lambda op, *args, **kwargs: build.call(op, args, role, kwargs=kwargs)


@register_pass
class SyncBatchNorm(GraphPass):
    name = "sync_batch_norm"
    requires = frozenset({"traced"})
    provides = frozenset({"batch_stats_synced"})
    layout_fields = frozenset({"dp"})

    def reads(self, layout: Layout) -> tuple:
        return (("dp", layout.dp),)

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        dp = ctx.layout.dp
        norms = training_batch_norms(tg)
        if dp == 1 or not norms:
            why = "dp=1: the batch is whole" if dp == 1 else "no batch norm in training mode"
            return tg, PassResult(self.name, changed=False, declined=[("batch statistics", why)])
        for node in norms:
            if _bound(node) is None:
                raise BatchNormError(
                    f"{where(node)}: batch norm as {node.target} in training mode, updating "
                    f"its running statistics in place; dp={dp} must compute its statistics "
                    f"over the whole batch, and the pass rewrites the functional forms "
                    f"export gives ({_WITH_STATS}, {_NO_STATS}). Use dp=1, or put the "
                    f"module in eval mode (its running statistics)")
        tg = writable(tg, ctx)
        by_name = {n.name: n for n in tg.graph.nodes}
        tag = mesh_group_tag("dp")
        rewritten: dict[fx.Node, _Forward] = {}  # the mean a backward reads -> its forward
        build = NodeBuilder(tg.graph, self.name)
        for old in norms:
            forward = _rewrite_forward(build, by_name[old.name], tag, dp)
            rewritten[forward.mean] = forward
        backwards = [n for n in tg.call_nodes() if n.target is _BACKWARD
                     and n.args[5] in rewritten and n.args[7]]
        for node in backwards:
            _rewrite_backward(build, node, rewritten[node.args[5]], tag)
        tg.graph.eliminate_dead_code()
        tg.gm.recompile()
        return tg, PassResult(self.name, changed=True, stats={
            "batch_norms": len(norms), "backwards": len(backwards),
            "collectives": len(norms) + len(backwards)})


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _rewrite_forward(build: NodeBuilder, node: fx.Node, tag: str, dp: int) -> _Forward:
    x, weight, bias, running_mean, running_var, momentum, eps = _bound(node)
    val = x.meta[M.VAL]
    dims = [0, *range(2, val.dim())]
    channels, local = val.shape[1], val.numel() // val.shape[1]
    count = dp * local
    shape = _channel_shape(val)
    role = M.Role.FORWARD
    b = _emitter(build.at(node).like(node), role)
    x32 = build.cast(x, torch.float32, role)
    # this shard's mean and sum of squared deviations, gathered from every rank in one
    # collective and merged (Chan et al.): the whole batch's sum of squared deviations is
    # the shards' plus each shard's count times its mean's squared distance from the
    # whole batch's mean. No sum of squares less a squared sum: no cancellation.
    shard_mean = b(aten.div.Tensor, b(aten.sum.dim_IntList, x32, dims), local)
    deviation = b(aten.sub.Tensor, x32, b(aten.view.default, shard_mean, shape))
    shard_m2 = b(aten.sum.dim_IntList, b(aten.mul.Tensor, deviation, deviation), dims)
    gathered = b(c10d.wait_tensor.default, b(c10d.all_gather_into_tensor.default,
                                             b(aten.cat.default, [shard_mean, shard_m2]), dp, tag))
    stats = b(aten.view.default, gathered, [dp, 2, channels])
    means = b(aten.select.int, stats, 1, 0)
    mean = b(aten.mean.dim, means, [0])
    apart = b(aten.sub.Tensor, means, mean)
    between = b(aten.mul.Tensor, b(aten.sum.dim_IntList, b(aten.mul.Tensor, apart, apart), [0]),
                local)
    m2 = b(aten.add.Tensor, b(aten.sum.dim_IntList, b(aten.select.int, stats, 1, 1), [0]),
           between)
    var = b(aten.div.Tensor, m2, count)
    centred = b(aten.sub.Tensor, x32, b(aten.view.default, mean, shape))
    rstd = b(aten.rsqrt.default, b(aten.add.Tensor, var, eps))
    out = b(aten.mul.Tensor, centred, b(aten.view.default, rstd, shape))
    if weight is not None:
        out = b(aten.mul.Tensor, out, b(aten.view.default, build.cast(weight, torch.float32, role), shape))
    if bias is not None:
        out = b(aten.add.Tensor, out, b(aten.view.default, build.cast(bias, torch.float32, role), shape))
    # each output in the dtype the replaced op gives it: a half input's kernel keeps its
    # mean and rstd for the backward in the half dtype (on a CPU), as rounded here
    dtypes = [v.dtype for v in node.meta[M.VAL]]
    outputs = [build.cast(v, dtype, role) for v, dtype in zip((out, mean, rstd), dtypes)]
    if running_mean is not None:
        unbiased = count / max(count - 1, 1)
        for stat, batch, scale in ((running_mean, mean, 1.0), (running_var, var, unbiased)):
            kept = b(aten.mul.Tensor, stat, 1.0 - momentum)
            batch = build.cast(batch, stat.meta[M.VAL].dtype, role)
            new = b(aten.mul.Tensor, batch, momentum * scale)
            outputs.append(b(aten.add.Tensor, kept, new))
    for user in list(node.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(outputs[user.args[1]])
    return _Forward(outputs[1], outputs[2], count)


def _rewrite_backward(build: NodeBuilder, node: fx.Node, forward: _Forward, tag: str) -> None:
    grad, x, weight = node.args[0], node.args[1], node.args[2]
    mask = node.args[9] if len(node.args) > 9 else [True, True, True]
    val = x.meta[M.VAL]
    dims = [0, *range(2, val.dim())]
    shape = _channel_shape(val)
    role = M.Role.BACKWARD
    b = _emitter(build.at(node).like(node), role)
    g32, x32, rstd, mean = (build.cast(v, torch.float32, role)
                            for v in (grad, x, forward.rstd, forward.mean))
    rstd = b(aten.view.default, rstd, shape)
    mean = b(aten.view.default, mean, shape)
    xhat = b(aten.mul.Tensor, b(aten.sub.Tensor, x32, mean), rstd)
    sum_g = b(aten.sum.dim_IntList, g32, dims)
    sum_gx = b(aten.sum.dim_IntList, b(aten.mul.Tensor, g32, xhat), dims)
    outputs: list[fx.Node | None] = [None, None, None]
    if mask[0]:
        channels = val.shape[1]
        both = b(c10d.wait_tensor.default,  # one collective
                 b(c10d.all_reduce.default, b(aten.cat.default, [sum_g, sum_gx]), "sum", tag))
        mean_g = b(aten.div.Tensor, b(aten.slice.Tensor, both, 0, 0, channels), forward.count)
        mean_gx = b(aten.div.Tensor, b(aten.slice.Tensor, both, 0, channels, 2 * channels),
                    forward.count)
        centred = b(aten.sub.Tensor, g32, b(aten.view.default, mean_g, shape))
        centred = b(aten.sub.Tensor, centred,
                    b(aten.mul.Tensor, xhat, b(aten.view.default, mean_gx, shape)))
        scale = rstd if weight is None else \
            b(aten.mul.Tensor, rstd, b(aten.view.default, build.cast(weight, torch.float32, role), shape))
        outputs[0] = b(aten.mul.Tensor, centred, scale)
    if mask[1] and weight is not None:
        outputs[1] = sum_gx
    if len(mask) > 2 and mask[2]:
        outputs[2] = sum_g
    # in the dtypes the replaced backward gives
    wanted = node.meta[M.VAL]
    outputs = [None if out is None or want is None else build.cast(out, want.dtype, role)
               for out, want in zip(outputs, wanted)]
    for user in list(node.users):
        if user.target is operator.getitem and outputs[user.args[1]] is not None:
            user.replace_all_uses_with(outputs[user.args[1]])

