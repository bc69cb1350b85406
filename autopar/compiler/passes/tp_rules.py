"""Sharding rules: for each forward op, the placements on the tensor-parallel mesh
dimension under which it can run on local shards.

A placement says how one tensor lives on the `tp` ranks:

    "R"   replicated: every rank holds all of it
    "P"   partial sum: every rank holds a full-shaped term, the value is their sum
    d     (an int) sharded: rank r holds the r-th of tp equal blocks along dim d
    Strided(d, k)  sharded in pieces: dim d is k equal pieces side by side (q, k and v
          of a fused projection) and rank r holds the r-th block of each piece, so that
          splitting d into its k pieces leaves each piece sharded on d

A Strategy of an op names the placement each tensor input must have, the placement
of its output(s), which fraction of the op's work one rank does, and (for the few
ops whose local form is not the op itself) a lowering the TensorParallel hook
applies. Every op has the all-replicated strategy, so any graph has a valid plan.

Where the rules come from:
- views (view, reshape, expand, transpose, permute, unsqueeze, squeeze, flatten)
  reuse torch.distributed.tensor's dimension maps (`_view_ops.dim_maps` and
  `view_groups`): which output dim each input dim becomes, through flattening and
  splitting;
- pointwise ops are recognised by PyTorch's own `pointwise` op tag, with
  broadcasting;
- contractions (linear, mm, addmm, bmm, and matmul with broadcast batch dims) by their
  einsum form: shard any index;
  an index the output keeps gives a sharded output, a contracted one a partial sum;
- a handful of ops have their own rule (attention, embedding, cross-entropy,
  layer norm, softmax, reductions, slice/cat/split/select).
DTensor's strategy functions themselves are not called: they need a live
DeviceMesh and DTensorSpecs, cover no CPU flash-attention op, and their local
compute (vocabulary masks, view shapes) lives in DTensor's runtime dispatch, which
a traced program does not go through. See docs/tensor_parallel.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.fx as fx
from torch.distributed.tensor._ops._view_ops import (
    Flatten,
    InputDim,
    Singleton,
    Split,
    dim_maps,
    view_groups,
)
from torch.utils._pytree import tree_flatten

from autopar.compiler.ir.annotate import module_of, source_of
from autopar.compiler.ir.pieces import Pieces, pieces_fit

aten = torch.ops.aten


@dataclass(frozen=True)
class Strided:
    """Dim `dim` seen as pieces side by side, each split in tp blocks: rank r holds
    block r of every piece, side by side. `pieces`: k equal pieces, or the pieces' sizes
    along the dim (compiler/ir/pieces.py). GPT-2's fused projection writes q, k and v
    side by side along one dim: with its weight Strided(1, 3), q, k and v each come out
    split by heads; Phi-3's with grouped key-value heads, Strided(0, (h, kv, kv)). With
    equal pieces, on one mesh dim, it is DTensor's `_StridedShard(dim,
    split_factor=pieces)`; a checkpoint stores it re-cut to plain blocks
    (runtime/shards.py `recut`), as DCP writes one box of the whole per rank."""

    dim: int
    pieces: Pieces

    def _key(self) -> tuple:
        sizes = self.pieces if isinstance(self.pieces, tuple) else (self.pieces,)
        return self.dim, isinstance(self.pieces, tuple), sizes

    def __lt__(self, other: Strided) -> bool:  # the solver offers them in a fixed order
        return self._key() < other._key()


def as_pieces(sizes: Sequence[int]) -> Pieces:
    """Pieces of these sizes: their count when they are equal, else the sizes."""
    return len(sizes) if len(set(sizes)) == 1 else tuple(sizes)


Placement = Union[str, int, Strided]
R: Placement = "R"
P: Placement = "P"


def split_dim(p: Placement) -> int | None:
    """The dim a split placement splits (Shard or Strided); None for R and P."""
    if isinstance(p, Strided):
        return p.dim
    return p if isinstance(p, int) else None


def pieces_of(p: Placement) -> Pieces:
    """The pieces a split dim holds side by side (1: one block per rank)."""
    return p.pieces if isinstance(p, Strided) else 1


def show(p: Placement | tuple) -> str:
    if isinstance(p, tuple):
        return "(" + ", ".join(show(x) for x in p) + ")"
    if isinstance(p, Strided):
        if isinstance(p.pieces, tuple):
            return f"S({p.dim})x({'+'.join(map(str, p.pieces))})"
        return f"S({p.dim})x{p.pieces}"
    return f"S({p})" if isinstance(p, int) else p


@dataclass(frozen=True)
class Strategy:
    """One way to run an op on local shards."""

    inputs: tuple[Placement, ...]  # one per tensor input, in `tensor_inputs` order
    output: Placement | tuple[Placement, ...]  # a tuple for ops with several outputs
    work: float = 1.0  # fraction of the op's work one rank does (1/tp when split)
    lowering: str | None = None  # how the hook runs it, if not as the op on local shards
    # collectives the lowering issues itself: (kind, bytes of the full tensor)
    comm: tuple[tuple[str, int], ...] = ()

    def outputs(self) -> tuple[Placement, ...]:
        return self.output if isinstance(self.output, tuple) else (self.output,)

    @property
    def splits_work(self) -> bool:
        """Whether ranks do different parts of the op (then replicated inputs that need a
        gradient get it as a partial sum, see tensor_parallel.py)."""
        return any(p != R for p in self.outputs())

    def describe(self) -> str:
        text = f"{', '.join(show(p) for p in self.inputs)} -> {show(self.output)}"
        return text + (f" [{self.lowering}]" if self.lowering else "")


class ShardingRuleError(ValueError):
    """A sharding rule could not read an op of the user's forward: the message names the
    op, its module and source line, and what the user can do."""

    def __init__(self, node: fx.Node, tp: int, cause: BaseException):
        path, _ = module_of(node)
        where = source_of(node) or "an unknown source line"
        owner = f" in module `{path}`" if path else ""
        super().__init__(
            f"tensor parallelism (tp={tp}) cannot read {node.target} (node {node.name}) at "
            f"{where}{owner}: its sharding rule failed with {type(cause).__name__}: {cause}. "
            f"Train this model with Layout(tp=1) (dp, pp and ZeRO do not need the rule), or "
            f"write that line with another op; please report the op and its arguments "
            f"{_describe_args(node)}")


def _describe_args(node: fx.Node) -> str:
    def show_arg(a):
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        return f"Tensor{list(val.shape)}" if isinstance(val, torch.Tensor) else repr(a)
    return "(" + ", ".join([show_arg(a) for a in node.args]
                           + [f"{k}={show_arg(v)}" for k, v in node.kwargs.items()]) + ")"


def is_tensor_node(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments, in pytree order of (args, kwargs): depth first through
    tuples, lists and dicts (in key order), the containers an FX node's arguments are
    made of (the solver asks this of every node many times; pytree's own flatten, for
    any other container, costs most of the solver's Python time)."""
    out: list[fx.Node] = []
    _collect_tensor_nodes(node.args, out)
    _collect_tensor_nodes(node.kwargs, out)
    return out


def _collect_tensor_nodes(arg: Any, out: list[fx.Node]) -> None:
    if isinstance(arg, fx.Node):
        if isinstance(arg.meta.get("val"), torch.Tensor):
            out.append(arg)
    elif type(arg) in _SEQUENCES:
        for a in arg:
            _collect_tensor_nodes(a, out)
    elif type(arg) in _MAPPINGS:
        for a in arg.values():
            _collect_tensor_nodes(a, out)
    elif isinstance(arg, (tuple, list, dict)):  # a namedtuple, a subclass: pytree's order
        out.extend(a for a in tree_flatten(arg)[0] if is_tensor_node(a))


_SEQUENCES = (tuple, list, fx.immutable_collections.immutable_list)
_MAPPINGS = (dict, fx.immutable_collections.immutable_dict)


def output_vals(node: fx.Node) -> tuple[torch.Tensor | None, ...]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (val,)
    if isinstance(val, (tuple, list)):
        return tuple(v if isinstance(v, torch.Tensor) else None for v in val)
    return ()


def fits(val: torch.Tensor | None, p: Placement, tp: int) -> bool:
    """Whether a tensor can take placement p on tp ranks (a sharded dim must divide, each
    of its pieces too)."""
    d = split_dim(p)
    if d is None:
        return True
    return val is not None and 0 <= d < val.dim() and pieces_fit(val.shape[d], pieces_of(p), tp)


def replicated(node: fx.Node) -> Strategy:
    outs = output_vals(node)
    out: Placement | tuple = R if isinstance(node.meta.get("val"), torch.Tensor) \
        else tuple(R for _ in outs)
    return Strategy(tuple(R for _ in tensor_inputs(node)), out)


def strategies(node: fx.Node, tp: int, strided: Iterable[Strided] = ()) -> list[Strategy]:
    """Every valid strategy of `node` on tp ranks, all-replicated first; `strided`: the
    Strided placements its output may take as well (see `strided_demand`)."""
    options = [replicated(node)]
    rule = _rule_for(node.target)
    if rule is not None:
        ins, outs = [a.meta["val"] for a in tensor_inputs(node)], output_vals(node)
        try:
            found = rule(node, tp)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the op and the user's line
            raise ShardingRuleError(node, tp, exc) from exc
        found += [v for want in strided for s in found
                  if (v := _strided_variant(node, s, want)) is not None]
        for s in found:
            if s in options or len(s.inputs) != len(ins):
                continue
            if all(fits(v, p, tp) for v, p in zip(ins, s.inputs)) \
                    and all(fits(v, p, tp) for v, p in zip(outs, s.outputs()) if v is not None):
                options.append(s)
    return options


def _strided_variant(node: fx.Node, s: Strategy, want: Strided) -> Strategy | None:
    """Strategy `s` with its split output dim taken in pieces (`want`), if `s` maps that
    dim index by index from inputs split on the same dim size: then each input split dim
    takes the same pieces. Every rule's strategy with one split output does, except a
    view that merges or splits the dim (its pieces would no longer lie side by side)."""
    if s.output != want.dim or s.lowering is not None:
        return None
    if node.target in VIEWS and not isinstance(_view_spec(node)[want.dim], InputDim):
        return None
    inputs = tuple(Strided(p, want.pieces) if isinstance(p, int) else p for p in s.inputs)
    return Strategy(inputs, want, s.work, None, s.comm)


def split_pieces(node: fx.Node) -> tuple[int, Pieces] | None:
    """(dim, pieces) of a split, split_with_sizes or chunk into 2+ pieces along dim: their
    count when equal, else their sizes (`Strided`). A chunk into unequal pieces is
    not one: chunk's sizes on a rank's block would differ from the pieces' blocks."""
    if node.target not in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return None
    x = node.args[0].meta["val"]
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % x.dim()
    vals = output_vals(node)
    if len(vals) < 2 or any(v is None for v in vals):
        return None
    sizes = [v.shape[dim] for v in vals]
    if sum(sizes) != x.shape[dim] or min(sizes) < 1:
        return None
    pieces = as_pieces(sizes)
    if node.target == aten.chunk.default and isinstance(pieces, tuple):
        return None
    return dim, pieces


def _slice_bounds(node: fx.Node) -> tuple[int, int, int] | None:
    """(dim, start, end) of a slice or narrow with step 1 and static bounds, normalised
    to its input's dim size; None for anything else."""
    if node.target not in (aten.slice.Tensor, aten.narrow.default):
        return None
    x, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    dim = (node.args[1] if len(node.args) > 1 else 0) % x.dim()
    n, size = x.shape[dim], out.shape[dim]
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    step = node.args[4] if node.target == aten.slice.Tensor and len(node.args) > 4 else 1
    if not all(isinstance(v, int) for v in (n, size, start, step)) or step != 1:
        return None
    start = min(max(start + n if start < 0 else start, 0), n)
    return dim, start, start + size


def piece_slice(node: fx.Node) -> tuple[int, Pieces] | None:
    """(dim, pieces) of a slice or narrow that takes exactly one piece of its input along
    dim, with step 1: the pieces that its sibling slices of the same input tile the dim
    with (Phi-3's `qkv[..., :h]`, `qkv[..., h:h + kv]`, `qkv[..., h + kv:]`: (h, kv, kv)),
    or else, alone, one of 2+ equal pieces (`y[..., h:2 * h]` of a 3h dim: 3)."""
    bounds = _slice_bounds(node)
    if bounds is None:
        return None
    dim, start, end = bounds
    n = node.args[0].meta["val"].shape[dim]
    if end - start < 1 or end - start == n:
        return None
    # the sibling slices along dim, less any of the whole dim (a no-op `x[..., :]`)
    spans = sorted({b[1:] for u in node.args[0].users
                    if (b := _slice_bounds(u)) is not None and b[0] == dim
                    and b[2] - b[1] < n})
    tiled = len(spans) > 1 and spans[0][0] == 0 and spans[-1][1] == n and all(
        a[1] == b[0] for a, b in zip(spans, spans[1:]))
    if tiled:
        return dim, as_pieces([e - s for s, e in spans])
    size = end - start
    if n % size or start % size:
        return None
    return dim, n // size


def local_slice_args(node: fx.Node, args: tuple, tp: int) -> tuple:
    """A slice (or narrow) of one piece of a Strided dim (`piece_slice`), rewritten for
    the local block: the piece's bounds over tp (the pieces before it hold start / tp
    of the rank's block)."""
    _, start, end = _slice_bounds(node)
    if node.target == aten.narrow.default:
        return (args[0], args[1], start // tp, (end - start) // tp)
    return (args[0], args[1], start // tp, end // tp) + tuple(args[4:])


def strided_demand(graph: fx.Graph, tp: int) -> dict[str, set[Strided]]:
    """node -> the Strided placements worth offering its output: what a split into its
    pieces, or a slice of one piece, takes as input (each piece then comes out split),
    traced back through the strategies that carry the pieces, to the parameters (or
    other graph inputs): only the values on such a path get strided options, so the
    placement program grows by a few variables per fused projection."""
    demand: dict[str, set[Strided]] = {}
    for node in reversed(graph.nodes):
        if node.op != "call_function":
            continue
        wanted = demand.get(node.name, set())
        found = split_pieces(node) or piece_slice(node)
        if found is not None and is_tensor_node(node.args[0]):
            want = Strided(*found)
            if fits(node.args[0].meta["val"], want, tp):
                demand.setdefault(node.args[0].name, set()).add(want)
        if not wanted:
            continue
        ins = tensor_inputs(node)
        for s in strategies(node, tp, wanted):
            if isinstance(s.output, Strided):
                for a, p in zip(ins, s.inputs):
                    if isinstance(p, Strided):
                        demand.setdefault(a.name, set()).add(p)
    # an ask that stops short of the graph's inputs (a view cut the dim: a rotary
    # embedding's halves of each head) would only add options no value arrives in
    reached: set[str] = set()
    for node in graph.nodes:
        if node.name in demand and (node.op == "placeholder" or any(
                a.name in reached for a in tensor_inputs(node))):
            reached.add(node.name)
    return {name: wants for name, wants in demand.items() if name in reached}


# -- the rules ------------------------------------------------------------------------------

Rule = Callable[[fx.Node, int], list[Strategy]]
_RULES: dict[Any, Rule] = {}


def _rule(*ops):
    def register(fn: Rule) -> Rule:
        for op in ops:
            _RULES[op] = fn
        return fn
    return register


_SAME_SHAPE_UNARY = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
                     aten.alias.default, aten.clone.default, aten.contiguous.default,
                     aten.detach.default, aten.dropout.default, aten.type_as.default}


def _rule_for(op) -> Rule | None:
    if op in _RULES:
        return _RULES[op]
    if op in _SAME_SHAPE_UNARY:
        return _unary_rule
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        return _pointwise_rule
    return None


def _dims(node: fx.Node) -> int:
    return node.meta["val"].dim()


def _unary_rule(node: fx.Node, tp: int) -> list[Strategy]:
    ins = tensor_inputs(node)
    rest = tuple(R for _ in ins[1:])
    # a linear map of its input: a partial sum stays one
    return [Strategy((d,) + rest, d, 1 / tp) for d in range(_dims(node))] + \
        [Strategy((P,) + rest, P)]


def _pointwise_rule(node: fx.Node, tp: int) -> list[Strategy]:
    """Shard any output dim; each input takes the same dim where it is not broadcast."""
    out = node.meta["val"]
    ins = [a.meta["val"] for a in tensor_inputs(node)]
    options = []
    for d in range(out.dim()):
        placements = []
        for v in ins:
            aligned = d - (out.dim() - v.dim())
            placements.append(aligned if aligned >= 0 and v.shape[aligned] != 1 else R)
        options.append(Strategy(tuple(placements), d, 1 / tp))
    return options


# Views. A reshape keeps the elements in their order: which input dims become which
# output dims depends on the two shapes alone, whatever the op and however its arguments
# are written (flatten's start and end, unflatten's sizes, squeeze of all dims or of a
# list, a shape with -1), so DTensor's `view_groups` maps the recorded shapes. The other
# views reorder or repeat dims: DTensor's `dim_maps` entry for the torch function of the
# same meaning, called with the aten op's arguments put in that function's signature.
RESHAPES = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.view_copy.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.unsqueeze.default, aten.alias.default,
})
_REORDERING_VIEWS: dict[Any, Callable[[torch.Tensor, tuple, dict], tuple]] = {
    aten.expand.default: lambda x, a, k: dim_maps[torch.Tensor.expand](x, *a[0]),
    aten.transpose.int: lambda x, a, k: dim_maps[torch.transpose](x, *a),
    # t of fewer than 2 dims (a scalar too, which transpose's map refuses) is the identity
    aten.t.default: lambda x, a, k: dim_maps[torch.transpose](x, 0, 1) if x.dim() == 2
    else tuple(InputDim(d) for d in range(x.dim())),
    aten.permute.default: lambda x, a, k: dim_maps[torch.permute](x, a[0]),
    aten.swapaxes.default: lambda x, a, k: dim_maps[torch.transpose](x, *a),
    aten.swapdims.default: lambda x, a, k: dim_maps[torch.transpose](x, *a),
    aten.mT.default: lambda x, a, k: dim_maps[torch.transpose](x, -2, -1),
    aten.adjoint.default: lambda x, a, k: dim_maps[torch.transpose](x, -2, -1),
    aten.movedim.int: lambda x, a, k: dim_maps[torch.movedim](x, *a),
    aten.movedim.intlist: lambda x, a, k: dim_maps[torch.movedim](x, *a),
    # repeat(()) of a scalar (the only tensor it takes) is the identity; the map wants a size
    aten.repeat.default: lambda x, a, k: dim_maps[torch.Tensor.repeat](x, *a[0]) if a[0]
    else (),
}
VIEWS = RESHAPES | frozenset(_REORDERING_VIEWS)
SQUEEZES = frozenset({aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims})
# views whose argument is the output shape: the hook rewrites it to the local shape
SHAPE_ARG_VIEWS = frozenset({aten.view.default, aten.reshape.default,
                             aten._unsafe_view.default, aten.view_copy.default,
                             aten.expand.default})


def _view_spec(node: fx.Node) -> tuple:
    """DTensor's DimSpec of each output dim: where its elements come from in the input."""
    x = node.args[0].meta["val"]
    if node.target in RESHAPES:
        sizes, out = list(x.shape), list(node.meta["val"].shape)
        if not sizes or not out:  # (view_groups indexes sizes[0])
            return tuple(Singleton() for _ in out)  # to or from a scalar: all dims are 1
        return tuple(view_groups(sizes, out))
    return tuple(_REORDERING_VIEWS[node.target](x, tuple(node.args[1:]), dict(node.kwargs)))


def view_dim_map(node: fx.Node) -> dict[int, int]:
    """input dim -> output dim for the input dims a view keeps as a block: a dim that
    becomes an output dim, the first (outer) dim of a flattened group, or a dim split
    into pieces whose outer piece takes it."""
    out: dict[int, int] = {}
    for o, s in enumerate(_view_spec(node)):
        if isinstance(s, InputDim):
            out[s.input_dim] = o
        elif isinstance(s, Flatten) and isinstance(s.input_dims[0], InputDim):
            out[s.input_dims[0].input_dim] = o
        elif isinstance(s, Split) and s.split_id == 0 and isinstance(s.input_dim, InputDim):
            out[s.input_dim.input_dim] = o
    return out


@_rule(*VIEWS)
def _view_rule(node: fx.Node, tp: int) -> list[Strategy]:
    options = [Strategy((P,), P)]
    out = node.meta["val"]
    x = node.args[0].meta["val"]
    for d, o in view_dim_map(node).items():
        if node.target in SQUEEZES and x.shape[d] == tp:
            continue  # its local size would be 1, and the local squeeze would drop it
        # a split dim keeps a block only if its outer piece divides too (checked by fits)
        if out.shape[o] % tp == 0:
            options.append(Strategy((d,), o))
    return options


def _einsum_strategies(spec_in: Sequence[str], spec_out: str, tp: int,
                       bias_of: fx.Node | None = None) -> list[Strategy]:
    """Shard one index of a contraction: inputs that have it are sharded on it; the
    output is sharded on it if it keeps it, else a partial sum. With a bias
    (`bias_of` is the node), a contracted index has two forms: the bias joins one rank's
    partial sum, or the sums are all-reduced first and the bias added after (Megatron's
    row-parallel linear: the bias's gradient then needs no collective)."""
    options = []
    for letter in dict.fromkeys("".join(spec_in)):
        ins = tuple(s.index(letter) if letter in s else R for s in spec_in)
        if letter in spec_out:
            options.append(Strategy(ins, spec_out.index(letter), 1 / tp))
        elif bias_of is None:
            options.append(Strategy(ins, P, 1 / tp))
        else:
            out = bias_of.meta["val"]
            options += [Strategy(ins, P, 1 / tp, "bias_on_rank0"),
                        Strategy(ins, R, 1 / tp, "reduce_then_bias",
                                 comm=(("all_reduce", out.numel() * out.element_size()),))]
    return options


def _batch_letters(n: int) -> str:
    return "abcdefgh"[:n]


@_rule(aten.linear.default)
def _linear_rule(node: fx.Node, tp: int) -> list[Strategy]:
    lead = _batch_letters(node.args[0].meta["val"].dim() - 1)
    ins = [lead + "k", "nk"] + (["n"] if len(tensor_inputs(node)) == 3 else [])
    return _einsum_strategies(ins, lead + "n", tp, node if len(ins) == 3 else None)


@_rule(aten.mm.default)
def _mm_rule(node: fx.Node, tp: int) -> list[Strategy]:
    return _einsum_strategies(["mk", "kn"], "mn", tp)


@_rule(aten.bmm.default)
def _bmm_rule(node: fx.Node, tp: int) -> list[Strategy]:
    return _einsum_strategies(["bmk", "bkn"], "bmn", tp)


@_rule(aten.addmm.default)
def _addmm_rule(node: fx.Node, tp: int) -> list[Strategy]:
    bias = node.args[0].meta["val"]
    bias_spec = {0: "", 1: "n", 2: "mn"}[bias.dim()]
    if (bias.dim() and bias.shape[-1] == 1) or node.kwargs or len(node.args) > 3:
        return []  # a broadcast column bias, or beta/alpha scaling
    return _einsum_strategies([bias_spec, "mk", "kn"], "mn", tp, node)


@_rule(aten.matmul.default)
def _matmul_rule(node: fx.Node, tp: int) -> list[Strategy]:
    """torch.matmul of two operands of 2+ dims (eager attention's q @ k^T, scores @ v):
    "...mk,...kn->...mn" with the leading (batch) dims broadcast; a batch dim of the output
    is split where an operand has it, the operand that broadcasts it stays whole."""
    x, w = (a.meta["val"] for a in tensor_inputs(node))
    if x.dim() < 2 or w.dim() < 2:
        return []  # a vector operand: matmul is then a dot or matrix-vector product
    out = node.meta["val"]
    batch = out.dim() - 2
    options = []
    for d in range(batch):
        placements = []
        for v in (x, w):
            aligned = d - (batch - (v.dim() - 2))
            placements.append(aligned if aligned >= 0 and v.shape[aligned] != 1 else R)
        options.append(Strategy(tuple(placements), d, 1 / tp))
    return options + [Strategy((x.dim() - 2, R), batch, 1 / tp),
                      Strategy((R, w.dim() - 1), batch + 1, 1 / tp),
                      Strategy((x.dim() - 1, w.dim() - 2), P, 1 / tp)]


def _attention_options(node: fx.Node, tp: int, n_outputs: int) -> list[Strategy]:
    """Batch (dim 0) or heads (dim 1) of q, k, v split; a mask follows where it is not
    broadcast. Grouped-query attention: contiguous head blocks of q map to contiguous
    blocks of k/v when both head counts divide."""
    ins = tensor_inputs(node)
    options = []
    for d in (0, 1):
        placements = tuple(d if i < 3 else _mask_dim(a.meta["val"], d) for i, a in enumerate(ins))
        out = d if n_outputs == 1 else tuple(d if i < 2 else R for i in range(n_outputs))
        options.append(Strategy(placements, out, 1 / tp))
    return options


def _mask_dim(mask: torch.Tensor, d: int) -> Placement:
    """An attention mask broadcasts against (batch, heads, queries, keys): it is split
    where it has dim d of its own, replicated where it broadcasts."""
    aligned = d - (4 - mask.dim())
    return aligned if aligned >= 0 and mask.shape[aligned] != 1 else R


@_rule(aten.scaled_dot_product_attention.default)
def _sdpa_rule(node: fx.Node, tp: int) -> list[Strategy]:
    # with dropout_p > 0 each rank draws the mask of its own heads (or sequences) from its
    # own generator, as a split `dropout` does (docs/tensor_parallel.md, "Dropout"): the
    # tp ranks draw equal counts, so their generators stay in step for the replicated
    # dropouts after it
    return _attention_options(node, tp, 1)


@_rule(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _flash_cpu_rule(node: fx.Node, tp: int) -> list[Strategy]:
    return _attention_options(node, tp, len(output_vals(node)))


@_rule(aten.embedding.default)
def _embedding_rule(node: fx.Node, tp: int) -> list[Strategy]:
    idx = node.args[1].meta["val"]
    options = [Strategy((1, R), idx.dim(), 1 / tp)]  # hidden split
    scale_grad_by_freq = len(node.args) > 3 and node.args[3]
    if not scale_grad_by_freq:  # (masked ids would all count as row 0)
        # vocabulary split: each rank looks up the rows it holds, zero elsewhere
        options.append(Strategy((0, R), P, 1 / tp, "vocab_parallel_embedding"))
    return options + [Strategy((R, d), d, 1 / tp) for d in range(idx.dim())]


@_rule(aten.cross_entropy_loss.default)
def _cross_entropy_rule(node: fx.Node, tp: int) -> list[Strategy]:
    logits = node.args[0].meta["val"]
    args = list(node.args) + [None] * (6 - len(node.args))
    weight, label_smoothing = args[2], node.kwargs.get("label_smoothing", args[5] or 0.0)
    if logits.dim() != 2 or weight is not None or label_smoothing or len(tensor_inputs(node)) != 2:
        return []
    rows = logits.shape[0] * logits.dtype.itemsize
    # the classes split: max, sum of exponentials and the target's logit are combined
    # across ranks (2 all-reduces of a few numbers per row); the logits are never gathered
    return [Strategy((1, R), R, 1 / tp, "vocab_parallel_cross_entropy",
                     comm=(("all_reduce", rows), ("all_reduce", 2 * rows)))]


@_rule(aten.layer_norm.default)
def _layer_norm_rule(node: fx.Node, tp: int) -> list[Strategy]:
    x = node.args[0].meta["val"]
    norm_dims = len(node.args[1])
    rest = tuple(R for _ in tensor_inputs(node)[1:])
    return [Strategy((d,) + rest, d, 1 / tp) for d in range(x.dim() - norm_dims)]


@_rule(aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
       aten.log_softmax.int)
def _softmax_rule(node: fx.Node, tp: int) -> list[Strategy]:
    x = node.args[0].meta["val"]
    dim = node.args[1] % x.dim()
    return [Strategy((d,), d, 1 / tp) for d in range(x.dim()) if d != dim]


def _reduced_dims(node: fx.Node) -> tuple[list[int], bool]:
    x = node.args[0].meta["val"]
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else range(x.dim())
    dims = [dims] if isinstance(dims, int) else dims
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return sorted(d % max(x.dim(), 1) for d in dims), bool(keep)


@_rule(aten.sum.dim_IntList, aten.mean.dim)
def _reduction_rule(node: fx.Node, tp: int) -> list[Strategy]:
    x = node.args[0].meta["val"]
    reduced, keep = _reduced_dims(node)
    if node.kwargs.get("dtype") is not None:
        return []
    options = []
    for d in range(x.dim()):
        if d in reduced:
            # a sum over a split dim is a partial sum; a mean divides it by tp as well
            lowering = "mean_over_shards" if node.target == aten.mean.dim else None
            options.append(Strategy((d,), P, 1 / tp, lowering))
        else:
            options.append(Strategy((d,), d if keep else d - sum(r < d for r in reduced), 1 / tp))
    return options + [Strategy((P,), P)] if node.target == aten.sum.dim_IntList else options


def _other_dims(x: torch.Tensor, dim: int) -> list[int]:
    return [d for d in range(x.dim()) if d != dim % x.dim()]


@_rule(aten.slice.Tensor, aten.narrow.default)
def _slice_rule(node: fx.Node, tp: int) -> list[Strategy]:
    """Any other dim may be split; a slice of exactly one of the dim's pieces
    (`piece_slice`: Phi-3's `qkv[..., :h]`) takes the dim itself as Strided, each rank a
    block of each piece, and gives its piece split plainly (the hook divides the bounds
    by tp)."""
    x = node.args[0].meta["val"]
    dim = node.args[1] if len(node.args) > 1 else 0
    options = [Strategy((d,), d, 1 / tp) for d in _other_dims(x, dim)] + [Strategy((P,), P)]
    found = piece_slice(node)
    if found is not None:
        options.append(Strategy((Strided(*found),), found[0], 1 / tp))
    return options


@_rule(aten.select.int)
def _select_rule(node: fx.Node, tp: int) -> list[Strategy]:
    x = node.args[0].meta["val"]
    dim = node.args[1] % x.dim()
    # indexing is linear: a partial sum stays one
    return [Strategy((d,), d - (d > dim), 1 / tp) for d in _other_dims(x, dim)] + [
        Strategy((P,), P)]


@_rule(aten.unbind.int)
def _unbind_rule(node: fx.Node, tp: int) -> list[Strategy]:
    """Every piece drops `dim`; a split of another dim splits each piece."""
    x = node.args[0].meta["val"]
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % x.dim()
    n = len(output_vals(node))
    return [Strategy((d,), tuple(d - (d > dim) for _ in range(n)), 1 / tp)
            for d in _other_dims(x, dim)]


@_rule(aten.cat.default)
def _cat_rule(node: fx.Node, tp: int) -> list[Strategy]:
    out = node.meta["val"]
    dim = node.args[1] if len(node.args) > 1 else 0
    n = len(tensor_inputs(node))
    if any(a.meta["val"].dim() != out.dim() for a in tensor_inputs(node)):
        return []  # legacy empty-tensor cat
    return [Strategy(tuple(d for _ in range(n)), d, 1 / tp) for d in _other_dims(out, dim)]


@_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def _split_rule(node: fx.Node, tp: int) -> list[Strategy]:
    """Split or chunk along one dim: any other dim may be split across ranks (the pieces
    are then split on it too); into its pieces (`split_pieces`), the dim itself may be
    split if it holds them as Strided, each rank a block of each piece (the hook divides
    the sizes by tp)."""
    x = node.args[0].meta["val"]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    n = len(output_vals(node))
    options = [Strategy((d,), tuple(d for _ in range(n)), 1 / tp) for d in _other_dims(x, dim)]
    found = split_pieces(node)
    if found is not None:
        options.append(Strategy((Strided(*found),), tuple(found[0] for _ in range(n)), 1 / tp))
    return options

