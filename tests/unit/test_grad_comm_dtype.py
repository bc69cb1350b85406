"""Layout.grad_comm_dtype: gradient buckets all-reduced in bf16 (graph structure)."""

from __future__ import annotations

import pytest
import torch

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.ir.verify import verify
from autopar.compiler.passes.base import PassContext
from autopar.compiler.passes.insert_allreduce import InsertAllReduce
from autopar.examples import gpt2, mlp
from autopar.layout import Layout

c10d = torch.ops._c10d_functional


def _reduce(example, **layout):
    tg = trace_train_step(example.model, example.batch, example.loss_fn)
    out, result = InsertAllReduce().run(tg, PassContext(Layout(dp=2, bucket_mb=0.01, **layout)))
    verify(out)
    return out, result


@pytest.mark.parametrize("factory", [mlp, gpt2])
def test_bf16_buckets_halve_the_bytes_and_come_back_fp32(factory):
    example = factory()
    full, full_result = _reduce(example)
    half, half_result = _reduce(example, grad_comm_dtype="bf16")
    assert half_result.stats["allreduce_bytes"] * 2 == full_result.stats["allreduce_bytes"] > 0
    buckets = [n for n in half.call_nodes() if n.meta.get(M.COMM_KIND) == "grad_bucket"]
    assert len(buckets) == full_result.stats["buckets"] > 1
    for n in buckets:
        assert n.meta[M.VAL].dtype == torch.bfloat16
        assert n.args[0].target == torch.ops.prims.convert_element_type.default
    assert all(g.meta[M.VAL].dtype == torch.float32 for g in half.grad_nodes())
    assert half.loss_node().meta[M.VAL].dtype == torch.float32  # the loss is not compressed
    fp32, fp32_result = _reduce(example, grad_comm_dtype="fp32")  # fp32 gradients: no casts
    assert fp32_result.stats["allreduce_bytes"] == full_result.stats["allreduce_bytes"]
    assert not [n for n in fp32.call_nodes()
                if n.target == torch.ops.prims.convert_element_type.default]
