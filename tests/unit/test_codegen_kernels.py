"""Every kernel family of the Triton code generator, run by Triton's interpreter, against
eager PyTorch and a float64 reference (tests/codegen_util.py's error model).

Shapes are drawn small and odd (sizes that do not fill a block), with broadcasting and
non-contiguous inputs; dtypes fp32 and fp16 (the interpreter has no bf16 arithmetic:
bf16 is covered by cast semantics). Few examples: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.compiler.codegen.kernels import backend
from autopar.compiler.codegen.ops import Unsupported
from autopar.compiler.codegen.triton_gen import Launch, TensorArg, generate
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
@given(a=dims, n=cols, dtype=dtypes, seed=st.integers(0, 99))
def test_masked_fill_scale_and_softmax(a, n, dtype, seed):
    """Attention's unfused scores (a GPU without fused attention): scaled, a causal mask
    broadcast over the rows' batch filled with -inf, softmax; and the backward's
    masked_fill with 0."""
    x, dy = _rand((a, n, n), dtype, seed), _rand((a, n, n), dtype, seed + 1)
    masked = ~torch.ones(n, n, dtype=torch.bool).tril()

    def fn(x, dy, masked):
        y = aten._softmax(aten.masked_fill.Scalar(x * 0.125, masked, float("-inf")), -1, False)
        return [y, aten.masked_fill.Scalar(dy, masked, 0.0)]
    assert_error_model(*run_both(fn, x, dy, masked))


@SETTINGS
@given(a=dims, b=dims, n=cols, dtype=dtypes, seed=st.integers(0, 99))
def test_safe_softmax_gives_zero_on_fully_masked_rows(a, b, n, dtype, seed):
    """_safe_softmax (SDPA's math path): a softmax, except that a row of -inf gives zeros."""
    x = _rand((a, b, n), dtype, seed)
    x[0, 0] = float("-inf")  # a fully masked row
    x[-1, -1, 0] = float("-inf")  # one masked element
    got, eager, ref = run_both(lambda x: [aten._safe_softmax(x, -1)], x)
    assert torch.equal(got[0][0, 0], torch.zeros(n, dtype=dtype))
    assert_error_model(got, eager, ref)


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


def test_a_regions_verdict_is_kept_per_inputs(monkeypatch):
    """FusedRegion.check generates a region's source once per inputs to learn whether it
    can be emitted, and says the generator's reason again for inputs it was refused."""
    from autopar.compiler.codegen import kernels

    calls = []
    monkeypatch.setattr(kernels, "generate", lambda *a: calls.append(a) or generate(*a))
    x, w, y = torch.randn(4, 6), torch.randn(6), torch.randn(6, 4).t()
    mixed = region_of(lambda x, w: [x * 2.0, w * 3.0], x, w)
    for _ in range(2):
        with pytest.raises(Unsupported, match="shape"):
            mixed.check([TensorArg.of(x), TensorArg.of(w)])
    assert len(calls) == 1
    scaled = region_of(lambda x: [x * 2.0 + 1.0], x)
    for t in (x, x, y, y):  # another stride is other inputs
        scaled.check([TensorArg.of(t)])
    assert len(calls) == 3


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


@SETTINGS
@given(a=dims, b=dims, h=st.integers(1, 9), dtype=dtypes, transpose=st.booleans(),
       seed=st.integers(0, 99))
def test_rotary_slices_cat_and_slice_backward(a, b, h, dtype, transpose, seed):
    """Llama's rotary embedding as traced (slices, neg, cat) and its backward (the slices'
    gradients placed in zeros by slice_backward), each one kernel: remaps are index
    arithmetic on what they read, over a non-contiguous input too."""
    x = _rand((a, b, 2 * h), dtype, seed, transpose)
    cos, sin = _rand((b, 2 * h), dtype, seed + 1), _rand((b, 2 * h), dtype, seed + 2)

    def forward(x, cos, sin):
        rotated = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
        return [x * cos + rotated * sin]

    def backward(g, cos, sin):
        gs = g * sin
        return [g * cos + aten.slice_backward(-gs[..., :h], list(g.shape), 2, h, 2 ** 63 - 1, 1)
                + aten.slice_backward(gs[..., h:], list(g.shape), 2, 0, h, 1)]
    for fn in (forward, backward):
        got, eager, ref = run_both(fn, x, cos, sin)
        assert_error_model(got, eager, ref)
        assert len(region_of(fn, x, cos, sin)._kernels) == 1


@SETTINGS
@given(a=st.integers(1, 4), n=st.integers(1, 13), dim=st.integers(0, 1), start=st.integers(-3, 4),
       step=st.integers(1, 3), seed=st.integers(0, 99))
def test_remaps_with_offsets_steps_and_reshapes(a, n, dim, start, step, seed):
    """A strided slice (negative starts as eager clamps them) and its gradient, and a cat
    of three parts along either dim: a slice, an input and a reshape of a computed value."""
    x = _rand((a, n), torch.float32, seed)
    size = (a, n)[dim]
    begin = max(start + size if start < 0 else start, 0)
    part = x[:, start::step] if dim else x[start::step]
    assume(part.numel() and part.shape != x.shape)  # a whole-tensor slice traces as alias

    def sliced(x):
        return (x[:, start::step] if dim else x[start::step]) * 2.0

    def placed(x):
        return [aten.slice_backward(sliced(x), [a, n], dim, begin, 2 ** 63 - 1, step) + x]

    def joined(x):
        flat = aten.view(x.exp(), [n, a] if dim == 0 else [a, n])
        return [torch.cat([sliced(x), x, aten.view(flat, [a, n])], dim) - 1.0]
    assert_error_model(*run_both(placed, x))
    assert_error_model(*run_both(joined, x))


@SETTINGS
@given(a=dims, r=st.integers(1, 4), b=dims, n=cols, dims_=st.sampled_from([[1], [-3], [0, 1]]),
       keepdim=st.booleans(), transpose=st.booleans(), seed=st.integers(0, 99))
def test_small_middle_dim_sums_unroll(a, r, b, n, dims_, keepdim, transpose, seed):
    """A sum over a few elements of dims other than the last (grouped-query attention's
    key and value gradients, summed over the heads sharing them): one load per summed
    element, fused with the pointwise ops after it."""
    x = _rand((a, r, b, n), torch.float32, seed, transpose)
    assert_error_model(*run_both(
        lambda x: [aten.sum.dim_IntList(x, dims_, keepdim) * 2.0 + 1.0], x))


def test_large_middle_dim_sums_are_declined():
    x = torch.randn(17, 2, 3)
    region = region_of(lambda x: [aten.sum.dim_IntList(x, [0]) * 2.0], x)
    with pytest.raises(Unsupported, match="reduces dims"):
        generate(region.gm, [TensorArg.of(x)])


@SETTINGS
@given(a=dims, b=dims, n=cols, perm=st.permutations([0, 1, 2]), dtype=dtypes,
       seed=st.integers(0, 99))
def test_transposes_permutes_and_expands_reindex(a, b, n, perm, dtype, seed):
    """SDPA's math path scales q and k, expands and copies them (`mul`, `expand`, `clone`)
    and the backward copies transposes: inside a kernel a transpose, permute or expand
    reads its input at the corresponding index, with a contiguous output."""
    x, y = _rand((a, b, n), dtype, seed), _rand((1, b, 1), dtype, seed + 1)

    def fn(x, y):
        moved = aten.permute(x * 0.5, perm)
        wide = aten.expand(y.exp(), [a, b, n])
        return [aten.clone(moved, memory_format=torch.contiguous_format) + 1.0,
                aten.clone(aten.transpose(wide + x, 0, 2), memory_format=torch.contiguous_format)]
    assert_error_model(*run_both(lambda x, y: fn(x, y)[:1], x, y))
    assert_error_model(*run_both(lambda x, y: fn(x, y)[1:], x, y))


def test_constants_round_to_their_dtype():
    """scalar_tensor (a masked fill's value) is a literal, rounded as eager makes it: fp16's
    most negative value stays finite, a wider one becomes -inf."""
    keep = (torch.arange(21).view(3, 1, 7) % 3 == 0).expand(3, 4, 7)  # broadcast: stride 0
    x = _rand((3, 4, 7), torch.float16, 0)

    def fn(keep, x):
        low = aten.scalar_tensor(-65504.0, dtype=torch.float16)
        lower = aten.scalar_tensor(-1e30, dtype=torch.float16)
        return [torch.where(keep, low, lower) + x, torch.where(keep, x, low)]
    got, eager, _ = run_both(fn, keep, x)
    assert torch.isinf(eager[0]).any() and torch.isfinite(eager[1]).all()
    assert all(torch.equal(g, e) for g, e in zip(got, eager))  # one fp16 rounding each


def test_a_reduction_read_at_other_indices_says_why():
    x = torch.randn(4, 6)
    region = region_of(lambda x: [torch.cat([aten._softmax(x, -1, False), x], 0) * 2.0], x)
    with pytest.raises(Unsupported, match="read at other indices"):
        generate(region.gm, [TensorArg.of(x)])


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


def test_tensors_beyond_int32_offsets_get_int64_indices():
    """A tensor spanning 2^31 elements or more (tensor parallelism slices a head range out
    of a replicated score tensor that big) widens the kernel's indices to int64, a
    dropout's draw over that many elements too (its Philox offsets are int64)."""
    region = region_of(lambda x: [x * 2.0], torch.randn(2, 8))
    huge = TensorArg((2, 8), (2 ** 31, 1), torch.float32)
    assert "tl.program_id(0).to(tl.int64)" in generate(region.gm, [huge]).text
    assert "to(tl.int64)" not in generate(region.gm, [TensorArg.of(torch.randn(2, 8))]).text
    region = region_of(lambda x: list(_dropout(x)), torch.randn(2, 8))
    generate(region.gm, [huge])  # the mask itself is small
    big = torch.empty(2 ** 16, 2 ** 15, device="meta")  # 2^31 elements, none allocated
    mask = generate(make_fx(lambda x: list(_dropout(x)))(big), [TensorArg.of(big)])
    assert "tl.program_id(0).to(tl.int64)" in mask.text and "tl.rand(" in mask.text


def test_a_dropout_with_int64_offsets_draws_the_int32_kernels_mask(monkeypatch):
    """Below 2^32 an int64 offset is Philox's low counter word alone, as an int32 one is:
    the widened kernel draws the very mask the int32 kernel draws under the same seed."""
    from autopar.compiler.codegen import kernels, triton_gen

    x = _rand((37, 53), torch.float32, 0)
    masks = []
    for limit in (triton_gen.INT32_LIMIT, 1):
        monkeypatch.setattr(triton_gen, "INT32_LIMIT", limit)
        monkeypatch.setattr(kernels, "_REGIONS", {})
        region = region_of(lambda x: list(_dropout(x)), x)
        assert ("to(tl.int64)" in region.source([TensorArg.of(x)]).text) == (limit == 1)
        with backend("triton"):
            torch.manual_seed(0)
            masks.append(region.run([x])[0])
    assert torch.equal(masks[0], masks[1]) and (masks[0] == 0).any()


@pytest.fixture
def wide_indices(monkeypatch):
    """Every kernel computes its indices in int64 (kernels compiled before are set aside)."""
    from autopar.compiler.codegen import kernels, triton_gen

    monkeypatch.setattr(triton_gen, "INT32_LIMIT", 1)
    monkeypatch.setattr(kernels, "_REGIONS", {})


def test_int64_indices_give_the_same_results(wide_indices):
    """The int64 path on small tensors, under the interpreter: a broadcast transposed
    pointwise chain, a softmax with its backward, a layer norm with its weight and bias
    gradients (column sums), a rotary embedding (remaps)."""
    x, dy = _rand((3, 4, 9), torch.float32, 0, True), _rand((3, 4, 9), torch.float32, 1)
    w, b = _rand((9,), torch.float32, 2), _rand((9,), torch.float32, 3)

    def norm(x, dy, w, b):
        y, mean, rstd = aten.native_layer_norm(x, [9], w, b, 1e-5)
        return [y, *aten.native_layer_norm_backward(dy, x, [9], mean, rstd, w, b,
                                                    [True, True, True])]

    def softmax(x, dy):
        y = aten._softmax(x, -1, False)
        return [y, aten._softmax_backward_data(dy, y, -1, x.dtype)]

    def rotary(x, w):
        return [x * w + torch.cat((-x[..., 5:], x[..., :5]), dim=-1) * w]
    cases = [(_gelu_tanh_chain, (x, b)), (norm, (x, dy, w, b)), (softmax, (x, dy)),
             (rotary, (x, w))]
    for fn, inputs in cases:
        source = generate(region_of(fn, *inputs).gm, [TensorArg.of(t) for t in inputs])
        assert "to(tl.int64)" in source.text, fn.__name__
        assert_error_model(*run_both(fn, *inputs))


# -- looped row kernels: rows wider than one block ---------------------------------------------

@pytest.fixture
def tiny_blocks(monkeypatch):
    """Rows wider than 4 columns loop over blocks of 4: every family below loops, odd
    sizes end in a partial block (kernels compiled before are set aside)."""
    from autopar.compiler.codegen import kernels, triton_gen

    monkeypatch.setattr(triton_gen, "MAX_ROW_BLOCK", 4)
    monkeypatch.setattr(triton_gen, "LOOP_BLOCK", 4)
    monkeypatch.setattr(kernels, "_REGIONS", {})


# the fixture's patches hold for every example of a test (they are not per-input state)
LOOPED = settings(max_examples=4, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
wide = st.integers(5, 19)


@LOOPED
@given(a=dims, n=wide, log=st.booleans(), transpose=st.booleans(), seed=st.integers(0, 99))
def test_looped_softmax_forward_and_backward(tiny_blocks, a, n, log, transpose, seed):
    x, dy = _rand((a, 2, n), torch.float32, seed, transpose), _rand((a, 2, n), torch.float32, seed + 1)
    fwd = aten._log_softmax if log else aten._softmax
    bwd = aten._log_softmax_backward_data if log else aten._softmax_backward_data

    def fn(x, dy):
        y = fwd(x, -1, False)
        return [y, bwd(dy, y, -1, x.dtype)]
    region = region_of(fn, x, dy)
    src = generate(region.gm, [TensorArg.of(x), TensorArg.of(dy)])
    assert src.kind == "looped row" and src.block == 4
    # log-softmax: max and the backward's sum of dy need nothing pending (one loop),
    # then exp's sum, then the stores; softmax's backward sums dy * y, which needs
    # exp's sum first: one loop more
    assert src.text.count("for start in range") == (3 if log else 4)
    assert_error_model(*run_both(fn, x, dy))


@LOOPED
@given(a=dims, n=wide, dtype=dtypes, seed=st.integers(0, 99))
def test_looped_layer_norm_forward_and_backward(tiny_blocks, a, n, dtype, seed):
    x, res = _rand((a, n), dtype, seed), _rand((a, n), dtype, seed + 1)
    w, bias = _rand((n,), torch.float32, seed + 2), _rand((n,), torch.float32, seed + 3)

    def fwd(x, res, w, b):
        return list(aten.native_layer_norm(x + res, [n], w, b, 1e-5))
    if dtype == torch.float32:
        assert_error_model(*run_both(fwd, x, res, w, bias))
        out, mean, rstd = aten.native_layer_norm(x, [n], w, bias, 1e-5)

        def bwd(dy, x, mean, rstd, w, b):  # column sums: atomics inside the last loop
            return list(aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b,
                                                        [True, True, True]))
        assert_error_model(*run_both(bwd, res, x, mean, rstd, w, bias))
    else:
        h = _rand((n,), dtype, seed + 2)

        def rms(x, w):  # Llama's RMSNorm
            f = aten._to_copy(x, dtype=torch.float32)
            var = aten.mean.dim(torch.pow(f, 2), [-1], True)
            return [w * aten._to_copy(f * torch.rsqrt(var + 1e-6), dtype=dtype), var]
        assert_error_model(*run_both(rms, x, h))


@LOOPED
@given(a=dims, n=wide, keepdim=st.booleans(), seed=st.integers(0, 99))
def test_looped_row_reductions(tiny_blocks, a, n, keepdim, seed):
    x = _rand((a, n), torch.float32, seed)

    def fn(x):
        return [aten.sum.dim_IntList(x * x, [-1], keepdim), aten.amax(x, [1], keepdim),
                aten.mean.dim(x, [-1], keepdim), x * 2.0]
    assert_error_model(*run_both(fn, x))


@LOOPED
@given(a=dims, n=wide, seed=st.integers(0, 99))
def test_looped_safe_softmax(tiny_blocks, a, n, seed):
    x = _rand((a, 2, n), torch.float32, seed)
    x[0, 0] = float("-inf")
    region = region_of(lambda x: [aten._safe_softmax(x, -1)], x)
    assert generate(region.gm, [TensorArg.of(x)]).kind == "looped row"
    got, eager, ref = run_both(lambda x: [aten._safe_softmax(x, -1)], x)
    assert not got[0][0, 0].any()
    assert_error_model(got, eager, ref)


def test_vocabulary_wide_log_softmax_loops_in_blocks():
    """A 50k vocabulary's log-softmax with its backward: a looped row kernel."""
    x, dy = torch.randn(2, 50257), torch.randn(2, 50257)

    def fn(x, dy):
        y = aten._log_softmax(x, -1, False)
        return [y, aten._log_softmax_backward_data(dy, y, -1, x.dtype)]
    src = generate(region_of(fn, x, dy).gm, [TensorArg.of(x), TensorArg.of(dy)])
    assert src.kind == "looped row" and src.grid == 2 and src.block == 4096
    assert_error_model(*run_both(fn, x, dy))


def _launched(fn, inputs, launch):
    """Outputs of `fn`'s region as the kernel generated under `launch` computes them."""
    from autopar.compiler.codegen import kernels

    region = region_of(fn, *inputs)
    src = generate(region.gm, [TensorArg.of(x) for x in inputs], "test", launch)
    return src, kernels._launcher(src, kernels._compile(src))(list(inputs))


@pytest.mark.parametrize("launch", [Launch(4, 2, True), Launch(8, 1, True), Launch(32, 8, False),
                                    Launch(16, 4)])
def test_a_launch_chosen_instead_of_the_rule_gives_the_same_results(launch):
    """Every launch `benchmarks/fusion_gpu.py --sweep` times computes what the rule's
    does: a 13-column softmax and layer norm looped in blocks of 4 or 8, held whole at
    more warps, and a pointwise chain over blocks of 16."""
    x, dy = _rand((3, 2, 13), torch.float32, 0), _rand((3, 2, 13), torch.float32, 1)
    w, b = _rand((13,), torch.float32, 2), _rand((13,), torch.float32, 3)

    def softmax(x, dy):
        y = aten._log_softmax(x, -1, False)
        return [y, aten._log_softmax_backward_data(dy, y, -1, x.dtype)]

    def norm(x, dy, w, b):
        out, mean, rstd = aten.native_layer_norm(x, [13], w, b, 1e-5)
        return [out, *aten.native_layer_norm_backward(dy, x, [13], mean, rstd, w, b,
                                                       [True, True, True])]
    for fn, inputs in ((softmax, (x, dy)), (norm, (x, dy, w, b)),
                       (_gelu_tanh_chain, (x, dy))):
        src, got = _launched(fn, inputs, launch)
        if src.kind == "pointwise":
            assert src.block == launch.block and src.grid == -(-x.numel() // launch.block)
        else:
            assert src.kind == ("looped row" if launch.looped else "row")
        assert (src.block, src.num_warps) == (launch.block, launch.num_warps)
        eager = region_of(fn, *inputs).fallback(list(inputs))
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_a_row_held_whole_in_a_smaller_block_is_refused():
    x = _rand((3, 13), torch.float32, 0)
    region = region_of(lambda x: [aten._softmax(x, -1, False)], x)
    with pytest.raises(ValueError, match="BLOCK 8 < the row's 13 columns"):
        generate(region.gm, [TensorArg.of(x)], "test", Launch(8, 4, False))


# -- dropout: the mask drawn in the kernel ----------------------------------------------------

def _dropout(x, keep=0.9):
    """A dropout as traced: the mask drawn in place into an uninitialized tensor, scaled."""
    mask = aten.div_.Scalar(aten.bernoulli_.float(aten.empty_like(x), keep), keep)
    return mask, x * mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_mask_is_drawn_in_the_kernel(dtype):
    """bernoulli_ is Philox (tl.rand) at each element's own offset: the kept fraction is
    within 5 sigma of p, kept values are scaled by 1/p exactly as eager scales them, the
    output is the input times the mask the kernel returns (in fp16: within the error
    model), every launch draws afresh, and torch.manual_seed reproduces a draw."""
    x = _rand((37, 53), dtype, 0)
    region = region_of(lambda x: list(_dropout(x)), x)
    with backend("triton"):
        torch.manual_seed(0)
        mask, out = region.run([x])
        again = region.run([x])[0]
        torch.manual_seed(0)
        same = region.run([x])[0]
    eager_mask = region.fallback([x])[0]
    assert set(mask.unique().tolist()) <= set(eager_mask.unique().tolist()) | {0.0}
    kept, n = (mask != 0).double().mean().item(), mask.numel()
    assert abs(kept - 0.9) <= 5 * (0.9 * 0.1 / n) ** 0.5, kept
    if dtype == torch.float32:
        assert torch.equal(out, x * mask)
    else:  # the kernel multiplies by the fp32 scale; eager by the mask rounded to fp16
        assert_error_model([out], [x * mask], [x.double() * (mask != 0) / 0.9])
    assert torch.equal(same, mask) and not torch.equal(again, mask)
    assert region.source([TensorArg.of(x)]).seeds == 1


@LOOPED
@given(a=dims, n=wide, seed=st.integers(0, 99))
def test_dropout_before_a_looped_softmax_redraws_the_same_mask(tiny_blocks, a, n, seed):
    """A looped row kernel recomputes what it reads in every loop: the counter-based draw
    gives the same mask each time, so the softmax is of x times the mask returned."""
    x = _rand((a, 3, n), torch.float32, seed)
    def fn(x):
        mask, y = _dropout(x, 0.5)  # p = 0.5, bernoulli_'s default: traced without it
        return [mask, aten._softmax(y, -1, False)]
    region = region_of(fn, x)
    assert generate(region.gm, [TensorArg.of(x)]).kind == "looped row"
    with backend("triton"):
        mask, y = region.run([x])
    got, eager, ref = [y], [aten._softmax(x * mask, -1, False)], [
        aten._softmax(x.double() * mask.double(), -1, False)]
    assert_error_model(got, eager, ref)


def test_inplace_on_a_tensor_read_elsewhere_is_declined():
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.compiler.codegen.ops import unsupported_reason

    def fn(x):  # make_fx points reads after an in-place op at its result; this one is before
        y = x * 2.0
        w = y + 1.0
        return [aten.mul_.Scalar(y, 3.0) + w]
    gm = make_fx(fn)(torch.randn(3))
    node = next(n for n in gm.graph.nodes if n.target == aten.mul_.Scalar)
    assert "in-place" in unsupported_reason(node)


def test_int64_indices_in_a_looped_row_kernel(tiny_blocks, wide_indices):
    x, dy = _rand((2, 3, 11), torch.float32, 4), _rand((2, 3, 11), torch.float32, 5)

    def fn(x, dy):
        y = aten._log_softmax(x, -1, False)
        return [y, aten._log_softmax_backward_data(dy, y, -1, x.dtype)]
    source = generate(region_of(fn, x, dy).gm, [TensorArg.of(x), TensorArg.of(dy)])
    assert source.kind == "looped row" and "to(tl.int64)" in source.text
    assert_error_model(*run_both(fn, x, dy))
