"""Triton source for one fused region, specialised to its input shapes, strides, dtypes.

A region is a small FX graph (placeholders -> aten ops -> output tuple). Its
iteration space is the largest tensor shape F in it. Without row ops the kernel is
pointwise over the flattened index space of F (BLOCK elements per program); with
one, it is a row kernel: one program per row of F (all dims but the last), a block
of BLOCK >= F[-1] columns, so a reduction over the row is one `tl.sum`.

Each value in a row kernel is *full* (shape F: a vector over the columns), *row*
(shape F[:-1] or F[:-1] + (1,): a scalar per program, from a reduction), or
*column* (layer-norm weight/bias gradients: summed over rows with atomics). Inputs
are loaded through their strides, broadcast the way the consuming op broadcasts
them (stride 0 along size-1 or missing dims), so non-contiguous and broadcast
inputs need no copies. Outputs are written contiguous.

    region: mul = mul(x, 0.5); tanh = tanh(mul); add = add(tanh, y)
    kernel: lin = pid * BLOCK + arange; i1 = lin % 64; i0 = lin // 64 % 8
            v0 = load(in0 + i0 * 64 + i1) * 0.5; ...; store(out0 + lin, v2)
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.compiler.codegen.ops import (CAST, POINTWISE, ROW_OPS, TL_DTYPES, Row, Unsupported,
                                          lit, round_bf16)

FULL, ROW, COLUMN = "full", "row", "column"
POINTWISE_BLOCK = 1024


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
        self.args = args
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.ops = [n for n in gm.graph.nodes if n.op == "call_function"]
        self.outputs = list(gm.graph.output_node().args[0])
        self.row_kernel = any(n.target in ROW_OPS for n in self.ops)
        self.full = self._full_shape()
        self.lines: list[str] = []
        self.values: dict[fx.Node, object] = {}
        self.loads: dict[tuple[fx.Node, str], str] = {}
        self.count = 0

    def _full_shape(self) -> tuple[int, ...]:
        shapes = [tuple(a.shape) for a in self.args]
        for n in self.ops:
            if not isinstance(n.meta.get("val"), (torch.Tensor, tuple, list)):
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
        shape = tuple(shape)
        if shape == self.full:
            return FULL
        if self.row_kernel and shape in (self.full[:-1], self.full[:-1] + (1,)):
            return ROW
        raise Unsupported(f"a value of shape {list(shape)} inside a kernel over "
                          f"{list(self.full)} (one output shape per kernel)")

    # -- index space ------------------------------------------------------------------------

    def prologue(self) -> list[str]:
        dims = len(self.full)
        if self.row_kernel:
            lines = ["row = tl.program_id(0)", "cols = tl.arange(0, BLOCK)",
                     f"mask = cols < {self.full[-1]}", "zero = cols * 0", "rem = row"]
            index_dims = range(dims - 2, -1, -1)
            lines.append(f"i{dims - 1} = cols")
        else:
            lines = ["lin = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
                     f"mask = lin < {_numel(self.full)}", "zero = lin * 0", "rem = lin"]
            index_dims = range(dims - 1, -1, -1)
        for d in index_dims:
            lines += [f"i{d} = rem % {self.full[d]}", f"rem = rem // {self.full[d]}"]
        return lines

    def offset(self, arg: TensorArg, target: tuple[int, ...], vector: bool) -> str:
        """Element offset of `arg` broadcast (right-aligned) to `target`, one of F,
        F[:-1] + (1,) or F[:-1], whose dims map to the index variables i0.."""
        terms = []
        lead = len(target) - len(arg.shape)
        if lead < 0:
            raise Unsupported(f"input of shape {list(arg.shape)} broadcast to {list(target)}")
        for i, (size, stride) in enumerate(zip(arg.shape, arg.stride)):
            d = i + lead
            if size == 1:
                continue
            if size != target[d] or (d == len(self.full) - 1 and target != self.full):
                raise Unsupported(f"input of shape {list(arg.shape)} does not broadcast to "
                                  f"{list(target)}")
            terms.append(f"i{d} * {stride}")
        return " + ".join(terms + (["zero"] if vector else [])) or "0"

    def load(self, node: fx.Node, target: tuple[int, ...]) -> str:
        vector = self.cls(target) == FULL
        key = (node, tuple(target))
        if key not in self.loads:
            index = self.placeholders.index(node)
            arg = self.args[index]
            off = self.offset(arg, tuple(target), vector)
            masked = ", mask=mask, other=0" if vector else ""
            cast = "" if arg.dtype == torch.bool else ".to(tl.float32)"
            self.loads[key] = self.temp(f"tl.load(in{index} + ({off}){masked}){cast}")
        return self.loads[key]

    # -- ops --------------------------------------------------------------------------------

    def operand(self, a, target, node: fx.Node):
        if not isinstance(a, fx.Node):
            return lit(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
        if a.op == "placeholder":
            return self.load(a, target)
        value = self.values[a]
        shape = _shape(a)
        if self.cls(target) == FULL and len(shape) != len(target) and shape != target:
            raise Unsupported(f"{node.name} broadcasts a row value of shape {list(shape)} "
                              f"against {list(target)}")
        if a.meta["val"].dtype == torch.bool and node.target not in (
                torch.ops.aten.where.self, CAST) and node.meta["val"].dtype != torch.bool:
            return f"{value}.to(tl.float32)"
        return value

    def emit_op(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            self.values[node] = self.values[node.args[0]][node.args[1]]
            return
        if node.target in ROW_OPS:
            args = [self.operand(a, self.full, node) for a in node.args]
            out = ROW_OPS[node.target](Row(self.temp, self.full[-1]), *args, **node.kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            names = tuple(self._name(o) for o in outs)
            self.values[node] = names if isinstance(out, tuple) else names[0]
            return
        target = _shape(node)
        self.cls(target)
        args = [self.operand(a, target, node) for a in node.args]
        kwargs = {k: self.operand(v, target, node) for k, v in node.kwargs.items()}
        if node.target == CAST:
            expr = _cast(args[0], node.args[0].meta["val"].dtype, node.meta["val"].dtype)
        else:
            expr = POINTWISE[node.target](*args, **kwargs)
        self.values[node] = self.temp(expr)

    def _name(self, expr: str) -> str:
        return expr if expr.startswith("COLUMN(") else self.temp(expr)

    def store(self, k: int, node: fx.Node) -> OutputSpec:
        value, val = self.values[node], node.meta["val"]
        spec = OutputSpec(tuple(val.shape), tuple(val.stride()), val.dtype, FULL)
        if isinstance(value, str) and value.startswith("COLUMN("):
            self.lines.append(f"tl.atomic_add(out{k} + cols, {value[7:-1]}, mask=mask)")
            return dataclasses.replace(spec, kind=COLUMN)
        kind = self.cls(val.shape)
        # the original op's strides (eager keeps an input's layout; later views rely on it)
        off = self.offset(TensorArg(spec.shape, spec.stride, val.dtype), spec.shape, kind == FULL)
        masked = ", mask=mask" if kind == FULL else ""
        if val.dtype == torch.bfloat16:
            value = self.temp(round_bf16(value))
        self.lines.append(f"tl.store(out{k} + ({off}), ({value}).to({TL_DTYPES[val.dtype]}){masked})")
        return dataclasses.replace(spec, kind=kind)


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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def generate(gm: fx.GraphModule, args: list[TensorArg], name_hint: str = "fused") -> KernelSource:
    """The Triton source of region `gm` for inputs described by `args`; raises
    Unsupported (with the reason) for a region the generator cannot emit."""
    em = _Emitter(gm, args)
    for node in em.ops:
        em.emit_op(node)
    outputs = tuple(em.store(k, node) for k, node in enumerate(em.outputs))
    if any(o.kind == COLUMN for o in outputs) and not em.row_kernel:
        raise Unsupported("column sums outside a row kernel")
    params = [f"in{i}" for i in range(len(args))] + [f"out{k}" for k in range(len(outputs))]
    body = em.prologue() + em.lines
    digest = hashlib.sha256("\n".join(body).encode()).hexdigest()[:12]
    name = f"{name_hint}_{digest}"
    text = "\n".join(["import triton", "import triton.language as tl", "", "",
                      "@triton.jit", f"def {name}({', '.join(params)}, BLOCK: tl.constexpr):"]
                     + [f"    {line}" for line in body]) + "\n"
    if em.row_kernel:
        grid, block = _numel(em.full[:-1]), _next_pow2(em.full[-1])
        return KernelSource(name, text, "row", grid, block, outputs)
    block = min(POINTWISE_BLOCK, _next_pow2(_numel(em.full)))
    return KernelSource(name, text, "pointwise", -(-_numel(em.full) // block), block, outputs)
