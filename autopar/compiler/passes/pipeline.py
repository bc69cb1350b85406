"""The default pass pipeline for a Layout (DESIGN.md's order, as passes land)."""

from __future__ import annotations

from autopar.compiler.passes.base import GraphPass
from autopar.compiler.passes.insert_allreduce import InsertAllReduce
from autopar.layout import Layout


def default_passes(layout: Layout) -> list[GraphPass]:
    """amp -> tensor_parallel -> recompute -> pipeline_split -> data_parallel/zero ->
    comm scheduling -> fusion; only the passes that have landed appear."""
    passes: list[GraphPass] = []
    if layout.dp > 1:
        passes.append(InsertAllReduce())
    return passes
