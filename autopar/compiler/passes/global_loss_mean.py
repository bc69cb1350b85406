"""GlobalLossMean: a loss that divides by a count the batch decides divides by the
global batch's count.

Data parallelism and micro-batches split the batch into shards and average their
losses and gradients. That equals the loss of the whole batch when each shard's loss is
a mean over a fixed number of elements, but not when the count depends on the data:
cross-entropy with `ignore_index` (padding, prompt tokens) or class weights, a masked
sum divided by `mask.sum()`, `reduction="sum"` divided by a token count. Shards then
hold different counts, and a mean of per-shard means weighs their tokens unequally.
(DDP has this error; Hugging Face's Trainer passes `num_items_in_batch` for it.)

This pass finds, on the way to the loss, each division by such a count N (a 0-dim
sum over a shard's elements, through casts and clamps, computed from the user's
inputs alone, no parameter) and makes the step divide
by an input `loss_norm_k` instead: the mean of N over all dp * microbatches shards, which
the runtime computes from the global batch before the step (`LossNormalizer`: the
subgraph that computes N from one shard's inputs). The shard's loss becomes
sum / mean count, and the usual average over shards gives sum over the batch / count
over the batch, with the gradients to match.

Two forms carry such a count:
- `div.Tensor(a, N)`: every use of N (the forward's division and the backward's
  division of the incoming gradient) takes the global mean instead;
- `nll_loss_forward` / `nll_loss2d_forward` with reduction "mean": it sums instead and
  its output is divided by the mean, and its backward's `total_weight` argument (N)
  becomes the mean.

A division by another value of the batch (a mean, a ratio) does not add up over
shards; it is kept per shard and listed in `declined`.

Requires: "traced". Provides: "global_loss_mean". Runs before data-parallel
synchronisation and pipeline splitting (the shards are those layouts' shards).

Before (dp=2):                               After:
    ne = ne(input_1, -100)                       loss_norm_0: f32[]   (a new input)
    sum_1 = sum(ne)                              div = div(getitem, loss_norm_0)
    div = div(getitem, sum_1)                    ...
    div_1 = div(ones_like, sum_1)                div_1 = div(ones_like, loss_norm_0)
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.batch import LOSS_NORM_INPUT, LossNormalizer
from autopar.compiler.ir.graph import TensorSpec, TrainGraph
from autopar.compiler.ir.program import LOSS_SCALE_INPUT
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult, writable
from autopar.compiler.passes.batch_split import MEAN as MEAN_FORM
from autopar.compiler.passes.batch_split import MEETS, BatchSplitError, split_loss, where
from autopar.compiler.passes.batch_split import SUM as SUM_FORM
from autopar.compiler.passes.builder import NodeBuilder
from autopar.compiler.passes.manager import register_pass
from autopar.layout import Layout

aten = torch.ops.aten
NLL_FORWARD = frozenset({aten.nll_loss_forward.default, aten.nll_loss2d_forward.default})
NLL_BACKWARD = frozenset({aten.nll_loss_backward.default, aten.nll_loss2d_backward.default})
MEAN, SUM = 1, 2  # the reduction argument of nll_loss_forward


@register_pass
class GlobalLossMean(GraphPass):
    name = "global_loss_mean"
    requires = frozenset({"traced"})
    provides = frozenset({"global_loss_mean"})
    layout_fields = frozenset({"dp", "microbatches"})

    def reads(self, layout: Layout) -> tuple:
        """Whether the batch is cut into shards at all: the rewrite (a division by the
        mean count the runtime computes) is the same for any number of them."""
        return (("sharded", layout.dp * layout.microbatches > 1),)

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        shards = ctx.layout.dp * ctx.layout.microbatches
        if shards == 1:
            return tg, PassResult(self.name, changed=False,
                                  declined=[("global loss mean", "one shard: the batch is whole")])
        # where samples of different shards meet, no rewrite makes the shards' step the
        # batch's: an error naming the line (batch_split.py); else the loss's form
        split = split_loss(tg.source) if tg.source is not None else None
        over_batch = split.form if split is not None else MEAN_FORM
        n_user = _n_user_inputs(tg)
        found = _batch_counts(tg, n_user)
        not_counts = [c for c, form in found.items() if form == "not a count"]
        if not_counts and split is not None and split.checked:
            # a maximum, a product, a mean of the batch: a shard's own is not its part of
            # the batch's, and no divisor per shard makes their average the batch's loss
            raise BatchSplitError(
                f"{where(not_counts[0])}: {MEETS}, so the step does not split along the "
                f"batch: the loss divides by {not_counts[0].name}, a value of the batch that "
                f"is not a function of a sum over it (a maximum, a mean, a product), and each "
                f"shard would divide by its own. Write the divisor as a sum over the batch "
                f"(`mask.sum()`, or a function of that one number: `.clamp(min=1)`, "
                f"`+ 1e-8`, a cast) or a number, or train it with dp=1 and microbatches=1")
        declined = [(f"division by {c.name}", "a value of the batch that is not a count (a "
                     "sum over elements): each shard divides by its own")
                    for c, form in found.items() if form == "not a count"]
        declined += [(f"a rule for {op}", "taken as keeping the shard's samples apart (no "
                      "rule proves it)") for op in (split.assumed if split else ())]
        if split is not None and not split.checked:
            declined.append(("samples meeting across shards", "each shard holds one sample: "
                             "its batch dims of size 1 read as broadcast ones, and "
                             f"{split.unchecked}: not checked"))
        if split is not None and split.sizes_unread:
            declined.append(("numbers made from the shard's size", "a division by "
                             "`x.shape[0]` is the batch's mean only if the batch's size is "
                             f"what it divides by; not read: {split.sizes_unread}"))
        if tg.source is None:
            declined.append(("samples meeting across shards", "no exported forward to read "
                             "(a graph built without trace_train_step)"))
        if all(form == "not a count" for form in found.values()) and over_batch != SUM_FORM:
            return tg, PassResult(self.name, changed=False, stats={"normalizers": 0},
                                  declined=declined)
        tg = writable(tg, ctx)  # found on the input graph; rewritten on this one, node by name
        by_name = {n.name: n for n in tg.graph.nodes}
        found = {by_name[c.name]: form for c, form in found.items() if form != "not a count"}
        sig = tg.signature
        placeholders = tg.placeholders()
        last_input = placeholders[len(sig.params) + len(sig.buffers) + n_user - 1]
        build = NodeBuilder(tg.graph, self.name)
        normalizers, specs = [], []
        for k, (count, form) in enumerate(found.items()):
            name = f"{LOSS_NORM_INPUT}_{k}"
            # a mean of integer counts is fractional: integer counts become fp32
            val = count.meta[M.VAL]
            dtype = val.dtype if val.is_floating_point() else torch.float32
            total = _summed(count)  # the count is `finish(total)`
            normalizers.append(LossNormalizer(name, _subgraph(tg, total, n_user), dtype,
                                              _finish(count, total)))
            specs.append(TensorSpec(name, (), dtype))
            with tg.graph.inserting_after(last_input):
                mean = tg.graph.placeholder(name)
            mean.meta = {M.VAL: val.reshape(()).to(dtype)}
            last_input = mean
            # recomputation (which runs before this pass) may have copied the count into
            # the backward: a copy counts the shard too, and takes the mean as well
            for copy in [n for n in tg.call_nodes() if n.meta.get(M.RECOMPUTED) == count.name]:
                copy.replace_all_uses_with(mean)
            if form == "nll":
                _divide_nll_by(build, count, mean)
            else:
                count.replace_all_uses_with(mean)
        if over_batch == SUM_FORM:
            # a sum over the batch: the shards' losses add up to the batch's, and the
            # step averages them, so each shard's loss and its gradients are scaled by
            # the number of shards: divided by the batch's divisor (1) over the shards
            name = f"{LOSS_NORM_INPUT}_{len(normalizers)}"
            loss = tg.loss_node()
            dtype = loss.meta[M.VAL].dtype
            normalizers.append(LossNormalizer(name, None, dtype))
            specs.append(TensorSpec(name, (), dtype))
            with tg.graph.inserting_after(last_input):
                mean = tg.graph.placeholder(name)
            mean.meta = {M.VAL: loss.meta[M.VAL].reshape(()).to(dtype)}
            last_input = mean
            _divide_loss_by(build, tg, loss, mean)
        tg.graph.eliminate_dead_code()
        tg.gm.recompile()
        signature = dataclasses.replace(
            sig, inputs=sig.inputs[:n_user] + tuple(specs) + sig.inputs[n_user:],
            batch_dims=sig.batch_dims[:n_user] + (None,) * len(specs) + sig.batch_dims[n_user:])
        tg = dataclasses.replace(tg, signature=signature,
                                 loss_normalizers=tg.loss_normalizers + tuple(normalizers))
        divides_by = [f"{c.name} ({how})" for c, how in found.items()]
        divides_by += ["the loss, a sum over the batch (sum)"] if over_batch == SUM_FORM else []
        return tg, PassResult(self.name, changed=True, stats={
            "normalizers": len(normalizers), "divides_by": divides_by}, declined=declined)


def _n_user_inputs(tg: TrainGraph) -> int:
    """The user's batch tensors: the inputs before a trailing loss-scale input."""
    inputs = tg.signature.inputs
    return len(inputs) - bool(inputs and inputs[-1].name == LOSS_SCALE_INPUT)


def _batch_counts(tg: TrainGraph, n_user: int) -> dict[fx.Node, str]:
    """Each 0-dim count computed from the user inputs alone that the loss divides by ->
    "div" or "nll" (the form that divides by it), in graph order."""
    inputs = _user_placeholders(tg, n_user)
    from_batch, param_free = _computed_from(tg, inputs)
    forward = {n for n in tg.call_nodes() if n.meta.get(M.ROLE) in (M.Role.FORWARD, M.Role.LOSS)}
    found: dict[fx.Node, str] = {}
    for node in tg.call_nodes():
        if node not in forward:
            continue
        if node.target == aten.div.Tensor and len(node.args) == 2:
            count = node.args[1]
            if _is_scalar(count, from_batch) and node.args[0] not in from_batch:
                found.setdefault(count, "div" if _summed(count) else "not a count")
        elif node.target in NLL_FORWARD and _reduction(node) == MEAN:
            total = _getitem(node, 1)
            if total is not None and node.args[1] in from_batch and (
                    _weight(node) is None or _weight(node) in param_free):
                found.setdefault(total, "nll")
    return found


def _computed_from(tg: TrainGraph, inputs: list[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """(the nodes computed from the user inputs without any parameter, the nodes computed
    without any parameter): buffers, constants and factories such as a class-weight
    `arange` are parameter-free too."""
    params = set(tg.placeholders()[:len(tg.signature.params)])
    free = {n for n in tg.graph.nodes if n.op in ("placeholder", "get_attr") and n not in params}
    batch = set(inputs)
    for node in tg.call_nodes():
        ins = node.all_input_nodes
        if all(a in free for a in ins):
            free.add(node)
            if any(a in batch for a in ins):
                batch.add(node)
    return batch, free


def _is_scalar(node, from_batch: set[fx.Node]) -> bool:
    val = node.meta.get(M.VAL) if isinstance(node, fx.Node) else None
    return node in from_batch and isinstance(val, torch.Tensor) and val.numel() == 1


_SUMS = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.count_nonzero.default,
                   aten.count_nonzero.dim_IntList})


def _summed(node: fx.Node) -> fx.Node | None:
    """The sum over a shard's elements that `node` is a function of (or None): a sum
    adds up over shards, so the batch's is the shards' sum, and the divisor is that
    function of it. The function is a chain of ops each of one value, a single number,
    with numbers for their other arguments: a cast, a clamp to at least 1, `+ 1e-8`,
    `* 2`. A mean or a maximum over the batch is no function of a sum."""
    while not _is_sum(node):
        if not _of_one_number(node):
            return None
        node = node.all_input_nodes[0]
    return node


def _is_sum(node: fx.Node) -> bool:
    return node.target in _SUMS or (node.target is operator.getitem
                                    and node.args[0].target in NLL_FORWARD)


def _of_one_number(node: fx.Node) -> bool:
    """Whether `node` is a deterministic op whose only tensor input is a single number,
    and whose value is one: a function of that number alone."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) \
            or torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    ins = node.all_input_nodes
    vals = [n.meta.get(M.VAL) for n in (*ins, node)]
    return len(ins) == 1 and all(isinstance(v, torch.Tensor) and v.numel() == 1 for v in vals)


def _finish(count: fx.Node, total: fx.Node) -> fx.GraphModule | None:
    """What turns the summed count into the divisor (a cast, a clamp to at least 1,
    `+ 1e-8`), as a program of one input; None when the divisor is the sum itself.
    Applied to the global batch's sum, not to each shard's: clamp(sum of shards) is not
    the sum of clamps."""
    chain = []
    node = count
    while node is not total:
        chain.append(node)
        node = node.all_input_nodes[0]
    if not chain:
        return None
    graph = fx.Graph()
    value = graph.placeholder("total")
    for node in reversed(chain):
        value = graph.node_copy(node, lambda n, v=value: v)
    graph.output(value)
    return fx.GraphModule({}, graph)


def _reduction(node: fx.Node) -> int:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", MEAN)


def _weight(node: fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")


def _getitem(node: fx.Node, index: int) -> fx.Node | None:
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index),
                None)


def _user_placeholders(tg: TrainGraph, n_user: int) -> list[fx.Node]:
    first = len(tg.signature.params) + len(tg.signature.buffers)
    return tg.placeholders()[first:first + n_user]


def _divide_loss_by(build: NodeBuilder, tg: TrainGraph, loss: fx.Node, mean: fx.Node) -> None:
    """The step's loss, and the backward's seed (so every gradient), divided by `mean`."""
    divided = build.at(loss).call(aten.div.Tensor, (loss, mean), role=loss.meta[M.ROLE])
    seeds = [u for u in loss.users if u.target == aten.ones_like.default]
    output = next(iter(n for n in tg.graph.nodes if n.op == "output"))
    output.replace_input_with(loss, divided)
    for seed in seeds:
        # the seed stays ones_like(the step's loss), where the passes after this one look
        # for it (to average over dp ranks and micro-batches); the backward takes seed / mean
        seed.replace_input_with(loss, divided)
        scaled = build.at(seed).call(aten.div.Tensor, (seed, mean), role=M.Role.BACKWARD)
        seed.replace_all_uses_with(scaled, delete_user_cb=lambda user, s=scaled: user is not s)
    if len(seeds) != 1:
        raise ValueError(f"global_loss_mean: the joint graph seeds its backward with "
                         f"{len(seeds)} ones_like(loss) nodes, not one")


def _divide_nll_by(build: NodeBuilder, total: fx.Node, mean: fx.Node) -> None:
    """nll's output becomes its sum over the shard divided by the mean count (a sum, not
    the shard's mean times a ratio: a shard whose targets are all ignored has a mean of
    0/0); its backward divides by the mean count."""
    nll = total.args[0]
    for user in list(total.users):
        if user.target in NLL_BACKWARD:
            user.replace_input_with(total, mean)
    out = _getitem(nll, 0)
    if out is None:
        return
    nll.update_arg(3, SUM)
    divided = build.at(out).call(aten.div.Tensor, (out, mean), role=out.meta[M.ROLE])
    out.replace_all_uses_with(divided, delete_user_cb=lambda u: u is not divided)


def _subgraph(tg: TrainGraph, count: fx.Node, n_user: int) -> fx.GraphModule:
    """count as a function of the user inputs (every one, in order; it reads only some).
    nll's total weight is computed from its targets (and class weights) alone, so the
    subgraph reads no parameter and no logits."""
    needed: set[fx.Node] = set()
    stack = [count]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            inputs = node.all_input_nodes
            if node.target in NLL_FORWARD:
                inputs = [a for a in inputs if a is not node.args[0]]
            stack.extend(inputs)
    graph = fx.Graph()
    env = {p: graph.placeholder(p.name) for p in _user_placeholders(tg, n_user)}
    for node in tg.graph.nodes:
        if node not in needed or node in env:
            continue
        if node.target in NLL_FORWARD:
            env[node] = _nll_total_weight(graph, node, env)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[count])
    constants = {n.target: _attr(tg.gm, n.target) for n in graph.nodes if n.op == "get_attr"}
    return fx.GraphModule(constants, graph)


def _nll_total_weight(graph: fx.Graph, nll: fx.Node, env: dict) -> fx.Node:
    """(None, total weight): what nll's getitem 1 reads, from the targets alone: the
    class weight of each target that is not ignore_index (1 without class weights),
    summed. Running nll itself would need log-probabilities of the logits' size."""
    target = env[nll.args[1]]
    weight = _weight(nll)
    ignore = nll.args[4] if len(nll.args) > 4 else nll.kwargs.get("ignore_index", -100)
    dtype = nll.args[0].meta[M.VAL].dtype
    kept = graph.call_function(aten.ne.Scalar, (target, ignore))
    if weight is None:
        per_target = graph.call_function(aten._to_copy.default, (kept,), {"dtype": dtype})
    else:
        index = graph.call_function(aten.clamp_min.default, (target, 0))
        picked = graph.call_function(aten.index.Tensor, (env[weight], [index]))
        per_target = graph.call_function(aten.mul.Tensor, (picked, kept))
    total = graph.call_function(aten.sum.default, (per_target,))
    return graph.call_function(_pair, (total,))


def _pair(total: torch.Tensor) -> tuple[None, torch.Tensor]:
    return None, total


def _attr(module: torch.nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module
