"""Whether a step may be split along its batch, and what its loss is over the batch.

Data parallelism and micro-batches run the step on shards of the batch and average the
shards' losses and gradients. That equals the step on the whole batch when every sample
is computed apart from the others until the loss reduces over them with a mean. Code
that lets samples meet does not split:

- in-batch negatives: `a @ b.T` over the batch, scored against `arange(len(a))`;
- a statistic of the batch used in the forward: `x - x.mean(0)`, a softmax over dim 0;
- a value built with the batch's size rather than from the batch: `arange(n)` as labels;
- a ratio of two batch statistics that are not a count (`sum / mask.mean()`).

On shards each of these computes something else, and nothing fails. This analysis
finds them on the exported forward (model and loss, one node per aten op, before
autograd) and says where, as the module and source line the user wrote.

It propagates, from the batch inputs (split on dim 0) and the parameters (whole on
every rank), what each value is on a shard:

    d (an int)   the shard's block of a value split on dim d, as the batch is
    SUM, MEAN    a sum or mean over the batch's samples: the shard's part of it
    COUNT        a statistic of the data alone, no parameter (a token count, a clamp
                 of it): fine as the divisor the loss's mean takes (global_loss_mean
                 divides by the whole batch's count instead), nowhere else
    Same(dims)   the same on every shard, whatever the batch; `dims`: the dims along
                 which it is constant (an expand, a tensor of ones), where it may stand
                 for a split value's block

The rules per aten op are tensor parallelism's (tp_rules.py): a strategy of the op whose
input placements are the values' placements (a Same input whole, or split on a dim it
is constant along) and that needs no collective of its own gives the output's
placement; an op with no such strategy lets samples of different shards meet. What
tensor parallelism does not need is added here: batch norms in training mode (their
statistics are summed over the group by sync_batch_norm, and micro-batches refuse
them), losses with a `reduction` argument, and the arithmetic of batch sums and means
(affine maps of a mean; a sum over a count).

`split_loss` gives the loss's form over the batch: MEAN (each shard's loss is its mean:
their average is the batch's), SUM (each shard's loss is its sum: the batch's is their
sum, so the step scales it by the number of shards), or SAME (no sample reaches it).
The step is read at a second batch size (TraceSource.resized; `_Resized`): numbers,
constant tensors and fills that differ there are made from the shard's size, and a sum
divided by one is a mean over the batch (`_sized`). A shard of one sample is read as
the step exported at two samples of the batch: its batch dims of size 1 would read as
broadcast ones.
"""

from __future__ import annotations

import math
import operator
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.export.graph_signature import InputKind, OutputKind

from autopar.compiler.ir.annotate import module_of
from autopar.compiler.ir.trace import (
    TraceError,
    TraceSource,
    batch_dims_of,
    batch_size,
    forward_module,
)
from autopar.compiler.passes.tp_rules import (
    P,
    R,
    ShardingRuleError,
    Strategy,
    output_vals,
    strategies,
    tensor_inputs,
)

aten = torch.ops.aten

SUM, MEAN, COUNT, SAME = "sum", "mean", "count", "same"


@dataclass(frozen=True)
class Same:
    """The same value on every shard; constant along `dims` (where it may stand for the
    block of a value split there)."""

    dims: frozenset = frozenset()


class BatchSplitError(ValueError):
    """Samples of different shards meet in the step: split over dp or micro-batches it
    would compute something else. The message names the op, the module and the line."""


# in every BatchSplitError's first line: how a planner tells the refusal from the others
MEETS = "samples of different shards meet here"


# batch norms in training mode: their statistics are the batch's (sync_batch_norm sums
# them over the data-parallel group; a micro-batched step refuses them)
_BATCH_NORMS = frozenset({
    aten.batch_norm.default, aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
    aten.native_batch_norm.default, aten._batch_norm_with_update.default,
    aten._batch_norm_with_update_functional.default,
})
# ops that make a tensor of one value (constant along every dim)
_FILLS = frozenset({
    aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
    aten.scalar_tensor.default, aten.new_full.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_empty.default, aten.full_like.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
})
# the argument of a fill that holds its value
_FILL_VALUE = {aten.full.default: 1, aten.scalar_tensor.default: 0, aten.new_full.default: 2,
               aten.full_like.default: 1}
# the most elements of a value made with the shard's size that `_evaluated` computes
_SMALL = 64
_LIKE = frozenset({aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
                   aten.empty_like.default})
# an affine map of a mean is the mean of the map; a sum takes linear maps only
_ADD = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar,
                  aten.rsub.Scalar})
_SLICES = frozenset({aten.slice.Tensor, aten.narrow.default})
_DIVS = frozenset({aten.div.Tensor, aten.div.Scalar})
_MULS = frozenset({aten.mul.Tensor, aten.mul.Scalar})
# linear maps of one tensor that tensor parallelism's rules do not list: of a statistic,
# the same statistic
_LINEAR = frozenset({aten.sum.default, aten.squeeze.default, aten.clone.default,
                     aten.alias.default, aten.detach.default})

# embedding bags: (weight, indices, offsets, ..., per_sample_weights, ...)
_BAGS = frozenset({aten.embedding_bag.default, aten.embedding_bag.padding_idx,
                   aten._embedding_bag.default, aten._embedding_bag_forward_only.default})

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Split:
    """What the analysis found: the loss's form over the batch (MEAN, SUM or SAME), and
    the ops it took as keeping samples apart without a rule that proves it (`where` of
    each: an op no rule knows whose output keeps the batch's size, integer data a sort
    or an index rearranges), for the pass result to list."""

    form: str
    assumed: tuple[str, ...] = ()
    # False: the shard holds one sample, whose batch dims shapes cannot tell from
    # broadcast ones, and no export at two samples was read: samples meeting across
    # shards were not looked for; `unchecked` says why
    checked: bool = True
    unchecked: str = ""
    # why numbers made from the shard's size were not looked for ("" where they were:
    # the step was exported at a second batch size and its numbers compared)
    sizes_unread: str = ""


def split_loss(source: TraceSource) -> Split:
    """The form of the step's loss over the batch (module docstring), once per export.
    Raises BatchSplitError where samples of different shards would meet."""
    exported = source.exported
    if exported not in _CACHE:
        _CACHE[exported] = _analyse(source)
    found = _CACHE[exported]
    if isinstance(found, BatchSplitError):
        raise BatchSplitError(str(found))
    return found


def _analyse(source: TraceSource) -> Split | BatchSplitError:
    """The analysis of `source`, read on the step at two batch sizes where it can: the
    shard's own (another where it holds one sample) and a second one, whose numbers that
    differ are made from the shard's size."""
    size = _batch_size(source)
    main, other, unchecked, unread = source, None, "", ""
    if source.resized is None or size is None:
        unchecked = unread = "no batch of other sizes to export it at"
    elif size == 1:  # a batch dim of size 1 reads as a broadcast one: read another size
        try:
            main = source.resized(frozenset({1}))
        except (TraceError, LookupError) as exc:
            unchecked = f"the step does not export at two samples ({_first_line(exc)})"
            unread = "no second batch size"
        if main is not source:
            other = _other_size(source, frozenset({1, _batch_size(main)}))
            other = other if other is not None else source
    else:
        other = _other_size(source, frozenset({size}))
        if other is None:
            unread = "the step does not export at another batch size"
    try:
        resized = _Resized.read(main, other) if other is not None else None
        if other is not None and resized is None:
            unread = "its export at another batch size runs other ops"
        propagation = _Propagation(main, resized)
        form = propagation.run()
        return Split(form, tuple(where(n) for n in propagation.assumed),
                     not propagation.unchecked, unchecked if propagation.unchecked else "",
                     unread)
    except BatchSplitError as exc:  # kept, to raise again for each layout asked
        return exc


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _other_size(source: TraceSource, exclude: frozenset[int]) -> TraceSource | None:
    try:
        return source.resized(exclude)
    except (TraceError, LookupError):
        return None


def _batch_size(source: TraceSource) -> int | None:
    return batch_size(source.example_inputs)


@dataclass
class _Resized:
    """What differs between the step's forward at the shard's size (`main`) and at a
    second batch size (`other`), the two run op for op: what is made from the shard's
    size. `numbers`: node -> [(argument, number here, number there)], the argument a
    position (an int), a position in a list (position, index) or a keyword (its name);
    `constants`: the step's constant tensors (`torch.tensor(x.shape[0])`) whose values
    differ -> (value here, value there) where they are small (`_SMALL`), else None; `shapes`:
    node -> (shape here, shape there) of each output that differs."""

    size: int
    other_size: int
    numbers: dict[fx.Node, list[tuple[Any, float, float]]]
    constants: dict[fx.Node, tuple[torch.Tensor, torch.Tensor] | None]
    shapes: dict[fx.Node, tuple[tuple[int, ...], tuple[int, ...]]]

    @classmethod
    def read(cls, main: TraceSource, other: TraceSource) -> _Resized | None:
        """None where the two do not run the same ops in the same order."""
        ours, theirs = forward_module(main).graph, forward_module(other).graph
        calls = [[n for n in g.nodes if n.op == "call_function"] for g in (ours, theirs)]
        if len(calls[0]) != len(calls[1]) or any(a.target != b.target for a, b in zip(*calls)):
            return None
        numbers: dict[fx.Node, list[tuple[Any, float, float]]] = {}
        shapes = {}
        for a, b in zip(*calls):
            for key, x, y in _argument_numbers(a, b):
                if x != y:
                    numbers.setdefault(a, []).append((key, x, y))
            here, there = a.meta.get("val"), b.meta.get("val")
            if isinstance(here, torch.Tensor) and isinstance(there, torch.Tensor) \
                    and here.shape != there.shape:
                shapes[a] = (tuple(here.shape), tuple(there.shape))
        constants = {}
        theirs_by_target = {n.target: n for n in theirs.nodes if n.op == "placeholder"}
        specs = {s.arg.name: s for s in main.exported.graph_signature.input_specs}
        for node in ours.nodes:
            spec = specs.get(node.name)
            if node.op != "placeholder" or spec is None or spec.kind != InputKind.CONSTANT_TENSOR:
                continue
            here = main.exported.constants.get(spec.target)
            there = other.exported.constants.get(spec.target)
            if node.target not in theirs_by_target or not isinstance(here, torch.Tensor) \
                    or not isinstance(there, torch.Tensor) or "meta" in (
                        here.device.type, there.device.type):  # (no values to compare)
                continue
            if here.shape != there.shape or not torch.equal(here, there):
                small = max(here.numel(), there.numel()) <= _SMALL
                constants[node] = (here, there) if small else None
        return cls(_batch_size(main), _batch_size(other), numbers, constants, shapes)


def _argument_numbers(a: fx.Node, b: fx.Node):
    """(argument, number of `a`, number of `b`) for each number argument of two calls of
    one op, paired by position (in lists too) and keyword."""
    pairs = [(k, x, y) for k, (x, y) in enumerate(zip(a.args, b.args))]
    pairs += [(name, a.kwargs[name], b.kwargs[name]) for name in a.kwargs if name in b.kwargs]
    for key, x, y in pairs:
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            yield from (((key, i), u, v) for i, (u, v) in enumerate(zip(x, y))
                        if _number(u) and _number(v))
            if len(x) != len(y):
                yield (key, "len"), len(x), len(y)
        elif _number(x) and _number(y):
            yield key, x, y


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Propagation:
    def __init__(self, source: TraceSource, resized: _Resized | None = None):
        self.gm = forward_module(source)
        # what is made from the shard's size (_Resized, read at a second batch size), the
        # values computed with it (`sized`) and, of those, the small ones' values here and
        # at the other size (`values`: computed from the numbers, `_evaluated`)
        self.resized = resized
        self.numbers = resized.numbers if resized is not None else {}
        self.size = _batch_size(source)
        self.other_size = resized.other_size if resized is not None else None
        self.sized: set[fx.Node] = set(resized.constants) if resized is not None else set()
        self.values: dict[fx.Node, tuple[torch.Tensor, torch.Tensor]] = {
            n: v for n, v in resized.constants.items() if v is not None} if resized else {}
        signature = source.exported.graph_signature
        self.kinds = [spec.kind for spec in signature.input_specs]
        self.output_kinds = [spec.kind for spec in signature.output_specs]
        self.env: dict[fx.Node, object] = {}
        self.from_params: set[fx.Node] = set()
        self.assumed: list[fx.Node] = []  # ops taken as per sample with no rule (_assumed)
        # a shard of one sample: its batch dims have size 1, which shapes cannot tell
        # from a broadcast one; read at two samples (_analyse), else nothing is refused
        # and the result says unchecked
        self.unchecked = False
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        users = [n for n, kind in zip(placeholders, self.kinds) if kind == InputKind.USER_INPUT]
        vals = [n.meta.get("val") for n in users]
        dims = batch_dims_of([v for v in vals if isinstance(v, torch.Tensor)])
        self.split = dict(zip([n for n, v in zip(users, vals) if isinstance(v, torch.Tensor)], dims))
        sizes = {n.meta["val"].shape[d] for n, d in self.split.items() if d is not None}
        self.one_sample = sizes == {1}

    def run(self) -> str:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        split = self.split
        for node, kind in zip(placeholders, self.kinds):
            if kind == InputKind.USER_INPUT and split.get(node) is not None:
                self.env[node] = split[node]
            else:
                self.env[node] = Same()
                if kind == InputKind.PARAMETER:
                    self.from_params.add(node)
        loss = None
        for node in self.gm.graph.nodes:
            if node.op == "get_attr":
                self.env[node] = Same()
            elif node.op == "call_function":
                if any(a in self.from_params for a in _computed_from(node)):
                    self.from_params.add(node)
                self.env[node] = self._visit(node)
            elif node.op == "output":
                outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
                specs = self.output_kinds
                users = [o for o, kind in zip(outs, specs) if kind == OutputKind.USER_OUTPUT]
                loss = users[0] if users else outs[-1]
        form = self.env.get(loss) if isinstance(loss, fx.Node) else None
        if form in (SUM, MEAN):
            return form
        if isinstance(form, Same) or form is None:
            return SAME
        return self._refuse(loss, "the loss is not a sum or mean over the batch's samples "
                            f"(on a shard it would be {_show(form)})", MEAN)

    # -- one op -------------------------------------------------------------------------

    def _visit(self, node: fx.Node):
        if node.target is operator.getitem:
            src = self.env[node.args[0]]
            return src[node.args[1]] if isinstance(src, tuple) else src
        ins = tensor_inputs(node)
        places = [self.env[a] for a in ins]
        n_out = len(output_vals(node))
        if not n_out:
            return Same()  # (an assertion on metadata)
        if node.target is aten.broadcast_tensors.default and all(
                v is not None and v.shape == a.meta["val"].shape
                for v, a in zip(output_vals(node), ins)):
            return tuple(places)  # nothing to broadcast (mse_loss of equal shapes)
        if all(isinstance(p, Same) for p in places) and self._made_from_size(node, ins) \
                and (found := self._size_made(node, ins, places)) is not None:
            return found
        if _is_pointwise(node.target) and (node in self.numbers
                                           or any(a in self.sized for a in ins)):
            found = self._sized(node, ins, places)
            if found is not None:
                return found
        elif any(a in self.sized for a in ins):
            return self._refuse(node, f"{node.target} takes "
                                f"{next(a for a in ins if a in self.sized).name}, computed "
                                f"with a number made from the shard's size ({self.size} "
                                f"samples here; the batch has more), which the whole batch's "
                                f"step would compute at its own size", places[0])
        multi = not isinstance(node.meta.get("val"), torch.Tensor)
        if node.target in _FILLS and not (node.target in _LIKE and isinstance(places[0], int)):
            return self._each(node, multi, lambda v: Same(frozenset(range(v.dim()))))
        if all(isinstance(p, Same) for p in places):
            return self._each(node, multi, lambda v: Same(self._constant_dims(node, places)))
        if node.target in _BATCH_NORMS and isinstance(places[0], int) and places[0] == 0:
            # out split as x; saved statistics and running statistics: one per channel
            return (0,) + tuple(Same() for _ in range(n_out - 1)) if multi else 0
        if node.target in _LIKE:
            return places[0]
        reduction = _reduction(node)
        if reduction is not None:
            return self._loss(node, places, reduction)
        if any(p in (SUM, MEAN, COUNT) and not _integral(a) for a, p in zip(ins, places)):
            return self._batch_statistic(node, ins, places)
        if node.target is aten.index.Tensor and (found := self._index(node, places)) is not None:
            return found
        if node.target in _BAGS and (found := _bags(node, places)) is not None:
            return found
        if node.target in _SLICES and _whole(node):
            return places[0]
        try:
            out = self._propagate(node, places)
        except _NoRule:
            return self._assumed(node, places)
        return self._meet(node, places) if out is None else out

    def _propagate(self, node: fx.Node, places: list):
        """The output placement(s) of `node` on inputs placed as `places`, or None where
        the op cannot run on them as they are (samples of different shards meet). The
        op's tensor-parallel rule first (tp_rules: the common ops, fast), else DTensor's
        sharding propagation on a one-dimensional mesh; _NoRule if neither knows it."""
        found = self._strategy(node, places)
        if found is not None:
            if node.target is aten.mean.dim and P in found.outputs():
                return MEAN
            out = found.output
            return tuple(self._placed(o) for o in out) if isinstance(out, tuple) \
                else self._placed(out)
        return _dtensor_placement(node, places)

    @staticmethod
    def _each(node: fx.Node, multi: bool, make):
        if not multi:
            return make(node.meta["val"])
        return tuple(make(v) if v is not None else Same() for v in output_vals(node))

    def _placed(self, p):
        if p == P:
            return SUM
        return Same() if p == R else p

    def _strategy(self, node: fx.Node, places: list) -> Strategy | None:
        """The first strategy of the op whose inputs are the values as they are (a Same
        value whole, or split where it is constant), with no collective of its own."""
        try:
            options = strategies(node, 1)
        except ShardingRuleError:
            return None
        for s in options:
            if s.comm or (s.lowering not in (None, "mean_over_shards")):
                continue
            if all(_takes(have, want) for have, want in zip(places, s.inputs)) \
                    and any(want != R for want in s.inputs):
                return s
        return None

    def _constant_dims(self, node: fx.Node, places: list) -> frozenset:
        """The output dims of an op on Same values along which it is constant: dims of
        size 1, those an expand made, and each dim c where the op, given each input as
        if split on its dim aligned with c (where it is constant along it), gives an
        output split on c."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return frozenset()
        dims = {d for d in range(val.dim()) if val.shape[d] == 1}
        ins = tensor_inputs(node)
        if node.target is aten.expand.default:
            x = node.args[0].meta["val"]
            lead = val.dim() - x.dim()
            dims |= {d for d in range(val.dim()) if d < lead or x.shape[d - lead] == 1}
        if node.target is aten.repeat.default:
            # a tiled dim: the whole batch's tiling, cut in blocks, is this tiling again
            lead = len(node.args[1]) - node.args[0].meta["val"].dim()
            dims |= {d for d, times in enumerate(node.args[1]) if times > 1 or
                     (d >= lead and d - lead in places[0].dims)}
        if not any(p.dims for p in places):
            return frozenset(dims)  # (parameters, arange: nothing constant to carry)
        if node.target is aten.index.Tensor:
            return frozenset(dims | _indexed_constant_dims(node, self.env))
        if _is_pointwise(node.target):
            for c in range(val.dim()):
                if all(_aligned_constant(a.meta["val"], p, c - (val.dim() - a.meta["val"].dim()))
                       for a, p in zip(ins, places)):
                    dims.add(c)
            return frozenset(dims)
        for c in range(val.dim()):
            if c in dims:
                continue
            for right in (True, False):  # inputs aligned as broadcasting does, or by index
                trial = []
                for a, p in zip(ins, places):
                    aligned = c - (val.dim() - a.meta["val"].dim()) if right else c
                    trial.append(aligned if 0 <= aligned < a.meta["val"].dim()
                                 and aligned in p.dims and a.meta["val"].shape[aligned] > 1
                                 else Same())
                if not any(isinstance(t, int) for t in trial):
                    continue
                try:
                    if self._propagate(node, trial) == c:
                        dims.add(c)
                        break
                except _NoRule:
                    pass
        return frozenset(dims)

    def _rows(self, node: fx.Node, places: list):
        """Integer data of the shard's rows an op rearranges (a sort of the tokens' expert
        ids, an inverse permutation): split on dim 0 where an output keeps the size of a
        dim 0 split input, else a count of the shard (the tokens per expert). Taken to
        index the shard's own rows, which static placements cannot prove."""
        sizes = {a.meta["val"].shape[0] for a, p in zip(tensor_inputs(node), places) if p == 0}
        keeps = [v is not None and v.dim() > 0 and v.shape[0] in sizes for v in output_vals(node)]
        self.assumed.append(node)
        if isinstance(node.meta.get("val"), torch.Tensor):
            return 0 if keeps[0] else COUNT
        return tuple(0 if k else COUNT for k in keeps)

    def _index(self, node: fx.Node, places: list):
        """x[idx] with one index tensor (integer data split on its own dim e) on dim k: of x
        the same on every shard (a table: rotary cos[position_ids]) the rows each sample
        picks, split on the output's dim k + e; of x split on k, the shard's rows
        rearranged (taken as the shard's own), likewise; with an index the same on every
        shard, on another dim than x's split one: x's split dim, moved past the index's
        dims. None for any other indexing."""
        x, indices = node.args[0], node.args[1]
        tensors = [(k, i) for k, i in enumerate(indices) if i is not None]
        place = self.env.get(x)
        if len(tensors) != 1:
            return None
        k, index = tensors[0]
        idx = self.env.get(index)
        if isinstance(idx, Same) and isinstance(place, int) and place != k:
            # the same picks from every sample, along another dim than the batch's
            return place if place < k else place + index.meta["val"].dim() - 1
        if not isinstance(idx, int) or index.meta["val"].is_floating_point():
            return None
        if isinstance(place, Same):
            return k + idx  # rows of a table every shard holds, per sample (an embedding)
        return place + idx if place == k else None

    def _assumed(self, node: fx.Node, places: list):
        """An op no rule knows (tensor parallelism's nor DTensor's): taken as per sample
        when every split input is split on dim 0 and each output keeps dim 0's size, and
        listed (`assumed`); else an error naming it."""
        split = {p for p in places if isinstance(p, int)}
        outs = output_vals(node)
        sizes = {a.meta["val"].shape[0] for a, p in zip(tensor_inputs(node), places) if p == 0}
        if split == {0} and len(sizes) == 1 and outs and all(
                v is not None and v.dim() > 0 and v.shape[0] in sizes for v in outs) \
                and not any(p in (SUM, MEAN, COUNT) and not _integral(a)
                            for a, p in zip(tensor_inputs(node), places)):
            self.assumed.append(node)
            return 0 if isinstance(node.meta.get("val"), torch.Tensor) else tuple(0 for _ in outs)
        if node not in self.from_params:
            return COUNT
        if _integral(node):
            return self._rows(node, places)
        return self._refuse(node, f"no rule says how {node.target} treats the batch's "
                            "samples, and its output does not keep them along dim 0", 0)

    # -- losses and batch statistics ------------------------------------------------------

    def _loss(self, node: fx.Node, places: list, reduction: int):
        """An op with a `reduction` argument (cross_entropy, mse_loss, nll_loss, ...):
        its input and target are split on the batch (dim 0) or the same on every shard;
        its other tensors (class weights) are whole."""
        for k, (arg, p) in enumerate(zip(tensor_inputs(node), places)):
            batch_arg = k < 2
            ok = (p == 0 or (isinstance(p, Same) and 0 in p.dims)) if batch_arg and \
                arg.meta["val"].dim() > 0 else isinstance(p, Same)
            if not ok:
                return self._meet(node, places)
        return 0 if reduction == 0 else (MEAN if reduction == 1 else SUM)

    def _batch_statistic(self, node: fx.Node, ins: list[fx.Node], places: list):
        """An op on a sum or mean over the batch (or on a count of the data)."""
        kinds = {p for p in places if p in (SUM, MEAN, COUNT)}
        rest_same = all(isinstance(p, Same) for p in places if p not in (SUM, MEAN, COUNT))
        target = node.target
        if len(kinds) == 1 and COUNT not in kinds and rest_same:
            kind = next(iter(kinds))
            stats = [k for k, p in enumerate(places) if p == kind]
            if target in _ADD:
                # a sum of statistics; a mean plus a constant is the mean of the sums
                if len(stats) == len(places) or kind == MEAN:
                    return kind
            elif target in (aten.mul.Tensor, aten.mul.Scalar, aten.neg.default):
                if len(stats) == 1:  # scaled by a constant
                    return kind
            elif target in (aten.div.Tensor, aten.div.Scalar):
                if stats == [0]:
                    return kind
            elif self._strategy(node, places) is not None or \
                    (target in _LINEAR and len(places) == 1):
                return kind  # a view, a cast, a slice or a sum of it: the same statistic
        if target is aten.div.Tensor and len(ins) == 2 and places[0] == SUM \
                and places[1] in (SUM, COUNT) and ins[1] not in self.from_params \
                and ins[1] not in self.sized:
            return MEAN  # a sum over a count of the batch's data (global_loss_mean's)
        return self._meet(node, places)

    def _made_from_size(self, node: fx.Node, ins: list[fx.Node]) -> bool:
        """Whether an op follows the shard's size: it takes a number made from it or a
        value computed with one, or its output's or an input's shape differs at the
        other size."""
        return node in self.numbers or any(a in self.sized for a in ins) or (
            self.resized is not None and any(n in self.resized.shapes for n in [node, *ins]))

    def _size_made(self, node: fx.Node, ins: list[fx.Node], places: list):
        """An op on values the same on every shard that follows the shard's size. Where
        its output's shape does (a fill of the shard's size, `arange(n)`, positions
        expanded to its samples): None, the usual rules (Same, constant along the dims
        they find); where it reduces that dim away, `_reduced_samples`. Where it takes a
        number made from the size as a value, or a value computed with one, it is made
        with the shard's size (`sized`: the same on every shard, another on the whole
        batch); where it is small (a constant such as `torch.tensor(x.shape[0])`, a
        fill, arithmetic on those), its values at both sizes are computed for `_sized`
        (`_evaluated`)."""
        fill = _FILL_VALUE.get(node.target)
        shapes = self.resized.shapes.get(node)
        valued = any(a in self.sized for a in ins) or any(
            key == fill or (shapes is None and node.target not in _FILLS)
            for key, *_ in self.numbers.get(node, []))
        if not valued:
            return None if shapes is not None else self._reduced_samples(node, ins, places)
        self.sized.add(node)
        value = self._evaluated(node, ins)
        if value is not None:
            self.values[node] = value
        multi = not isinstance(node.meta.get("val"), torch.Tensor)
        return self._each(node, multi, lambda v: Same())

    def _evaluated(self, node: fx.Node, ins: list[fx.Node]
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The values of a small op made with the shard's size at both sizes, run on its
        inputs' values (`values`) and its numbers at each size; None where an input's or
        its output's value is not known or not small, or the op cannot run here."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() > _SMALL \
                or any(a not in self.values for a in ins):
            return None
        there_numbers = {key: y for key, _, y in self.numbers.get(node, [])}
        if any(isinstance(key, tuple) and key[1] == "len" for key in there_numbers):
            return None

        def at(k: int):
            def arg(key, x):
                if isinstance(x, fx.Node):
                    return self.values[x][k]
                if isinstance(x, (list, tuple)):
                    return type(x)(arg((key, i), u) for i, u in enumerate(x))
                return there_numbers.get(key, x) if k else x
            return ([arg(i, x) for i, x in enumerate(node.args)],
                    {name: arg(name, x) for name, x in node.kwargs.items()})
        try:
            with torch.no_grad():
                out = [node.target(*args, **kwargs) for args, kwargs in (at(0), at(1))]
        except Exception:  # noqa: BLE001 - an op that does not run on these: no value
            return None
        if not all(isinstance(o, torch.Tensor) and o.device.type != "meta" for o in out):
            return None
        return out[0], out[1]

    def _reduced_samples(self, node: fx.Node, ins: list[fx.Node], places: list):
        """An op that reduces away the dim of the shard's size of values constant along
        it (`torch.ones(n).sum()`: the shard's count of samples): each such input is the
        shard's block of the batch's value, split there, and the op's rule on those
        decides. A sum of the data alone is a COUNT (global_loss_mean divides by the
        batch's). None (the usual rules) where no input is such a block or the rule gives
        anything else (`x.new_ones(())` reads only its input's dtype)."""
        trial, blocks = [], False
        for a, p in zip(ins, places):
            here, there = self.resized.shapes.get(a, ((), ()))
            differs = [d for d, (u, v) in enumerate(zip(here, there)) if u != v]
            block = len(differs) == 1 and differs[0] in p.dims and math.isclose(
                here[differs[0]] / there[differs[0]], self.size / self.other_size)
            trial.append(differs[0] if block else p)
            blocks = blocks or block
        if not blocks:
            return None
        try:
            out = self._propagate(node, trial)
        except _NoRule:
            return None
        if out == SUM and node not in self.from_params:
            return COUNT
        return None

    def _sized(self, node: fx.Node, ins: list[fx.Node], places: list):
        """A pointwise op on a number made from the shard's size (one that differs in the
        export at another batch size), or on a value computed with one: a sum over the
        shard divided by its number of samples (or of tokens) is a mean over the batch,
        a mean times it a sum; of the data alone or the same on every shard, it is a
        value made with the shard's size (`sized`, not a count to divide by); anything
        else would compute another value on the whole batch. None: the usual rules."""
        numbers = self.numbers.get(node, []) + [
            (k, self.values[a][0].item(), self.values[a][1].item())
            for k, a in enumerate(node.args) if a in self.values and self.values[a][0].numel() == 1
            and self.values[a][1].numel() == 1]
        if len(numbers) == 1 and not any(a in self.sized and (a not in self.values or
                                                              self.values[a][0].numel() != 1)
                                         for a in ins):
            (k, here, there), = numbers
            ratio = self.other_size / self.size
            rest_same = all(isinstance(p, Same) for p in places[1:])
            if k == 1 and places[:1] == [SUM] and rest_same and (
                    (node.target in _DIVS and math.isclose(there / here, ratio))
                    or (node.target in _MULS and math.isclose(here / there, ratio))):
                return MEAN
            if k == 1 and places[:1] == [MEAN] and rest_same and node.target in _MULS \
                    and math.isclose(there / here, ratio):
                return SUM
        if all(isinstance(p, Same) or p == COUNT for p in places):
            self.sized.add(node)
            return None
        made = f"the number {numbers[0][1]}" if numbers else \
            f"{next(a for a in ins if a in self.sized).name}, computed with a number"
        return self._refuse(node, f"{node.target} takes {made} made from the shard's size "
                            f"({self.size} samples here; the batch has more), which the "
                            f"whole batch's step would take at its own size", places[0])

    # -- errors ----------------------------------------------------------------------------

    def _meet(self, node: fx.Node, places: list):
        """Samples of different shards meet in `node`. Of the data alone (no parameter:
        a count, a mask's sum, a clamp of one) it is a statistic the loss may divide by
        (global_loss_mean takes the whole batch's); integer data (indices, positions,
        counts: a mixture of experts sorting its tokens by expert) is the shard's own
        rows rearranged (`_rows`); else an error."""
        if node not in self.from_params:
            return COUNT
        if _integral(node):
            return self._rows(node, places)
        ins = ", ".join(_show(p) for p in places)
        kept = next((p for p in places if p in (SUM, MEAN)), None)
        kept = kept if kept is not None else next((p for p in places if isinstance(p, int)), COUNT)
        return self._refuse(node, f"{node.target} takes ({ins}) on a shard: no way to run it "
                            "on each shard's samples apart", kept)

    def _refuse(self, node: fx.Node, what: str, unchecked):
        """Raise the error; on a shard of one sample, go on with `unchecked` instead."""
        if self.one_sample:
            self.unchecked = True
            return unchecked
        raise self._error(node, what)

    def _error(self, node: fx.Node, what: str) -> BatchSplitError:
        return BatchSplitError(
            f"{where(node)}: {MEETS}, so the step does not split along the batch: {what}. "
            f"Data parallelism and micro-batches run each shard apart and average the "
            f"results, which would compute something else "
            f"(in-batch negatives such as `a @ b.T` scored against `arange(len(a))`, a "
            f"statistic of the batch such as `x - x.mean(0)`, a ratio of two batch "
            f"means). Train it with dp=1 and microbatches=1, or compute that part "
            f"per sample")


def _bags(node: fx.Node, places: list):
    """An embedding bag of equal bags split on the batch (2-D indices, which
    nn.EmbeddingBag flattens with offsets `arange(0, n * size, size)`): each output (the
    bags, and its integer bookkeeping) split on dim 0. None for any other form (bags of
    their own sizes given by offsets)."""
    args = list(node.args) + [None] * (9 - len(node.args))
    weight, indices, offsets, include_last = args[0], args[1], args[2], args[7]
    by_node = dict(zip(tensor_inputs(node), places))
    if not isinstance(by_node.get(weight), Same) or by_node.get(indices) != 0 or include_last:
        return None
    if offsets is not None:
        equal = offsets.target in (aten.arange.start_step, aten.arange.default, aten.arange.start) \
            and indices.meta["val"].dim() == 1 and offsets.meta["val"].numel() > 0 \
            and indices.meta["val"].shape[0] % offsets.meta["val"].shape[0] == 0 \
            and float(offsets.args[-1] if offsets.target is aten.arange.start_step else 1) \
            * offsets.meta["val"].shape[0] == indices.meta["val"].shape[0]
        if not equal:
            return None
    elif indices.meta["val"].dim() != 2:
        return None
    if any(p != 0 and not isinstance(p, Same) for p in places):
        return None
    return tuple(0 for _ in output_vals(node)) \
        if not isinstance(node.meta.get("val"), torch.Tensor) else 0


def _indexed_constant_dims(node: fx.Node, env: dict) -> set[int]:
    """x[i0, i1, ...] (index tensors from dim 0 on, broadcast together): an output dim of
    the indices' broadcast is constant where every index into a dim x is not constant
    along is constant along it (masks built by indexing a padding mask with the batch's
    `arange`: what that index picks is the same row); a dim after them, where x's is."""
    x, indices = node.args[0], list(node.args[1])
    if any(i is None for i in indices):
        return set()
    x_dims = env[x].dims
    shapes = [i.meta["val"].shape for i in indices]
    rank = max(len(shape) for shape in shapes)
    out = set()
    for d in range(rank):
        if all(k in x_dims or _aligned_constant(i.meta["val"], env[i], d - (rank - len(shape)))
               for k, (i, shape) in enumerate(zip(indices, shapes))):
            out.add(d)
    out |= {rank + d - len(indices) for d in x_dims if d >= len(indices)}
    return out


def _integral(node: fx.Node) -> bool:
    """Whether every tensor `node` gives is integer or bool (indices, masks, counts)."""
    vals = [v for v in output_vals(node) if v is not None]
    return bool(vals) and not any(v.is_floating_point() or v.is_complex() for v in vals)


# elementwise with broadcasting, without PyTorch's pointwise tag
_ELEMENTWISE = frozenset({aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
                          aten.masked_fill.Tensor, aten.to.dtype, aten._to_copy.default,
                          aten.to.dtype_layout, aten.clone.default, aten.alias.default})


def _is_pointwise(op) -> bool:
    return op in _ELEMENTWISE or (isinstance(op, torch._ops.OpOverload)
                                  and torch.Tag.pointwise in op.tags)


def _aligned_constant(val: torch.Tensor, p: Same, d: int) -> bool:
    """Whether an input broadcast against an output is constant along output dim d (its
    aligned dim `d`): it lacks the dim, has size 1 there, or is constant along it."""
    return d < 0 or val.shape[d] == 1 or d in p.dims


def _takes(have, want) -> bool:
    if isinstance(have, Same):
        return want == R or (isinstance(want, int) and want in have.dims)
    if have in (SUM, MEAN):
        return want == P
    return have == want


def _whole(node: fx.Node) -> bool:
    """A slice that keeps the whole dim (`x[:, None]` exports one on dim 0)."""
    x = node.args[0].meta["val"]
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if node.target is aten.narrow.default:
        return start == 0 and end == x.shape[dim]
    return (start or 0) == 0 and (end is None or end >= x.shape[dim]) and step == 1


def _reduction(node: fx.Node) -> int | None:
    """The `reduction` argument of a loss op (0 none, 1 mean, 2 sum), None if it has none."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for k, arg in enumerate(schema.arguments):
        if arg.name == "reduction":
            if k < len(node.args):
                return int(node.args[k])
            return int(node.kwargs.get("reduction", arg.default_value))
    return None


def _show(p) -> str:
    if isinstance(p, Same):
        return "the same on every shard"
    if isinstance(p, int):
        return f"its block of dim {p}"
    return {SUM: "a part of a sum over the batch", MEAN: "a part of a mean over the batch",
            COUNT: "a statistic of the shard's data"}[p]


def _computed_from(node: fx.Node) -> list[fx.Node]:
    """The nodes `node`'s value is computed from: its inputs, but for an output of
    broadcast_tensors only the tensor it broadcasts (`mse_loss` broadcasts the model's
    output with the targets, which the loss may then read again for a count)."""
    src = node.args[0] if node.target is operator.getitem else None
    if isinstance(src, fx.Node) and src.target is aten.broadcast_tensors.default:
        return [src.args[0][node.args[1]]]
    return node.all_input_nodes


def where(node: fx.Node) -> str:
    """The op, its module and the line of the user's code it comes from ("in the loss
    function" for the loss's ops: export records no frame inside loss_fn)."""
    path, kind = module_of(node)
    module = f" in module {path} ({kind.rsplit('.', 1)[-1]})" if path else ""
    line = _user_line(node)
    if line is None and not path:
        return f"{node.target} in the loss function"
    return f"{node.target}{module}" + (f" at {line}" if line else "")


def _user_line(node: fx.Node) -> str | None:
    """The innermost frame of the stack trace outside torch and autopar's compiler."""
    trace = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    skipped = (f"{os.sep}torch{os.sep}", f"{os.sep}autopar{os.sep}compiler{os.sep}")
    for frame in reversed(frames):
        parts = frame.split('"')
        if len(parts) >= 3 and not any(s in parts[1] for s in skipped):
            return f"{parts[1]}:{parts[2].split(',')[1].split()[-1]}"
    return None


class _NoRule(Exception):
    """Neither tensor parallelism's rules nor DTensor's know the op."""


_MESH: list[DeviceMesh] = []


def _mesh() -> DeviceMesh:
    """A one-dimensional mesh of 2 ranks for DTensor's sharding propagation, which reads
    placements and shapes only: no process group (the planner has none)."""
    if not _MESH:
        _MESH.append(DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=0))
    return _MESH[0]


def _dtensor_placement(node: fx.Node, places: list):
    """DTensor's output placement(s) of `node`, its inputs placed as `places` (the local
    shapes stand for the global ones: the rules read which dims are split, and shapes
    where they check a dim divides), or None where DTensor would move an input to
    another placement than the one it has (a Same input may take the block of a dim it
    is constant along)."""
    mesh = _mesh()
    by_node = dict(zip(tensor_inputs(node), places))

    def spec(arg):
        if isinstance(arg, fx.Node) and arg in by_node:
            val, p = arg.meta["val"], by_node[arg]
            placement = Shard(p) if isinstance(p, int) else Partial("sum") if p == SUM \
                else Partial("avg") if p == MEAN else Replicate()
            return DTensorSpec(mesh, (placement,), TensorMeta(val.shape, val.stride(), val.dtype))
        return arg

    args, kwargs = fx.node.map_aggregate((node.args, dict(node.kwargs)), spec)
    try:
        # (not the cached entry point: its key reads an op's non-tensor arguments, such as
        # cumsum's dim, only through schema information DTensor's own dispatch attaches)
        sharding = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached(
            OpSchema(node.target, tuple(args), kwargs))
    except Exception as exc:  # noqa: BLE001 - an op or a form DTensor has no rule for
        raise _NoRule() from exc
    if sharding.redistribute_schema is not None:
        schema = sharding.redistribute_schema
        wanted = _specs((schema.args_schema, dict(schema.kwargs_schema)))
        if len(wanted) != len(places):
            raise _NoRule()
        for have, want in zip(places, wanted):
            target = want.placements[0]
            if isinstance(have, int) and target == Shard(have):
                continue
            if have == SUM and target == Partial("sum") or have == MEAN and target == Partial("avg"):
                continue
            if isinstance(have, Same) and (target.is_replicate() or (
                    target.is_shard() and target.dim in have.dims)):
                continue
            return None
    specs = sharding.output_spec
    if isinstance(specs, (tuple, list)):
        return tuple(_placed_from(s) for s in specs)
    return _placed_from(specs)


def _specs(tree) -> list[DTensorSpec]:
    found = []
    fx.node.map_aggregate(tree, lambda a: found.append(a) if isinstance(a, DTensorSpec) else a)
    return found


def _placed_from(spec):
    if spec is None:
        return Same()
    p = spec.placements[0]
    if p.is_shard():
        return p.dim
    if p.is_partial():
        return MEAN if getattr(p, "reduce_op", "sum") == "avg" else SUM
    return Same()
