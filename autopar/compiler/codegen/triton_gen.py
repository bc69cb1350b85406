"""Triton source for one fused region, specialised to its input shapes, strides, dtypes.

A region is a small FX graph (placeholders -> aten ops -> output tuple). Its
iteration space is the largest tensor shape F in it. Without row ops the kernel is
pointwise over the flattened index space of F (BLOCK elements per program); with
one, it is a row kernel: one program per row of F (all dims but the last), a block
of BLOCK >= F[-1] columns, so a reduction over the row is one `tl.sum`.

A row wider than MAX_ROW_BLOCK (a vocabulary's log-softmax) gets a *looped* row
kernel (`_looped`): the same body, cut at its reductions. Each reduction becomes a
loop over blocks of columns that recomputes the full values it reads from the
loads and accumulates into a scalar; row values that need only finished
reductions are computed between the loops; a last loop recomputes what the
outputs need and stores it. A row is read once per reduction plus once, instead of
being held in registers.

Each value in a row kernel is *full* (shape F: a vector over the columns), *row*
(shape F[:-1] or F[:-1] + (1,): a scalar per program, from a reduction), or
*column* (layer-norm weight/bias gradients: summed over rows with atomics). Inputs
are loaded through their strides, broadcast the way the consuming op broadcasts
them (stride 0 along size-1 or missing dims), so non-contiguous and broadcast
inputs need no copies. Outputs are written with the strides the original op gave them.

Remaps (slice, cat, slice_backward, transpose, permute, expand, a sum over a few elements
of middle dims) read their input at other indices: what only they
read is computed at those indices (`_Emitter.at`: loads through strides, pointwise ops
recomputed, a cat's parts selected with `tl.where`, a slice_backward's zeros), never
copied. A row op's value is known at its own row only and cannot be read that way.

    region: mul = mul(x, 0.5); tanh = tanh(mul); add = add(tanh, y)
    kernel: lin = pid * BLOCK + arange; i1 = lin % 64; i0 = lin // 64 % 8
            v0 = load(in0 + i0 * 64 + i1) * 0.5; ...; store(out0 + lin, v2)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.compiler.codegen.ops import (
    CAST,
    CONSTANT,
    EMPTY,
    LAYOUT_VIEWS,
    POINTWISE,
    RANDOM,
    ROW_OPS,
    TL_DTYPES,
    VIEWS,
    Row,
    Unsupported,
    constant,
    is_column_sum,
    is_remap,
    is_row_op,
    is_unrolled_sum,
    lit,
    round_bf16,
    unsupported_reason,
)

aten = torch.ops.aten

FULL, ROW, COLUMN = "full", "row", "column"
POINTWISE_BLOCK = 1024
# NOTE: a row kernel holds a whole row in one block; Triton caps a block at 2^20 elements
# (tl.TRITON_MAX_TENSOR_NUMEL) and registers run out long before. Wider rows (a 50k
# vocabulary's softmax) loop over blocks of LOOP_BLOCK columns. On an H200 (docs/
# benchmarks.md, "launch configurations") blocks of 2,048 to 8,192 columns were within 5%
# of each other for the 50k row, and a 4,096-wide row was faster whole than looped; where
# between 4,096 and 2^14 looping starts to pay was not measured
MAX_ROW_BLOCK = 1 << 14
LOOP_BLOCK = 1 << 12
# warps per program. Measured on an H200 (benchmarks/fusion_gpu.py --sweep,
# docs/benchmarks.md), GPT-2's regions at hidden 256 and 1,024: pointwise kernels and
# row kernels without column sums are within noise from 2 to 8 warps (Triton's default,
# 4, kept); a looped row (the 50k log-softmax) is 25% faster at 16 (its loads spread over
# more threads); a row kernel with column sums (layer norm's backward, one atomic add per
# row and column) 9-20% faster at 8
NUM_WARPS = 4
LOOPED_WARPS = 16
COLUMN_SUM_WARPS = 8
# program ids and aranges are int32: a kernel over a tensor spanning this many elements or
# more computes its indices in int64 (the program id widened first)
INT32_LIMIT = 2 ** 31


@dataclass(frozen=True)
class TensorArg:
    """What the generated source is specialised to, per input."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> TensorArg:
        return TensorArg(tuple(t.shape), tuple(t.stride()), t.dtype)


@dataclass(frozen=True)
class OutputSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # FULL, ROW or COLUMN


@dataclass(frozen=True)
class KernelSource:
    name: str
    text: str  # a Python module defining `name` as a @triton.jit function
    kind: str  # "pointwise" | "row"
    grid: int
    block: int
    outputs: tuple[OutputSpec, ...]
    seeds: int = 0  # random draws (dropout masks): one seed argument each, after the outputs
    num_warps: int = NUM_WARPS


@dataclass(frozen=True)
class Launch:
    """A launch configuration chosen instead of the rule's (benchmarks/fusion_gpu.py
    --sweep measures them): BLOCK (elements per program, or columns per block of a row
    kernel), warps per program, and for a row kernel whether it loops over blocks of
    columns (a row kernel that does not needs BLOCK >= its row's width)."""

    block: int
    num_warps: int = NUM_WARPS
    looped: bool | None = None  # None: the rule's (rows wider than MAX_ROW_BLOCK loop)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shape(node: fx.Node) -> tuple[int, ...] | list:
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in val]
    return tuple(val.shape)


class _Emitter:
    """Builds the kernel body line by line."""

    def __init__(self, gm: fx.GraphModule, args: list[TensorArg]):
        self.gm = gm
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # node -> (input index, how the kernel reads it): placeholders and views of them
        self.sources = {p: (i, a) for i, (p, a) in enumerate(zip(self.placeholders, args))}
        self.ops = [n for n in gm.graph.nodes if n.op == "call_function"]
        self.outputs = list(gm.graph.output_node().args[0])
        self.root = self._root_nodes()
        self.row_kernel = any(is_row_op(n) for n in self.ops)
        self.full = self._full_shape(args)
        self.rows = _numel(self.full[:-1]) if self.row_kernel else 0
        self.lines: list[str] = []
        self.values: dict[fx.Node, object] = {}
        self.loads: dict[tuple, str] = {}
        self.indices: dict[tuple[int, ...], list[str]] = {}
        self.remapped: dict[tuple[fx.Node, tuple[str, ...]], str] = {}
        self.seeds: list[fx.Node] = []
        self.count = 0
        self.wide = False  # int64 indices (set by _check_limits)

    def _root_nodes(self) -> set[fx.Node]:
        """Nodes computed at the kernel's own element: the outputs and what any op but a
        remap reads. What only remaps read is computed where they read it (`at`)."""
        root = set(self.outputs)
        for n in reversed(self.ops):
            if n in root and not is_remap(n):
                root.update(n.all_input_nodes)
        return root

    def _full_shape(self, args) -> tuple[int, ...]:
        shapes = [tuple(a.shape) for p, a in zip(self.placeholders, args) if p in self.root]
        for n in self.ops:
            if n not in self.root or not isinstance(n.meta.get("val"), (torch.Tensor, tuple, list)):
                continue  # getitem of an output the op does not compute (None)
            s = _shape(n)
            shapes += [x for x in s if x is not None] if isinstance(s, list) else [s]
        full = max(shapes, key=_numel)
        if self.row_kernel and not full:
            raise Unsupported("a row op over a 0-d tensor")
        return full

    def temp(self, expr: str) -> str:
        name = f"t{self.count}"
        self.count += 1
        self.lines.append(f"{name} = {expr}")
        return name

    def cls(self, shape) -> str:
        """FULL: every element of the iteration space (any contiguous reshape of F that
        keeps the row length); ROW: one value per row."""
        shape = tuple(shape)
        if _numel(shape) == _numel(self.full) and (
                not self.row_kernel or (shape and shape[-1] == self.full[-1])):
            return FULL
        if self.row_kernel and _numel(shape) == self.rows:
            return ROW
        raise Unsupported(f"a value of shape {list(shape)} inside a kernel over "
                          f"{list(self.full)} (one output shape per kernel)")

    # -- index space ------------------------------------------------------------------------

    def prologue(self) -> list[str]:
        if self.row_kernel:
            return [f"row = {_program_id(self.wide)}", "cols = tl.arange(0, BLOCK)",
                    f"mask = cols < {self.full[-1]}", "zero = cols * 0"]
        return [f"lin = {_program_id(self.wide)} * BLOCK + tl.arange(0, BLOCK)",
                f"mask = lin < {_numel(self.full)}", "zero = lin * 0"]

    def index(self, shape: tuple[int, ...]) -> list[str]:
        """Index variables of `shape`'s dims for this program's elements: decomposed from
        the linear index (pointwise), from the row index (+ the columns for FULL shapes)."""
        shape = tuple(shape)
        if shape not in self.indices:
            full = self.cls(shape) == FULL
            lead = shape[:-1] if self.row_kernel and full else shape
            names = [f"x{len(self.indices)}_{d}" for d in range(len(lead))]
            self.lines.append(f"rem = {'row' if self.row_kernel else 'lin'}")
            for d in reversed(range(len(lead))):
                self.lines += [f"{names[d]} = rem % {lead[d]}", f"rem = rem // {lead[d]}"]
            self.indices[shape] = names + (["cols"] if self.row_kernel and full else [])
        return self.indices[shape]

    def offset(self, arg: TensorArg, target: tuple[int, ...]) -> str:
        """Element offset of `arg` broadcast (right-aligned) to `target`."""
        vector = self.cls(target) == FULL
        index = self.index(target)
        lead = len(target) - len(arg.shape)
        if lead < 0:
            raise Unsupported(f"input of shape {list(arg.shape)} broadcast to {list(target)}")
        terms = []
        for i, (size, stride) in enumerate(zip(arg.shape, arg.stride)):
            if size == 1:
                continue
            if size != target[i + lead]:
                raise Unsupported(f"input of shape {list(arg.shape)} does not broadcast to "
                                  f"{list(target)}")
            terms.append(f"{index[i + lead]} * {stride}")
        return " + ".join(terms + (["zero"] if vector else [])) or "0"

    def load(self, node: fx.Node, target: tuple[int, ...]) -> str:
        key = (node, tuple(target))
        if key not in self.loads:
            index, arg = self.sources[node]
            off = self.offset(arg, tuple(target))
            masked = ", mask=mask, other=0" if self.cls(target) == FULL else ""
            cast = "" if arg.dtype == torch.bool else ".to(tl.float32)"
            self.loads[key] = self.temp(f"tl.load(in{index} + ({off}){masked}){cast}")
        return self.loads[key]

    # -- ops --------------------------------------------------------------------------------

    def operand(self, a, target, node: fx.Node):
        if not isinstance(a, fx.Node):
            return lit(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
        if a in self.sources:
            return self.load(a, target)
        value = self.values[a]
        if a.target == CONSTANT:
            return value
        if isinstance(value, str) and value.startswith("COLUMN("):
            raise Unsupported(f"{node.name} uses the column sum {a.name} inside its kernel")
        shape = _strip(_shape(a))
        if self.cls(_shape(a)) == ROW and self.cls(target) == FULL and \
                shape != _strip(tuple(target[:-1]) + (1,)):
            raise Unsupported(f"{node.name} broadcasts a row value of shape {list(shape)} "
                              f"against {list(target)}")
        return _as_operand(value, a, node)

    def emit_view(self, node: fx.Node) -> None:
        src = node.args[0]
        if src not in self.sources:
            self.values[node] = self.values[src]  # same elements, same order: a new name
            return
        index, arg = self.sources[src]
        if arg.stride != _contiguous(arg.shape):
            raise Unsupported(f"{node.name} views an input with strides {list(arg.stride)}")
        shape = tuple(node.meta["val"].shape)
        self.sources[node] = (index, TensorArg(shape, _contiguous(shape), arg.dtype))

    def emit_op(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            self.values[node] = self.values[node.args[0]][node.args[1]]
        elif node.target in VIEWS:
            self.emit_view(node)
        elif is_column_sum(node):
            x = self.operand(node.args[0], _shape(node.args[0]), node)
            self.values[node] = (f"COLUMN({self.index(_shape(node.args[0]))[-1]}, {x})")
        elif node.target == CONSTANT:
            self.values[node] = constant(node)
        elif node.target in (EMPTY, RANDOM) or is_remap(node):
            shape = _shape(node)
            if self.cls(shape) != FULL:
                raise Unsupported(f"{node.name} makes a value of shape {list(shape)} per row")
            self.values[node] = self.at(node, tuple(self.index(shape)))
        elif node.target in ROW_OPS:
            target = _shape(node.args[0])
            args = [self.operand(a, target, node) for a in node.args]
            out = ROW_OPS[node.target](Row(self.temp, self.full[-1]), *args, **node.kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            names = tuple(self._name(o) for o in outs)
            self.values[node] = names if isinstance(out, tuple) else names[0]
        else:
            self.emit_pointwise(node)

    def emit_pointwise(self, node: fx.Node) -> None:
        target = _shape(node)
        self.cls(target)
        args = [self.operand(a, target, node) for a in node.args]
        kwargs = {k: self.operand(v, target, node) for k, v in node.kwargs.items()}
        if node.target == CAST:
            expr = _cast(args[0], node.args[0].meta["val"].dtype, node.meta["val"].dtype)
        else:
            expr = POINTWISE[node.target](*args, **kwargs)
        self.values[node] = self.temp(expr)

    # -- values read at other indices (REMAPS) -----------------------------------------------

    def at(self, node: fx.Node, ctx: tuple[str, ...]) -> str:
        """`node`'s value at index `ctx` (an expression per dim of its shape) instead of at
        the kernel's own element: what a remap (slice, cat, transpose, ...) reads. Sources load
        there; views, pointwise ops and remaps are recomputed there; a value a row op
        makes is only known at its own row, so reading it elsewhere is Unsupported."""
        key = (node, ctx)
        if key in self.remapped:
            return self.remapped[key]
        shape = _shape(node)
        if node in self.sources:
            index, arg = self.sources[node]
            terms = [f"({c}) * {st}" for c, n, st in zip(ctx, arg.shape, arg.stride) if n != 1]
            cast = "" if arg.dtype == torch.bool else ".to(tl.float32)"
            value = self.temp(f"tl.load(in{index} + ({' + '.join(terms + ['zero'])}), "
                              f"mask=mask, other=0){cast}")
        elif node.target == CONSTANT:
            value = constant(node)
        elif node.target == EMPTY:  # never read: only bernoulli_ overwrites it
            value = "zero"
        elif node.target == RANDOM:  # 1 with probability p, at this element's own offset
            if node not in self.seeds:
                self.seeds.append(node)
            keep = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            flat = self._flat(ctx, shape)
            value = self.temp(f"tl.where(tl.rand(seed{self.seeds.index(node)}, {flat}) < "
                              f"{lit(keep)}, 1.0, 0.0)")
        elif node.target in VIEWS:
            value = self.at(node.args[0], self._reshaped(ctx, shape, _shape(node.args[0])))
        elif is_remap(node):
            value = self._remap(node, ctx)
        elif node.target in POINTWISE or node.target == CAST:
            args = [self._operand_at(a, ctx, shape, node) for a in node.args]
            kwargs = {k: self._operand_at(v, ctx, shape, node) for k, v in node.kwargs.items()}
            value = self.temp(_cast(args[0], node.args[0].meta["val"].dtype, node.meta["val"].dtype)
                              if node.target == CAST else POINTWISE[node.target](*args, **kwargs))
        else:
            raise Unsupported(f"{node.name} ({node.target}) is read at other indices by a "
                              "remap (slice, cat, transpose, ...); only pointwise values can be")
        self.remapped[key] = value
        return value

    def _operand_at(self, a, ctx: tuple[str, ...], shape: tuple[int, ...], node: fx.Node):
        if not isinstance(a, fx.Node):
            return lit(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
        own = _shape(a)
        lead = len(shape) - len(own)
        if lead < 0 or any(n not in (1, shape[i + lead]) for i, n in enumerate(own)):
            raise Unsupported(f"{a.name} of shape {list(own)} does not broadcast to {list(shape)}")
        value = self.at(a, tuple("0" if n == 1 else ctx[i + lead] for i, n in enumerate(own)))
        return _as_operand(value, a, node)

    def _flat(self, ctx, shape) -> str:
        """The row-major position of the element at `ctx` in `shape` (a vector)."""
        terms = [f"({c}) * {st}" for c, n, st in zip(ctx, shape, _contiguous(shape)) if n != 1]
        return self.temp(" + ".join(terms + ["zero"]))

    def _reshaped(self, ctx, shape, src_shape) -> tuple[str, ...]:
        """The index in `src_shape` of the element at `ctx` in its reshape `shape`."""
        flat = self._flat(ctx, shape)
        return tuple("0" if n == 1 else self.temp(f"{flat} // {st} % {n}")
                     for n, st in zip(src_shape, _contiguous(src_shape)))

    def _remap(self, node: fx.Node, ctx: tuple[str, ...]) -> str:
        shape, idx = _shape(node), list(ctx)
        if node.target in LAYOUT_VIEWS:  # out[i] = x[the same element, indexed x's way]
            return self.at(node.args[0], _view_index(node, ctx, _shape(node.args[0])))
        if is_unrolled_sum(node):  # the input at every index of the summed dims, added
            src = _shape(node.args[0])
            dims = sorted({d % len(src) for d in node.args[1]})
            keep = len(node.args) > 2 and node.args[2]
            kept = iter(c for i, c in enumerate(ctx) if not (keep and i in dims))
            outer = [None if d in dims else next(kept) for d in range(len(src))]
            terms = []
            for flat in range(math.prod(src[d] for d in dims)):
                at, rest = list(outer), flat
                for d in reversed(dims):
                    at[d], rest = str(rest % src[d]), rest // src[d]
                terms.append(self.at(node.args[0], tuple(at)))
            return self.temp(" + ".join(terms))
        if node.target == aten.slice.Tensor:  # out[i] = x[start + i * step]
            src = node.args[0]
            dim, start, step = _slice_args(node, _shape(src))
            idx[dim] = _affine(ctx[dim], step, start)
            return self.at(src, tuple(idx))
        if node.target == aten.cat.default:  # each part where the index falls in its range
            dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(shape)
            parts, end = [], 0
            for part in node.args[0]:
                n = _shape(part)[dim]
                idx[dim] = self._clamped(_affine(ctx[dim], 1, -end), n)
                parts.append((end + n, self.at(part, tuple(idx))))
                end += n
            value = parts[-1][1]
            for bound, part_value in reversed(parts[:-1]):
                value = f"tl.where({ctx[dim]} < {bound}, {part_value}, {value})"
            return self.temp(value)
        # slice_backward(grad, sizes, dim, start, end, step): grad where the slice was, else 0
        grad, _, dim, start, _, step = node.args
        dim %= len(shape)
        n = _shape(grad)[dim]
        start = _start(start, shape[dim])
        if shape[dim] == 1:
            return self.at(grad, ctx)
        rel = _affine(ctx[dim], 1, -start)
        idx[dim] = self._clamped(f"{rel} // {step}", n)
        inside = f"({ctx[dim]} >= {start}) & ({ctx[dim]} < {start + (n - 1) * step + 1})"
        if step > 1:
            inside += f" & ({rel} % {step} == 0)"
        return self.temp(f"tl.where({inside}, {self.at(grad, tuple(idx))}, 0.0)")

    def _clamped(self, expr: str, n: int) -> str:
        """`expr` clamped to [0, n): a part's index, in bounds where another part is read."""
        return "0" if n == 1 else self.temp(f"tl.minimum(tl.maximum({expr}, 0), {n - 1})")

    def _name(self, expr: str) -> str:
        return expr if expr.startswith("COLUMN(") else self.temp(expr)

    def store(self, k: int, node: fx.Node) -> OutputSpec:
        val = node.meta["val"]
        spec = OutputSpec(tuple(val.shape), tuple(val.stride()), val.dtype, FULL)
        if node in self.sources:
            raise Unsupported(f"output {node.name} is a view of an input")
        value = self.values[node]
        if isinstance(value, str) and value.startswith("COLUMN("):
            column, expr = value[7:-1].split(", ", 1)  # layer norm's: over this row's columns
            self.lines.append(f"tl.atomic_add(out{k} + {column}, {expr}, mask=mask)")
            return dataclasses.replace(spec, kind=COLUMN)
        kind = self.cls(val.shape)
        # the original op's strides (eager keeps an input's layout; later views rely on it)
        off = self.offset(TensorArg(spec.shape, spec.stride, val.dtype), spec.shape)
        masked = ", mask=mask" if kind == FULL else ""
        if val.dtype == torch.bfloat16:
            value = self.temp(round_bf16(value))
        self.lines.append(f"tl.store(out{k} + ({off}), ({value}).to({TL_DTYPES[val.dtype]}){masked})")
        return dataclasses.replace(spec, kind=kind)


def _strip(shape) -> tuple[int, ...]:
    """A shape without its leading 1s (broadcasting ignores them)."""
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _view_index(node: fx.Node, ctx: tuple[str, ...], src: tuple[int, ...]) -> tuple[str, ...]:
    """The index into a transpose's, permute's or expand's input of the element at `ctx`."""
    if node.target == aten.expand.default:  # right-aligned; a size-1 dim repeats its element
        lead = len(ctx) - len(src)
        return tuple("0" if n == 1 else ctx[i + lead] for i, n in enumerate(src))
    if node.target == aten.permute.default:
        order = [d % len(src) for d in node.args[1]]
    else:  # transpose(x, a, b), t(x)
        a, b = (node.args[1] % len(src), node.args[2] % len(src)) if len(node.args) > 1 \
            else (0, len(src) - 1)
        order = list(range(len(src)))
        order[a], order[b] = order[b], order[a]
    out = [""] * len(src)
    for i, d in enumerate(order):  # output dim i is input dim order[i]
        out[d] = ctx[i]
    return tuple(out)


def _affine(index: str, scale: int, shift: int) -> str:
    """`index * scale + shift` as Triton source, without the no-op parts."""
    out = index if scale == 1 else f"({index}) * {scale}"
    return out if shift == 0 else f"({out} {'+' if shift > 0 else '-'} {abs(shift)})"


def _slice_args(node: fx.Node, src_shape) -> tuple[int, int, int]:
    """aten.slice.Tensor's (dim, start, step), start normalized as eager does."""
    args = list(node.args) + [None] * (5 - len(node.args))
    dim = (args[1] if args[1] is not None else node.kwargs.get("dim", 0)) % len(src_shape)
    start = args[2] if args[2] is not None else node.kwargs.get("start") or 0
    step = args[4] if args[4] is not None else node.kwargs.get("step", 1)
    return dim, _start(start, src_shape[dim]), step


def _start(start: int, size: int) -> int:
    """A slice's start as eager normalizes it: negative counts from the end, clamped."""
    return min(max(start + size if start < 0 else start, 0), size)


def _as_operand(value: str, a: fx.Node, node: fx.Node) -> str:
    """A bool value as `node` reads it: fp32 for arithmetic (eager promotes it), bool for
    where, casts and ops that make bools."""
    if a.meta["val"].dtype == torch.bool and node.target not in (aten.where.self, CAST) \
            and node.meta["val"].dtype != torch.bool:
        return f"{value}.to(tl.float32)"
    return value


def _contiguous(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _cast(x: str, src: torch.dtype, dst: torch.dtype) -> str:
    if dst == torch.bool:
        return f"({x} != 0)"
    if src == torch.bool:
        return f"{x}.to(tl.float32)"
    if dst == torch.float32:
        return x
    if dst == torch.bfloat16:
        return round_bf16(x)
    return f"{x}.to({TL_DTYPES[dst]}).to(tl.float32)"  # round through the narrow dtype


def _check_limits(em: _Emitter, args: list[TensorArg]) -> None:
    """Widen the kernel's indices to int64 when a tensor spans 2^31 elements or more. A
    dropout's draw then takes int64 offsets too: tl.rand splits them into Philox's two
    low counter words, so an offset below 2^32 draws what it draws as int32 and larger
    ones draw numbers of their own."""
    extents = [_numel(em.full)] + [_extent(a) for a in args]
    em.wide = max(extents) >= INT32_LIMIT


def _extent(arg: TensorArg) -> int:
    """Elements from a tensor's first to its last, through its strides (0 if empty)."""
    if not _numel(arg.shape):
        return 0
    return sum((n - 1) * st for n, st in zip(arg.shape, arg.stride)) + 1


def _program_id(wide: bool) -> str:
    return "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_NAME = re.compile(r"[A-Za-z_]\w*")
_INDEX = re.compile(r"rem|x\d+_\d+")  # index lines: functions of the row number alone
_REDUCTION = re.compile(r"tl\.(sum|max)\(tl\.where\(mask, ")
_FULL_SEEDS = frozenset({"cols", "mask", "zero"})


def _looped(lines: list[str], n: int, wide: bool = False) -> list[str]:
    """A row kernel's body (after its prologue) as loops over blocks of BLOCK columns
    (see the module docstring)."""
    parsed = []  # (target or None, text, refs)
    for line in lines:
        target, sep, expr = line.partition(" = ")
        if not sep or not _NAME.fullmatch(target):
            target, expr = None, line
        parsed.append((target, line, set(_NAME.findall(expr))))
    index = [line for target, line, _ in parsed if target and _INDEX.fullmatch(target)]
    body = [p for p in parsed if not (p[0] and _INDEX.fullmatch(p[0]))]
    full, defined = set(), {t: i for i, (t, _, _) in enumerate(body) if t}
    reductions = []
    for i, (target, line, refs) in enumerate(body):
        if target and _REDUCTION.match(line.partition(" = ")[2]):
            reductions.append(i)
        elif refs & (_FULL_SEEDS | full) and target:
            full.add(target)

    out, done = [f"row = {_program_id(wide)}", *index], set()
    loop = [f"for start in range(0, {n}, BLOCK):", "    cols = start + tl.arange(0, BLOCK)",
            f"    mask = cols < {n}", "    zero = cols * 0"]
    pending = list(reductions)
    while pending:  # one loop per wave: the reductions that need no pending one
        wave = [r for r in pending
                if not (_needs(body, defined, full, {r}, done) - {r}) & set(pending)]
        pending = [r for r in pending if r not in wave]
        need = _needs(body, defined, full, set(wave), done)
        out += [body[i][1] for i in sorted(need) if i not in wave and body[i][0] not in full]
        steps = []
        for r in wave:
            expr, acc = body[r][1].partition(" = ")[2], f"acc{r}"
            if expr.startswith("tl.sum"):
                out.append(f"{acc} = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)")
                steps.append(f"    {acc} = {acc} + {expr}")
            else:
                out.append(f"{acc} = tl.max(tl.full([BLOCK], float('-inf'), tl.float32), axis=0)")
                steps.append(f"    {acc} = tl.maximum({acc}, {expr})")
        out += loop + [f"    {body[i][1]}" for i in sorted(need)
                       if i not in wave and body[i][0] in full] + steps
        out += [f"{body[r][0]} = acc{r}" for r in wave]
        done |= {i for i in need if body[i][0] not in full}
    rest = set(range(len(body))) - done
    stores = {i for i in rest if body[i][0] is None}
    full_stores = {i for i in stores if body[i][2] & (_FULL_SEEDS | full)}
    between = [i for i in sorted(rest - full_stores) if body[i][0] not in full]
    out += [body[i][1] for i in between]
    done |= set(between)
    need = _needs(body, defined, full, full_stores, done)
    if need:
        out += loop + [f"    {body[i][1]}" for i in sorted(need)]
    return out


def _needs(body, defined: dict[str, int], full: set, roots: set[int], done: set[int]) -> set[int]:
    """Lines `roots` need, recomputing full values, stopping at row values in `done`."""
    out, todo = set(), list(roots)
    while todo:
        i = todo.pop()
        if i in out or (i in done and body[i][0] not in full):
            continue
        out.add(i)
        todo += [defined[r] for r in body[i][2] if r in defined and defined[r] < i]
    return out


def generate(gm: fx.GraphModule, args: list[TensorArg], name_hint: str = "fused",
             launch: Launch | None = None) -> KernelSource:
    """The Triton source of region `gm` for inputs described by `args`; raises
    Unsupported (with the reason) for a region the generator cannot emit. A row wider
    than MAX_ROW_BLOCK loops over blocks of LOOP_BLOCK columns; `launch` overrides
    the block, the warps and whether a row loops."""
    em = _Emitter(gm, args)
    _check_limits(em, args)
    for node in em.ops:
        reason = unsupported_reason(node)
        if reason is not None:
            raise Unsupported(f"{node.name}: {reason}")
        if node in em.root:
            em.emit_op(node)
    outputs = tuple(em.store(k, node) for k, node in enumerate(em.outputs))
    params = [f"in{i}" for i in range(len(args))] + [f"out{k}" for k in range(len(outputs))] \
        + [f"seed{j}" for j in range(len(em.seeds))]
    looped = em.row_kernel and _next_pow2(em.full[-1]) > MAX_ROW_BLOCK
    if launch is not None and launch.looped is not None and em.row_kernel:
        looped = launch.looped
    body = _looped(em.lines, em.full[-1], em.wide) if looped else em.prologue() + em.lines
    digest = hashlib.sha256("\n".join(body).encode()).hexdigest()[:12]
    name = f"{name_hint}_{digest}"
    text = "\n".join(["import triton", "import triton.language as tl", "", "",
                      "@triton.jit", f"def {name}({', '.join(params)}, BLOCK: tl.constexpr):"]
                     + [f"    {line}" for line in body]) + "\n"
    if launch is not None:
        warps = launch.num_warps
    elif looped:
        warps = LOOPED_WARPS
    elif any(o.kind == COLUMN for o in outputs):
        warps = COLUMN_SUM_WARPS
    else:
        warps = NUM_WARPS
    if em.row_kernel:
        block = min(LOOP_BLOCK, _next_pow2(em.full[-1])) if looped else _next_pow2(em.full[-1])
        if launch is not None:
            if not looped and launch.block < em.full[-1]:
                raise ValueError(f"a row kernel that does not loop holds its whole row: BLOCK "
                                 f"{launch.block} < the row's {em.full[-1]} columns")
            block = launch.block
        return KernelSource(name, text, "looped row" if looped else "row", _numel(em.full[:-1]),
                            block, outputs, len(em.seeds), warps)
    block = min(POINTWISE_BLOCK, _next_pow2(_numel(em.full)))
    if launch is not None:
        block = launch.block
    return KernelSource(name, text, "pointwise", -(-_numel(em.full) // block), block, outputs,
                        len(em.seeds), warps)
