"""Every kernel family of the Triton code generator, run by Triton's interpreter, against
eager PyTorch and a float64 reference (tests/codegen_util.py's error model).

Shapes are drawn small and odd (sizes that do not fill a block), with broadcasting and
non-contiguous inputs; dtypes fp32 and fp16 (the interpreter has no bf16 arithmetic:
bf16 is covered by cast semantics). Few examples: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.compiler.codegen.ops import Unsupported
from autopar.compiler.codegen.triton_gen import TensorArg, generate
from tests.codegen_util import assert_error_model, region_of, run_both

aten = torch.ops.aten
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)
dims = st.integers(1, 3)
cols = st.integers(1, 19)
dtypes = st.sampled_from([torch.float32, torch.float16])


def _rand(shape, dtype, seed, transpose=False):
    gen = torch.Generator().manual_seed(seed)
    if transpose and len(shape) >= 2:  # same shape, non-contiguous: a transposed buffer
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return torch.randn(swapped, generator=gen).to(dtype).transpose(-1, -2)
    return torch.randn(shape, generator=gen).to(dtype)


def _gelu_tanh_chain(x, b):  # GPT-2's gelu_new on a biased input, as traced
    y = x + b
    return [0.5 * y * (1.0 + torch.tanh(0.7978845608028654 * (y + 0.044715 * torch.pow(y, 3.0))))]


@SETTINGS
@given(a=dims, b=dims, n=cols, dtype=dtypes, transpose=st.booleans(), seed=st.integers(0, 99))
def test_pointwise_chain_with_broadcast(a, b, n, dtype, transpose, seed):
    x = _rand((a, b, n), dtype, seed, transpose)
    bias = _rand((n,), dtype, seed + 1)
    assert_error_model(*run_both(_gelu_tanh_chain, x, bias))


@SETTINGS
@given(a=dims, n=cols, dtype=dtypes, seed=st.integers(0, 99))
def test_pointwise_backward_ops(a, n, dtype, seed):
    x, dy = _rand((a, n), dtype, seed), _rand((a, n), dtype, seed + 1)
    keep = _rand((a, 1), dtype, seed + 2) > 0  # a dropout-like mask, broadcast per row

    def fn(x, dy, keep):
        g = aten.gelu_backward(dy, x) + aten.silu_backward(dy, x) + aten.tanh_backward(dy, x)
        return [torch.where(keep, g * 2.0, g * 0.0),
                aten.gelu(x, approximate="tanh") - torch.sigmoid(x) / (x * x + 1.0)]
    assert_error_model(*run_both(fn, x, dy, keep))


@SETTINGS
@given(a=dims, b=dims, n=cols, dtype=dtypes, log=st.booleans(), transpose=st.booleans(),
       seed=st.integers(0, 99))
def test_softmax_forward_and_backward(a, b, n, dtype, log, transpose, seed):
    x, dy = _rand((a, b, n), dtype, seed, transpose), _rand((a, b, n), dtype, seed + 1)
    fwd = aten._log_softmax if log else aten._softmax
    bwd = aten._log_softmax_backward_data if log else aten._softmax_backward_data

    def fn(x, dy):
        y = fwd(x, -1, False)
        return [y, bwd(dy, y, -1, x.dtype)]
    assert_error_model(*run_both(fn, x, dy))


@SETTINGS
@given(a=dims, b=dims, n=cols, dtype=dtypes, affine=st.booleans(), seed=st.integers(0, 99))
def test_layer_norm_forward_and_backward(a, b, n, dtype, affine, seed):
    x, res = _rand((a, b, n), dtype, seed), _rand((a, b, n), dtype, seed + 1)
    w = _rand((n,), dtype, seed + 2) if affine else None
    bias = _rand((n,), dtype, seed + 3) if affine else None
    params = [w, bias] if affine else []

    def fwd(x, res, *wb):  # residual add + norm
        return list(aten.native_layer_norm(x + res, [n], *(wb or (None, None)), 1e-5))
    assert_error_model(*run_both(fwd, x, res, *params))
    out, mean, rstd = aten.native_layer_norm(x, [n], w, bias, 1e-5)

    def bwd(dy, x, mean, rstd, *wb):
        outs = aten.native_layer_norm_backward(dy, x, [n], mean, rstd, *(wb or (None, None)),
                                               [True, affine, affine])
        return [o for o in outs if o is not None]
    if dtype == torch.float16 and affine:  # weight gradients are summed with fp32 atomics
        region = region_of(bwd, res, x, mean, rstd, *params)
        with pytest.raises(Unsupported, match="half-precision weights"):
            generate(region.gm, [TensorArg.of(t) for t in (res, x, mean, rstd, *params)])
        return
    assert_error_model(*run_both(bwd, res, x, mean, rstd, *params))


@SETTINGS
@given(a=dims, b=dims, n=cols, dtype=dtypes, seed=st.integers(0, 99))
def test_rms_norm_chain(a, b, n, dtype, seed):
    x, w = _rand((a, b, n), dtype, seed), _rand((n,), dtype, seed + 1)

    def fn(x, w):  # Llama's RMSNorm, as traced (fp32 inside, cast back)
        h = aten._to_copy(x, dtype=torch.float32)
        var = aten.mean.dim(torch.pow(h, 2), [-1], True)
        normed = h * torch.rsqrt(var + 1e-6)
        return [w * aten._to_copy(normed, dtype=dtype), var]
    assert_error_model(*run_both(fn, x, w))


@SETTINGS
@given(a=dims, n=cols, keepdim=st.booleans(), seed=st.integers(0, 99))
def test_row_reductions(a, n, keepdim, seed):
    x = _rand((a, n), torch.float32, seed)

    def fn(x):
        return [aten.sum.dim_IntList(x * x, [-1], keepdim), aten.amax(x, [1], keepdim),
                aten.mean.dim(x, [-1], keepdim)]
    assert_error_model(*run_both(fn, x))


@SETTINGS
@given(a=dims, n=cols, seed=st.integers(0, 99))
def test_casts_round_as_eager(a, n, seed):
    """bf16/fp16 casts inside a kernel round exactly as eager's: outputs bit-identical."""
    x = _rand((a, n), torch.float32, seed) * 100

    def fn(x):
        return [aten._to_copy(aten._to_copy(x, dtype=torch.bfloat16), dtype=torch.float32),
                aten._to_copy(x * 3.0, dtype=torch.float16),
                aten._to_copy(x * 0.5, dtype=torch.bfloat16)]
    got, eager, _ = run_both(fn, x)
    for g, e in zip(got, eager):
        assert g.dtype == e.dtype and torch.equal(g, e)


def test_unsupported_region_says_why():
    x, w = torch.randn(4, 6), torch.randn(6)
    region = region_of(lambda x, w: [x * 2.0, w * 3.0], x, w)
    with pytest.raises(Unsupported, match="shape"):
        generate(region.gm, [TensorArg.of(x), TensorArg.of(w)])
    region = region_of(lambda x: [aten.amax(x, [0]) * 2.0], x)
    with pytest.raises(Unsupported, match="reduces dims"):
        generate(region.gm, [TensorArg.of(x)])


@SETTINGS
@given(a=dims, b=dims, n=cols, seed=st.integers(0, 99))
def test_views_and_column_sums(a, b, n, seed):
    """A backward chain through a reshape into a bias gradient (sum over all rows)."""
    x, dy = _rand((a, b, n), torch.float32, seed), _rand((a * b, n), torch.float32, seed + 1)

    def fn(x, dy):
        g = aten.gelu_backward(aten.view(dy, [a, b, n]), x)
        flat = aten.view(g, [a * b, n])
        return [flat, aten.sum.dim_IntList(flat, [0], True), aten.sum.dim_IntList(g, [0, 1])]
    assert_error_model(*run_both(fn, x, dy))


def test_cache_compiles_once_per_input_layout():
    x = torch.randn(3, 5)
    region = region_of(lambda x: [torch.exp(x) * 2.0], x)
    run_both(lambda x: [torch.exp(x) * 2.0], x)
    run_both(lambda x: [torch.exp(x) * 2.0], x.clone())
    assert len(region._kernels) == 1
    run_both(lambda x: [torch.exp(x) * 2.0], torch.randn(5, 3).t())
    assert len(region._kernels) == 2


def test_bf16_cast_ties_to_even():
    """Exact ties between two bf16 values round to the even one, as eager does."""
    ulp = 2.0 ** -7
    x = torch.tensor([[1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 3.0e38, float("inf"),
                       float("nan"), 0.0]])
    got, eager, _ = run_both(lambda x: [aten._to_copy(x, dtype=torch.bfloat16)], x)
    assert torch.allclose(got[0].float(), eager[0].float(), equal_nan=True, rtol=0, atol=0)


def test_custom_op_passes_opcheck():
    """Schema, fake (meta) implementation and AOT dispatch of autopar::fused, with a region
    whose outputs include a reshape of another output (the fallback copies it)."""
    from torch.library import opcheck

    x = torch.randn(4, 6)
    region = region_of(lambda x: [torch.exp(x) * 2.0, aten.view(torch.exp(x) * 2.0, [24])], x)
    result = opcheck(torch.ops.autopar.fused.default, (region.key, [x]))
    assert set(result.values()) == {"SUCCESS"}, result


def test_limits_are_declined_with_reasons():
    """Rows wider than one block, and tensors beyond int32 offsets, are not emitted."""
    wide = torch.randn(2, 20000)  # a vocabulary-sized softmax
    region = region_of(lambda x: [aten._softmax(x, -1, False)], wide)
    with pytest.raises(Unsupported, match="wider than one block"):
        generate(region.gm, [TensorArg.of(wide)])
    region = region_of(lambda x: [x * 2.0], torch.randn(2, 8))
    huge = TensorArg((2, 8), (2 ** 31, 1), torch.float32)
    with pytest.raises(Unsupported, match="int32"):
        generate(region.gm, [huge])
