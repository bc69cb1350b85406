"""Parameter blocks: a rank's tensor-parallel block and ZeRO dim-0 block of a parameter,
and the whole tensor again."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.compiler.ir.pieces import Pieces, block_of_pieces, join_blocks
from autopar.compiler.ir.program import TensorEntry, block_rows
from autopar.runtime.mesh import Mesh


def tp_block(t: torch.Tensor, dim: int, pieces: Pieces, tp_rank: int, tp: int) -> torch.Tensor:
    """Rank `tp_rank`'s tensor-parallel block of the whole tensor `t` along `dim`: 1/tp of
    it, or, with pieces (compiler/ir/pieces.py), its 1/tp block of each of the dim's
    pieces, side by side (tp_rules.Strided)."""
    return block_of_pieces(t, dim, pieces, tp_rank, tp)


def join_tp_blocks(parts: list[torch.Tensor], dim: int, pieces: Pieces) -> torch.Tensor:
    """The whole tensor from every rank's `tp_block`, in rank order."""
    return join_blocks(parts, dim, pieces)


def own_block(t: torch.Tensor, entry: TensorEntry, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's block of a split parameter, as a new Parameter (the tensor itself when
    the entry is whole). The block is 1/tp of the whole tensor along the split dim (not
    `entry.shape`, which ZeRO-3 cuts further into dim-0 blocks)."""
    if entry.shard_dim is None:
        return t
    block = tp_block(t.detach(), entry.shard_dim, entry.shard_pieces, tp_rank, tp)
    return torch.nn.Parameter(block.clone(), requires_grad=t.requires_grad)


def whole(t: torch.Tensor, entry: TensorEntry, tp_group, tp: int) -> torch.Tensor:
    """Collective over the tp group for a split parameter: all its blocks, joined (a copy
    of the tensor when the entry is whole)."""
    if entry.shard_dim is None:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=tp_group)
    return join_tp_blocks(parts, entry.shard_dim, entry.shard_pieces)


# -- ZeRO: dim-0 blocks over the data-parallel ranks ---------------------------------------

def zero_block(p: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """This rank's dim-0 block of a parameter, for the optimizer: ceil(rows / dp) rows,
    the last rank's padded with zero rows (their gradient is zero, so they stay zero),
    as a new Parameter. A parameter with fewer rows than dp is updated whole (returned
    as it is) on every rank."""
    if p.dim() == 0 or p.shape[0] < dp:
        return p
    block = block_of(p.detach(), block_rows(p.shape[0], dp), dp_rank).clone()
    return torch.nn.Parameter(block, requires_grad=p.requires_grad)


def block_of(whole: torch.Tensor, rows: int, dp_rank: int) -> torch.Tensor:
    """Rank `dp_rank`'s `rows`-row block of `whole` along dim 0, zero-padded past its end."""
    start = dp_rank * rows
    valid = max(0, min(rows, whole.shape[0] - start))
    if valid == rows:
        return whole.narrow(0, start, rows)
    out = whole.new_zeros((rows, *whole.shape[1:]))
    out[:valid] = whole.narrow(0, start, valid)
    return out


def gathered(u: torch.Tensor, rows: int, dp: int, group) -> torch.Tensor:
    """A parameter whole from every rank's dim-0 block (collective), without padding."""
    out = u.new_empty((u.shape[0] * dp, *u.shape[1:]))
    dist.all_gather_into_tensor(out, u.detach().contiguous(), group=group)
    return out[:rows]


def gather_into(p: torch.Tensor, u: torch.Tensor, dp: int, group) -> None:
    """Every rank's updated block `u` written back into the whole parameter `p`."""
    if p.shape[0] == u.shape[0] * dp:
        dist.all_gather_into_tensor(p.data, u.data, group=group)
    else:  # padded blocks: gather, then drop the padding rows
        p.data.copy_(gathered(u, p.shape[0], dp, group))


# -- checkpoints: a block as a view of the whole tensor ----------------------------------

def recut(t: torch.Tensor, dim: int, have: Pieces, want: Pieces, zero_rows: int | None,
          mesh: Mesh) -> torch.Tensor:
    """Collective over tp (and, for a ZeRO block, dp): this rank's tensor-parallel block
    along `dim` of the whole tensor that every rank's `t` makes up, as `have` pieces
    per block, re-cut in `want` pieces (`tp_block`): a new tensor of t's shape. With
    `zero_rows`, `t` is this rank's padded ZeRO dim-0 block of a block of that many rows,
    and so is the result. A checkpoint stores a tensor split in pieces as plain blocks
    (torch.distributed.checkpoint writes one box of the whole per rank)."""
    block = t.detach()
    if zero_rows is not None:
        block = gathered(block, zero_rows, dist.get_world_size(mesh.group("dp")),
                         mesh.group("dp"))
    group = mesh.group("tp")
    tp = dist.get_world_size(group)
    parts = [torch.empty_like(block) for _ in range(tp)]
    dist.all_gather(parts, block.contiguous(), group=group)
    out = tp_block(join_tp_blocks(parts, dim, have), dim, want, mesh.rank_in("tp"), tp)
    if zero_rows is not None:
        out = block_of(out, t.shape[0], mesh.rank_in("dp"))
    return out.contiguous()


def global_view(t: torch.Tensor, shape: torch.Size, shard_dim: int | None,
                zero_rows: int | None, mesh: Mesh) -> torch.Tensor:
    """`t` as a view of the whole tensor of `shape`, for torch.distributed.checkpoint: a
    DTensor over `mesh.checkpoint_mesh()` sharing t's storage. `t` is this rank's
    tensor-parallel block along `shard_dim` (None: not split), and/or, where `zero_rows`
    is given, its ZeRO dim-0 block of a tensor of `zero_rows` rows (the padding rows are
    left out of the view). Whole tensors and 0-d ones are returned as they are: DCP
    writes one copy of a plain tensor."""
    if mesh.device_mesh is None or t.dim() == 0 or (shard_dim is None and zero_rows is None):
        return t
    t = t.detach()  # the same storage; a view of a leaf that DCP's staging can copy
    if zero_rows is not None:
        start = mesh.rank_in("dp") * t.shape[0]
        t = t.narrow(0, 0, max(0, min(t.shape[0], zero_rows - start)))
    placements = {"tp": Shard(shard_dim) if shard_dim is not None else Replicate(),
                  "dp": Shard(0) if zero_rows is not None else Replicate()}
    device_mesh = mesh.checkpoint_mesh()
    return DTensor.from_local(t, device_mesh,
                              [placements.get(n, Replicate()) for n in device_mesh.mesh_dim_names],
                              run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())
