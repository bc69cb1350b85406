"""The op a parameter-server trainer's graph reads its embedding rows with.

`autopar::ps_pull(ids, table, dim, dtype, padding_idx)` takes the flat ids of every
lookup of one table in the step (int64, `cap` of them) and returns three tensors of
shapes fixed by `cap`, so the graph around it keeps static shapes:

- `rows` [cap + 1, dim]: the rows of the batch's unique ids, in sorted id order, then
  zero rows up to `cap`, then at index `cap` the padding row (the row of
  `padding_idx`; zeros when it is -1);
- `local` [cap]: each id's index into `rows` (ids equal to `padding_idx` map to `cap`,
  so the lookups and their backward ops take `cap` as their padding index);
- `uniq` [cap]: the unique ids `rows` holds, then -1: what the trainer pushes the
  rows' gradients back to (the padding id is never pushed; its gradient is zero).

The compiler never sees a server. The runtime binds a reader (`bind_reader`), a
callable `(table, ids) -> rows`, before running the graph; the op calls it. Running
the graph with no reader bound is an error that says so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reader = Callable[[int, torch.Tensor], torch.Tensor]

_reader: list[Reader | None] = [None]


class NoReaderError(RuntimeError):
    """A parameter-server graph ran without a bound row reader."""


def bind_reader(reader: Reader | None) -> None:
    """Make `reader(table, ids) -> rows` the source of every ps_pull until rebound."""
    _reader[0] = reader


@torch.library.custom_op("autopar::ps_pull", mutates_args=())
def ps_pull(ids: torch.Tensor, table: int, dim: int, dtype: torch.dtype,
            padding_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    reader = _reader[0]
    if reader is None:
        raise NoReaderError("this graph reads embedding rows from parameter servers, but no "
                            "server client is bound: run it through the runtime's PSTrainer "
                            "(autopar.compile with Layout(ps=...))")
    cap = ids.numel()
    keep = ids if padding_idx < 0 else ids[ids != padding_idx]
    uniq, inverse = torch.unique(keep, sorted=True, return_inverse=True)
    n = uniq.numel()
    rows = torch.zeros(cap + 1, dim, dtype=dtype)
    if n:
        rows[:n] = reader(table, uniq)
    if padding_idx >= 0:
        rows[cap] = reader(table, torch.tensor([padding_idx], dtype=torch.int64))[0]
        local = torch.full_like(ids, cap)
        local[ids != padding_idx] = inverse
    else:
        local = inverse.reshape(ids.shape)
    out_ids = torch.full((cap,), -1, dtype=torch.int64)
    out_ids[:n] = uniq
    return rows, local, out_ids


@ps_pull.register_fake
def _ps_pull_fake(ids, table, dim, dtype, padding_idx):
    cap = ids.numel()
    return (ids.new_empty((cap + 1, dim), dtype=dtype), torch.empty_like(ids),
            ids.new_empty((cap,)))


PS_PULL = torch.ops.autopar.ps_pull.default
