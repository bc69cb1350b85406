"""Which aten ops the Triton code generator can emit, and the Triton expression of each.

Two families:

- pointwise ops (POINTWISE): each maps the Triton expressions of its tensor inputs
  (fp32 or bool values, broadcast by Triton) to one expression;
- row ops (ROW_OPS): reductions over the last dim and the composite ops built on one
  (softmax, log-softmax, their backwards, layer norm and its backward). They run in a
  row kernel, one program per row with a block over the reduced dim; `Row` gives them
  the helpers to reduce a value over the row (masked) and to name temporaries.

Besides them: reshapes (VIEWS), remaps (REMAPS: slice, cat, slice_backward, transpose,
permute, expand, which read their input at other indices; small middle-dim sums act as
one), constants (scalar_tensor), a dropout's mask draw (EMPTY, RANDOM) and in-place
variants of add/mul/div (INPLACE).

Every value inside a kernel is computed in fp32 (bool for comparisons); an explicit
cast (`_to_copy`) rounds through its dtype, as eager does, and stores cast to the
output's dtype. `unsupported_reason(node)` says why an op cannot be emitted (None if
it can); the fusion pass lists those reasons instead of dropping them silently.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

aten = torch.ops.aten

TL_DTYPES = {torch.float32: "tl.float32", torch.float16: "tl.float16",
             torch.bfloat16: "tl.bfloat16", torch.bool: "tl.int1"}


def lit(value) -> str:
    """A Python scalar as a Triton fp32 literal (an expression passes through)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1.0" if value else "0.0"
    value = float(value)
    if math.isinf(value):
        return "float('inf')" if value > 0 else "float('-inf')"
    return repr(value)


def round_bf16(x: str) -> str:
    """fp32 -> nearest bf16 (ties to even), kept in fp32. NOTE: Triton's interpreter casts
    to bf16 by truncation (measured: 39.2x -> 39.0 where eager gives 39.25), so the bits
    are rounded here; the cast after it is then exact on every backend."""
    bits = f"{x}.to(tl.uint32, bitcast=True)"
    rounded = f"(({bits} + 0x7FFF + (({bits} >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)"
    return f"tl.where({x} != {x}, {x}, {rounded})"


def _tanh(x: str) -> str:
    # NOTE: the interpreter cannot run libdevice, so tanh comes from exp: for |x| < 2^-4
    # the Taylor series (error < 1e-9) avoids the cancellation of 1 - exp(-2|x|)
    return (f"tl.where(tl.abs({x}) < 0.0625, {x} - {x}*{x}*{x}/3.0 + 2.0*{x}*{x}*{x}*{x}*{x}/15.0,"
            f" tl.where({x} < 0, -1.0, 1.0) * (1.0 - tl.exp(-2.0*tl.abs({x})))"
            f" / (1.0 + tl.exp(-2.0*tl.abs({x}))))")


def _pow(x: str, exponent) -> str:
    exponent = float(exponent)
    if exponent == 0.5:
        return f"tl.sqrt({x})"
    if exponent == -0.5:
        return f"tl.rsqrt({x})"
    n = int(exponent)
    if n != exponent or not -4 <= n <= 4 or n == 0:
        raise Unsupported(f"pow with exponent {exponent!r} (emitted: integers -4..4, +-0.5)")
    body = "*".join([f"({x})"] * abs(n))
    return f"({body})" if n > 0 else f"(1.0 / ({body}))"


def _gelu(x: str, approximate: str = "none") -> str:
    if approximate == "tanh":
        inner = f"0.7978845608028654 * ({x} + 0.044715 * {x}*{x}*{x})"
        return f"(0.5 * {x} * (1.0 + {_tanh(inner)}))"
    return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"


def _gelu_backward(dy: str, x: str, approximate: str = "none") -> str:
    if approximate == "tanh":
        inner = f"0.7978845608028654 * ({x} + 0.044715 * {x}*{x}*{x})"
        t = _tanh(inner)
        return (f"({dy} * (0.5 * (1.0 + {t}) + 0.5 * {x} * (1.0 - {t}*{t}) * "
                f"0.7978845608028654 * (1.0 + 0.134145 * {x}*{x})))")
    cdf = f"(0.5 * (1.0 + tl.erf({x} * 0.7071067811865476)))"
    pdf = f"(0.3989422804014327 * tl.exp(-0.5 * {x}*{x}))"
    return f"({dy} * ({cdf} + {x} * {pdf}))"


def _add(x, y, alpha=1):
    return f"({x} + {y})" if float(alpha) == 1 else f"({x} + {y} * {lit(alpha)})"


def _sub(x, y, alpha=1):
    return f"({x} - {y})" if float(alpha) == 1 else f"({x} - {y} * {lit(alpha)})"


POINTWISE: dict[object, Callable[..., str]] = {
    aten.add.Tensor: _add, aten.add.Scalar: _add, aten.sub.Tensor: _sub, aten.sub.Scalar: _sub,
    aten.rsub.Scalar: lambda x, y, alpha=1: _sub(y, x, alpha),
    aten.mul.Tensor: lambda x, y: f"({x} * {y})", aten.mul.Scalar: lambda x, y: f"({x} * {y})",
    aten.div.Tensor: lambda x, y: f"({x} / {y})", aten.div.Scalar: lambda x, y: f"({x} / {y})",
    aten.neg.default: lambda x: f"(-{x})",
    aten.exp.default: lambda x: f"tl.exp({x})",
    aten.log.default: lambda x: f"tl.log({x})",
    aten.sqrt.default: lambda x: f"tl.sqrt({x})",
    aten.rsqrt.default: lambda x: f"tl.rsqrt({x})",
    aten.sin.default: lambda x: f"tl.sin({x})",
    aten.cos.default: lambda x: f"tl.cos({x})",
    aten.abs.default: lambda x: f"tl.abs({x})",
    aten.tanh.default: _tanh,
    aten.sigmoid.default: lambda x: f"tl.sigmoid({x})",
    aten.relu.default: lambda x: f"tl.maximum({x}, 0.0)",
    aten.silu.default: lambda x: f"({x} * tl.sigmoid({x}))",
    aten.pow.Tensor_Scalar: _pow,
    aten.gelu.default: _gelu,
    aten.gelu_backward.default: _gelu_backward,
    aten.tanh_backward.default: lambda dy, y: f"({dy} * (1.0 - {y}*{y}))",
    aten.sigmoid_backward.default: lambda dy, y: f"({dy} * {y} * (1.0 - {y}))",
    aten.silu_backward.default: lambda dy, x: (
        f"({dy} * tl.sigmoid({x}) * (1.0 + {x} * (1.0 - tl.sigmoid({x}))))"),
    aten.threshold_backward.default: lambda dy, x, t: f"tl.where({x} <= {lit(t)}, 0.0, {dy})",
    aten.where.self: lambda c, x, y: f"tl.where({c}, {x}, {y})",
    aten.masked_fill.Scalar: lambda x, m, v: f"tl.where({m}, {lit(v)}, {x})",
    aten.eq.Tensor: lambda x, y: f"({x} == {y})", aten.eq.Scalar: lambda x, y: f"({x} == {y})",
    aten.ne.Tensor: lambda x, y: f"({x} != {y})", aten.ne.Scalar: lambda x, y: f"({x} != {y})",
    aten.lt.Tensor: lambda x, y: f"({x} < {y})", aten.lt.Scalar: lambda x, y: f"({x} < {y})",
    aten.le.Tensor: lambda x, y: f"({x} <= {y})", aten.le.Scalar: lambda x, y: f"({x} <= {y})",
    aten.gt.Tensor: lambda x, y: f"({x} > {y})", aten.gt.Scalar: lambda x, y: f"({x} > {y})",
    aten.ge.Tensor: lambda x, y: f"({x} >= {y})", aten.ge.Scalar: lambda x, y: f"({x} >= {y})",
    aten.clone.default: lambda x, memory_format=None: x,
}
# in-place variants (a dropout scales its mask with div_): the same expression, allowed when
# nothing but the op reads the tensor it overwrites (`unsupported_reason`)
INPLACE = {aten.div_.Scalar: aten.div.Scalar, aten.div_.Tensor: aten.div.Tensor,
           aten.mul_.Scalar: aten.mul.Scalar, aten.mul_.Tensor: aten.mul.Tensor,
           aten.add_.Scalar: aten.add.Scalar, aten.add_.Tensor: aten.add.Tensor}
POINTWISE.update({op: POINTWISE[of] for op, of in INPLACE.items()})
# a dropout's mask: `bernoulli_(empty_like(x), keep)` draws it in place into an
# uninitialized tensor. In a kernel the tensor is nothing and the draw is Philox
# (`tl.rand`) with a seed the launch takes from torch's generator (kernels.py)
EMPTY = aten.empty_like.default
RANDOM = aten.bernoulli_.float
# ops whose inputs are cast to fp32 by eager too: an fp16 compare or where is exact in fp32
CAST = aten._to_copy.default


class Unsupported(Exception):
    """The code generator cannot emit this op or region; the message says why."""


class Row:
    """What a row op may use: masked reductions over the row and fresh temporaries."""

    def __init__(self, emit: Callable[[str], str], n: int):
        self.emit = emit  # emit(expr) -> the name of a new temporary holding it
        self.n = n  # length of the reduced (last) dim

    def sum(self, x: str) -> str:
        return self.emit(f"tl.sum(tl.where(mask, {x}, 0.0), axis=0)")

    def max(self, x: str) -> str:
        return self.emit(f"tl.max(tl.where(mask, {x}, float('-inf')), axis=0)")


def _softmax(r: Row, x, dim, half_to_float):
    e = r.emit(f"tl.exp({x} - {r.max(x)})")
    return f"({e} / {r.sum(e)})"


def _safe_softmax(r: Row, x, dim, dtype=None):
    """softmax, but 0 over a row that is all -inf (a fully masked attention row), not NaN."""
    top = r.max(x)
    masked = r.emit(f"({top} == float('-inf'))")
    e = r.emit(f"tl.exp({x} - tl.where({masked}, 0.0, {top}))")  # all 0 on a masked row
    return f"({e} / tl.where({masked}, 1.0, {r.sum(e)}))"


def _log_softmax(r: Row, x, dim, half_to_float):
    shifted = r.emit(f"({x} - {r.max(x)})")
    return f"({shifted} - tl.log({r.sum(f'tl.exp({shifted})')}))"


def _softmax_backward(r: Row, dy, y, dim, input_dtype):
    return f"({y} * ({dy} - {r.sum(f'{dy} * {y}')}))"


def _log_softmax_backward(r: Row, dy, y, dim, input_dtype):
    return f"({dy} - tl.exp({y}) * {r.sum(dy)})"


def _layer_norm(r: Row, x, shape, weight, bias, eps):
    mean = r.emit(f"{r.sum(x)} / {r.n}.0")
    centred = r.emit(f"({x} - {mean})")
    rstd = r.emit(f"tl.rsqrt({r.sum(f'{centred} * {centred}')} / {r.n}.0 + {lit(eps)})")
    out = f"{centred} * {rstd}"
    out = f"({out} * {weight})" if weight is not None else out
    out = f"({out} + {bias})" if bias is not None else out
    return out, mean, rstd


def _layer_norm_backward(r: Row, dy, x, shape, mean, rstd, weight, bias, mask):
    xhat = r.emit(f"(({x} - {mean}) * {rstd})")
    g = r.emit(f"({dy} * {weight})" if weight is not None else dy)
    dx = f"({rstd} * ({g} - {r.sum(g)} / {r.n}.0 - {xhat} * {r.sum(f'{g} * {xhat}')} / {r.n}.0))"
    # weight and bias gradients sum over rows: column partials, added atomically
    return dx, f"COLUMN(cols, {dy} * {xhat})", f"COLUMN(cols, {dy})"


def _sum(r: Row, x, dims, keepdim=False, dtype=None):
    return r.sum(x)


def _mean(r: Row, x, dims, keepdim=False, dtype=None):
    return f"({r.sum(x)} / {r.n}.0)"


def _amax(r: Row, x, dims, keepdim=False):
    return r.max(x)


ROW_OPS: dict[object, Callable[..., object]] = {
    aten._softmax.default: _softmax, aten._log_softmax.default: _log_softmax,
    aten._safe_softmax.default: _safe_softmax,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.sum.dim_IntList: _sum, aten.mean.dim: _mean, aten.amax.default: _amax,
}
# passes over its inputs an unfused aten op makes. NOTE: PyTorch's CUDA layer-norm backward
# launches a dX kernel and a separate dgamma/dbeta kernel (layer_norm_kernel.cu), each
# reading dY and X; the fused row kernel reads them once
ATEN_INPUT_PASSES = {aten.native_layer_norm_backward.default: 2}
# reshapes of contiguous tensors: the same elements in the same order, so inside a kernel
# a view is a new name for its input (a region no longer ends at every reshape)
VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
                   aten.squeeze.dim, aten.squeeze.dims})
# ops that read their input at other indices: a slice, a concatenation, a slice's gradient
# (the slice placed in zeros). Inside a kernel each is index arithmetic on what it reads,
# never a copy (triton_gen's `_Emitter.at`): Llama's rotary embedding (slices, neg, cat)
# and its backward (slice_backward) fuse with the multiplies around them
# Transposes, permutes and expands (LAYOUT_VIEWS) are remaps too: inside a kernel they
# re-index what they read; at a region's edge they stay views (fuse_regions._trim_views)
LAYOUT_VIEWS = frozenset({aten.transpose.int, aten.permute.default, aten.t.default,
                          aten.expand.default})
REMAPS = frozenset({aten.slice.Tensor, aten.cat.default, aten.slice_backward.default}) \
    | LAYOUT_VIEWS
# a sum over a few elements of dims other than the last (grouped-query attention's key and
# value gradients, summed over the heads that share them): unrolled, one load per summed
# element, like a remap that reads several indices
MAX_UNROLLED_SUM = 16
# a 0-d constant: a literal in the kernel (a masked fill's value)
CONSTANT = aten.scalar_tensor.default
REDUCTIONS = frozenset({aten.sum.dim_IntList, aten.mean.dim, aten.amax.default})
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _val(node) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _reduced_dim_reason(node: fx.Node) -> str | None:
    """Row ops reduce the last dim of their first input only."""
    x = _val(node.args[0])
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return "a row op needs a tensor input with at least one dim"
    if node.target in (aten.native_layer_norm.default, aten.native_layer_norm_backward.default):
        shape = node.args[2] if node.target == aten.native_layer_norm_backward.default \
            else node.args[1]
        return None if list(shape) == [x.shape[-1]] else f"normalizes over {list(shape)}, not " \
            "only the last dim"
    backward = node.target in (aten._softmax_backward_data.default,
                               aten._log_softmax_backward_data.default)
    dims = node.args[2] if backward else node.args[1]
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if [d % x.dim() for d in dims] != [x.dim() - 1]:
        return f"reduces dims {dims} of a {x.dim()}-d tensor (emitted: the last dim only)"
    if node.target == aten._safe_softmax.default and (
            len(node.args) > 2 and node.args[2] is not None
            or node.kwargs.get("dtype") is not None):
        return "_safe_softmax with a dtype argument"
    if node.target in REDUCTIONS and (len(node.args) > 3 or node.kwargs.get("dtype") is not None):
        return "reduction with a dtype argument"
    return None


def has_lowering(node: fx.Node) -> bool:
    return (node.target in POINTWISE or node.target in ROW_OPS or node.target == CAST
            or node.target in VIEWS or node.target in REMAPS or node.target == CONSTANT
            or node.target in (EMPTY, RANDOM))


def moves_no_data(node: fx.Node) -> bool:
    """Views (reshapes, slices, `_unsafe_view`) and getitems: as aten ops they read and
    write nothing."""
    return node.target is operator.getitem or node.target in VIEWS or (
        isinstance(node.target, torch._ops.OpOverload) and node.target.is_view)


def constant(node: fx.Node) -> str:
    """A scalar_tensor's value as an fp32 literal, rounded to its dtype as eager makes it."""
    return lit(torch.scalar_tensor(node.args[0], dtype=node.meta["val"].dtype).item())


def is_unrolled_sum(node: fx.Node) -> bool:
    """A sum over at most MAX_UNROLLED_SUM elements of dims other than the last."""
    if node.target != aten.sum.dim_IntList or len(node.args) > 3 or node.kwargs.get("dtype"):
        return False
    x = _val(node.args[0])
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or \
            not isinstance(node.args[1], (list, tuple)):
        return False
    dims = {d % x.dim() for d in node.args[1]}
    return x.dim() - 1 not in dims and dims != set(range(x.dim() - 1)) and \
        math.prod(x.shape[d] for d in dims) <= MAX_UNROLLED_SUM


def is_remap(node: fx.Node) -> bool:
    """Reads its input at other indices than its own element's (see REMAPS)."""
    return node.target in REMAPS or is_unrolled_sum(node)


def is_column_sum(node: fx.Node) -> bool:
    """A sum over every dim but the last (a bias gradient): summed with atomics per column."""
    if node.target != aten.sum.dim_IntList:
        return False
    x = _val(node.args[0])
    dims = node.args[1]
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(dims, (list, tuple)):
        return False
    return sorted(d % x.dim() for d in dims) == list(range(x.dim() - 1))


def is_row_op(node: fx.Node) -> bool:
    return node.target in ROW_OPS and not is_column_sum(node) and not is_unrolled_sum(node)


def unsupported_reason(node: fx.Node) -> str | None:
    """None if the code generator can emit `node`, else why not."""
    if node.op != "call_function":
        return "not an op"
    if node.target is operator.getitem:
        return None
    if not has_lowering(node):
        return f"{node.target} has no Triton lowering"
    outs = _val(node)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    tensors = [v for v in (*[_val(a) for a in node.all_input_nodes], *outs) if v is not None]
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype not in (*FLOAT_DTYPES, torch.bool):
            return f"dtype {getattr(t, 'dtype', type(t).__name__)} (emitted: float32/16, bf16, bool)"
    if node.target == CAST and set(node.kwargs) - {"dtype", "layout", "device"}:
        return f"_to_copy with {sorted(set(node.kwargs) - {'dtype', 'layout', 'device'})}"
    if node.target == aten.pow.Tensor_Scalar:
        try:
            _pow("x", node.args[1])
        except Unsupported as exc:
            return str(exc)
    if node.target == aten.native_layer_norm_backward.default and \
            any(isinstance(v, torch.Tensor) and v.dtype != torch.float32 for v in outs[1:]):
        return "layer norm backward with half-precision weights (summed with fp32 atomics)"
    if node.target in INPLACE or node.target == RANDOM:
        target = node.args[0]
        if not isinstance(target, fx.Node) or target.op != "call_function" or len(target.users) > 1:
            return ("an in-place op on a tensor something else reads (emitted: on a tensor "
                    "only it reads)")
    if node.target == RANDOM and (len(node.args) > 2 or node.kwargs.get("generator") is not None):
        return "bernoulli_ with its own generator"
    if node.target == EMPTY and any(u.target != RANDOM for u in node.users):
        return "empty_like read before anything writes it"
    if node.target == CONSTANT and outs[0].dtype == torch.bool:
        return "a bool constant (emitted: float constants)"
    if node.target in REMAPS and any(t.numel() == 0 for t in tensors):
        return f"{node.target} of an empty tensor"
    if node.target in VIEWS and not all(t.is_contiguous() for t in tensors):
        return "a view of a non-contiguous tensor (a kernel reads views as reshapes)"
    if is_column_sum(node):
        return None if outs[0].dtype == torch.float32 and len(node.args) <= 3 and \
            node.kwargs.get("dtype") is None else "a column sum into a non-fp32 tensor (atomics)"
    if is_unrolled_sum(node):
        return None
    if node.target in ROW_OPS:
        return _reduced_dim_reason(node)
    return None
