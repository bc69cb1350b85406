"""A dim in pieces, each split in blocks: the layout of a tensor-parallel value that a
fused projection writes (tp_rules.Strided), and of its parameters (TensorEntry.
shard_pieces).

`pieces` is an int k (k equal pieces side by side along the dim) or a tuple of the
pieces' sizes along the dim (Phi-3's fused projection with grouped key-value heads:
q, then the narrower k and v). Rank r of `parts` holds block r of every piece, side
by side; each piece's size divides by `parts`.
"""

from __future__ import annotations

import torch

Pieces = int | tuple[int, ...]


def piece_sizes(pieces: Pieces, n: int) -> list[int]:
    """The sizes of the pieces of a dim of size n."""
    if isinstance(pieces, tuple):
        if sum(pieces) != n:
            raise ValueError(f"pieces {pieces} do not make up a dim of size {n}")
        return list(pieces)
    if n % pieces:
        raise ValueError(f"a dim of size {n} is not {pieces} equal pieces")
    return [n // pieces] * pieces


def is_pieced(pieces: Pieces) -> bool:
    """Whether `pieces` (TensorEntry.shard_pieces) is more than one plain block."""
    return isinstance(pieces, tuple) or pieces > 1


def pieces_fit(n: int, pieces: Pieces, parts: int) -> bool:
    """Whether a dim of size n is those pieces, each of which divides into `parts`."""
    if isinstance(pieces, tuple):
        return sum(pieces) == n and all(s > 0 and s % parts == 0 for s in pieces)
    return n % (pieces * parts) == 0


def block_of_pieces(t: torch.Tensor, dim: int, pieces: Pieces, rank: int,
                    parts: int) -> torch.Tensor:
    """Rank `rank`'s block of the whole tensor `t` along `dim`: its 1/parts block of
    each piece, side by side (a view for one piece)."""
    if not isinstance(pieces, tuple):  # equal pieces: one strided view, copied once
        pieced = t.unflatten(dim, (pieces, t.shape[dim] // pieces))
        size = pieced.shape[dim + 1] // parts
        return pieced.narrow(dim + 1, rank * size, size).flatten(dim, dim + 1)
    sizes = piece_sizes(pieces, t.shape[dim])
    return torch.cat([p.narrow(dim, rank * (p.shape[dim] // parts), p.shape[dim] // parts)
                      for p in t.split(sizes, dim)], dim)


def join_blocks(blocks: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int,
                pieces: Pieces) -> torch.Tensor:
    """The whole tensor from every rank's `block_of_pieces`, in rank order."""
    if not isinstance(pieces, tuple):
        return torch.cat([b.unflatten(dim, (pieces, -1)) for b in blocks],
                         dim=dim + 1).flatten(dim, dim + 1)
    parts = len(blocks)
    local = [s // parts for s in piece_sizes(pieces, blocks[0].shape[dim] * parts)]
    split = [b.split(local, dim) for b in blocks]
    return torch.cat([split[r][j] for j in range(len(local)) for r in range(parts)], dim)


def rank_major(x: torch.Tensor, dim: int, pieces: Pieces, parts: int) -> torch.Tensor:
    """x's dim reordered from pieces to ranks: rank r's blocks of every piece together,
    so that rank r's `block_of_pieces` is the r-th plain block of the result."""
    if not isinstance(pieces, tuple):
        return x.unflatten(dim, (pieces, parts, -1)).transpose(dim, dim + 1) \
            .flatten(dim, dim + 2)
    return torch.cat([block_of_pieces(x, dim, pieces, r, parts) for r in range(parts)], dim)


def piece_major(x: torch.Tensor, dim: int, pieces: Pieces, parts: int) -> torch.Tensor:
    """The inverse of `rank_major`."""
    if not isinstance(pieces, tuple):
        return x.unflatten(dim, (parts, pieces, -1)).transpose(dim, dim + 1) \
            .flatten(dim, dim + 2)
    return join_blocks(x.chunk(parts, dim), dim, pieces)


__all__ = ["Pieces", "block_of_pieces", "is_pieced", "join_blocks", "piece_major",
           "piece_sizes", "pieces_fit", "rank_major"]
