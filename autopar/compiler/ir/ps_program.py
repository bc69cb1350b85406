"""The two programs a parameter-server layout splits one training step into.

`PSProgram` is what every trainer runs: the joint graph with each embedding table's
parameter removed. Its lookups read the rows of the batch's ids through
`autopar::ps_pull` (compiler/ir/ps_ops.py), and for each pull the graph returns the
gradient of the pulled rows and the ids they belong to, which the trainer pushes.

The servers' side of the split is small enough to be data, not a graph: the tables
(`TableSpec`), the rule that deals their rows over the servers (`shard_of`,
`local_row`), and, from the Layout and the user's optimizer, how a server applies what
trainers push (`runtime/ps.PSServer`). Built by `compiler/lowering/lower_ps.py`, run by
`runtime/ps.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.compiler.ir.program import TensorEntry


@dataclass(frozen=True)
class TableSpec:
    """One embedding table the servers hold: the model's parameter name (and its
    tied names), its full shape, and the padding row (-1: none)."""

    name: str
    rows: int
    dim: int
    dtype: torch.dtype
    padding_idx: int = -1
    aliases: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.rows * self.dim * self.dtype.itemsize


@dataclass(frozen=True)
class Pull:
    """One ps_pull in the trainer's graph: the table it reads and how many ids it takes
    (its capacity: the rows it returns, padding aside)."""

    table: int
    capacity: int
    source: str | None = None  # the user's line that did the lookup


def shard_of(row: int | torch.Tensor, servers: int):
    """The server holding a row: rows are dealt round-robin by id (row % servers), so
    each server holds every servers-th row and a skewed id distribution spreads."""
    return row % servers


def local_row(row: int | torch.Tensor, servers: int):
    """A row's index in its server's shard."""
    return row // servers


def shard_rows(rows: int, servers: int, server: int) -> int:
    """How many rows of a table of `rows` rows server `server` holds."""
    return len(range(server, rows, servers))


@dataclass
class PSProgram:
    """A trainer's step: GraphModule of flat (dense params, buffers, inputs) ->
    (loss, dense grads, (row grads, ids) per pull, mutated buffers)."""

    gm: fx.GraphModule
    dense: tuple[TensorEntry, ...]
    buffers: tuple[TensorEntry, ...]
    inputs: tuple[TensorEntry, ...]  # shapes of the whole example batch
    batch_dims: tuple[int | None, ...]
    mutated_buffers: tuple[str, ...]
    tables: tuple[TableSpec, ...]
    pulls: tuple[Pull, ...]
    # the same inputs -> the flat ids of each pull, in pull order (lower_ps: a step's
    # rows are fetched in one request per server before `gm` runs)
    prefetch: fx.GraphModule | None = None
    # sync mode, a loss dividing by a count of the batch: the trailing inputs that take
    # the global batch's count (compiler/passes/global_loss_mean.py)
    normalizers: tuple = ()

    @property
    def num_outputs(self) -> int:
        return 1 + len(self.dense) + 2 * len(self.pulls) + len(self.mutated_buffers)
