"""Tensor-parallel parameter blocks: the block a rank holds, and the whole tensor again."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.runtime.program import TensorEntry


def own_block(t: torch.Tensor, entry: TensorEntry, tp_rank: int) -> torch.Tensor:
    """This rank's block of a split parameter, as a new Parameter (the tensor itself when
    the entry is whole)."""
    if entry.shard_dim is None:
        return t
    size = entry.shape[entry.shard_dim]
    block = t.detach().narrow(entry.shard_dim, tp_rank * size, size)
    return torch.nn.Parameter(block.clone(), requires_grad=t.requires_grad)


def whole(t: torch.Tensor, entry: TensorEntry, tp_group, tp: int) -> torch.Tensor:
    """Collective over the tp group for a split parameter: all its blocks, joined (a copy
    of the tensor when the entry is whole)."""
    if entry.shard_dim is None:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=tp_group)
    return torch.cat(parts, dim=entry.shard_dim)
