"""Helpers for kernel tests: a region from a Python function, run by Triton and eagerly,
and the error model (ours no worse than eager's at that dtype, against float64)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.compiler.codegen.kernels import backend, register_region
from autopar.compiler.codegen.triton_gen import TensorArg

EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def region_of(fn, *inputs):
    gm = make_fx(fn)(*inputs)
    return register_region(gm, [TensorArg.of(x) for x in inputs], "test")


def run_both(fn, *inputs):
    """(Triton outputs, eager outputs at the inputs' dtypes, float64 reference outputs)."""
    region = region_of(fn, *inputs)
    with backend("triton"):
        got = region.run(list(inputs))
    eager = region.fallback(list(inputs))
    ref = [r.double() if r.is_floating_point() else r
           for r in fn(*[x.double() if x.is_floating_point() else x for x in inputs])]
    return got, eager, ref


def assert_error_model(got, eager, ref, factor: float = 4.0):
    """Each output: same shape, strides and dtype as eager's, and max |ours - float64|
    <= factor * max |eager - float64| + a few ulps of the output's dtype."""
    assert len(got) == len(eager) == len(ref)
    for i, (g, e, r) in enumerate(zip(got, eager, ref)):
        assert g.shape == e.shape and g.dtype == e.dtype, (i, g.shape, e.shape, g.dtype, e.dtype)
        assert g.stride() == e.stride(), (i, g.stride(), e.stride())
        if not g.is_floating_point():
            assert torch.equal(g, e), i
            continue
        ours = (g.double() - r).abs().max().item() if g.numel() else 0.0
        theirs = (e.double() - r).abs().max().item() if e.numel() else 0.0
        scale = max(1.0, r.abs().max().item() if r.numel() else 0.0)
        bound = factor * theirs + 4 * EPS[g.dtype] * scale
        assert ours <= bound, f"output {i}: error {ours:.3e} > {bound:.3e} (eager {theirs:.3e})"
