"""Pass-level research (benchmarks/bucket_rule.py): a pass of our own, scored by the
cost model through estimate(passes=...)."""

from __future__ import annotations


import autopar
from autopar.compiler.analysis.summary import summarize
from autopar.examples import gpt2
from benchmarks.bucket_rule import BucketPerBlock, predict


def test_per_block_buckets_hold_one_block_each_and_are_scored():
    ex = gpt2(layers=4, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    layout = autopar.Layout(dp=2)
    tg = autopar.trace(ex.model, (ex.batch[0][:4],), ex.loss_fn)
    new, results = autopar.run_passes(tg, layout, passes=[BucketPerBlock()])
    block_bytes = sum(p.nbytes for p in tg.signature.params if ".h.0." in p.name)
    assert results[0].stats["bucket_mb"] * 2**20 == block_bytes
    buckets = [op for op in summarize(new).ops if op.collective == "all_reduce"
               and op.comm_bytes > 1024]
    default, _ = autopar.run_passes(tg, layout)
    one = [op for op in summarize(default).ops if op.collective == "all_reduce"
           and op.comm_bytes > 1024]
    assert len(one) == 1 and len(buckets) >= 4  # 25 MiB holds all; per block: one each
    assert sum(op.comm_bytes for op in buckets) == sum(op.comm_bytes for op in one)
    times = predict("gpt2-tiny", autopar.ClusterSpec.local(nprocs=2))
    assert set(times) == {"default (25 MiB)", "per block"} and all(t > 0 for t in times.values())
    assert times["default (25 MiB)"] != times["per block"]
