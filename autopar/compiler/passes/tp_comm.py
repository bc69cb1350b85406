"""Redistributions between tensor-parallel placements, as functional collectives that
autograd differentiates: tracing the forward with them gives the backward's matching
collectives by construction.

    have -> want     forward                       backward (of the gradient)
    P -> R           all_reduce(sum)               nothing (each term's gradient is the sum's)
    P -> S(d)        reduce_scatter along d        all_gather along d
    R -> S(d)        keep this rank's block        all_gather along d
    S(d) -> R        all_gather along d            keep this rank's block
    S(a) -> S(b)     all_to_all                    all_to_all back
    grad_split(R)    nothing                       all_reduce(sum)  (Megatron's "f")
    S(d) -> R, split all_gather along d            reduce_scatter along d

A Strided placement (d in k pieces, rank r holding block r of each) converts as S(d)
does, with the elements of d reordered so that each rank's blocks lie together
(`_rank_major`): R <-> Strided and P -> Strided, and the split form of Strided -> R.

`grad_split` marks a replicated value whose consumers split their work: each rank's
backward then yields only its part of the value's gradient. A value gathered for such
consumers (sequence parallelism's all-gather before a column-parallel matmul) sums
and splits that gradient in one reduce-scatter.

The group is named by its mesh tag (`autopar.mesh.tp`); the runtime binds it to the
real process group. The rank is a compile-time constant of each rank's program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.compiler.ir.pieces import piece_major, rank_major
from autopar.compiler.passes.tp_rules import P, Placement, R, Strided

c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class TPGroup:
    tag: str  # mesh group tag, bound to a process group by the runtime
    size: int
    rank: int


def all_reduce(x: torch.Tensor, group: TPGroup, op: str = "sum") -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), op, group.tag))


def all_gather(x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
    """Concatenate every rank's x along dim."""
    moved = x.movedim(dim, 0).contiguous()
    out = c10d.wait_tensor(c10d.all_gather_into_tensor(moved, group.size, group.tag))
    return _back_to(out, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
    """This rank's block along dim of the sum over ranks."""
    moved = x.movedim(dim, 0).contiguous()
    out = c10d.wait_tensor(c10d.reduce_scatter_tensor(moved, "sum", group.size, group.tag))
    return _back_to(out, dim)


def _back_to(out: torch.Tensor, dim: int) -> torch.Tensor:
    """The collective's dim 0 moved back to `dim`, laid out contiguously: the graph's
    views (reshape to rows before a matmul) expect the layout the op had unsplit."""
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def all_to_all(x: torch.Tensor, src: int, dst: int, group: TPGroup) -> torch.Tensor:
    """From blocks along `src` to blocks along `dst`: each rank sends the r-th block of
    its dst dim to rank r and joins what it receives along src."""
    parts = x.unflatten(dst, (group.size, x.shape[dst] // group.size)).movedim(dst, 0)
    rows = parts.shape[1]
    flat = parts.contiguous().flatten(0, 1)
    sizes = [rows] * group.size
    out = c10d.wait_tensor(c10d.all_to_all_single(flat, sizes, sizes, group.tag))
    out = out.unflatten(0, (group.size, rows)).movedim(0, src)
    return out.flatten(src, src + 1).contiguous()


def local_block(x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
    size = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * size, size)


def _rank_major(x: torch.Tensor, p: Strided, tp: int) -> torch.Tensor:
    """x's dim p.dim reordered from pieces (each piece's tp blocks together) to ranks (the
    blocks one rank holds together): then rank r's Strided block is the r-th plain block."""
    return rank_major(x, p.dim, p.pieces, tp)


def _piece_major(x: torch.Tensor, p: Strided, tp: int) -> torch.Tensor:
    """The inverse of `_rank_major`."""
    return piece_major(x, p.dim, p.pieces, tp)


def _gather_pieces(x: torch.Tensor, p: Strided, group: TPGroup) -> torch.Tensor:
    return _piece_major(all_gather(x, p.dim, group), p, group.size).contiguous()


def _block_of_pieces(x: torch.Tensor, p: Strided, group: TPGroup) -> torch.Tensor:
    return local_block(_rank_major(x, p, group.size), p.dim, group).contiguous()


def _reduce_scatter_pieces(x: torch.Tensor, p: Strided, group: TPGroup) -> torch.Tensor:
    return reduce_scatter(_rank_major(x, p, group.size), p.dim, group)


def _differentiable(name: str, forward, backward):
    """An autograd function whose forward is `forward(x, *args)` and whose backward maps
    the gradient by `backward(grad, *args)` (args: dims and the group, not differentiated)."""

    def fwd(ctx, x, *args):
        ctx.args = args
        return forward(x, *args)

    def bwd(ctx, grad):
        return (backward(grad, *ctx.args),) + (None,) * len(ctx.args)

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def _identity(x: torch.Tensor, *args) -> torch.Tensor:
    return x


def _block(x: torch.Tensor, dim: int, group: TPGroup) -> torch.Tensor:
    return local_block(x, dim, group).contiguous()


# the table of the module docstring, row by row: (forward, backward)
_SumPartials = _differentiable("_SumPartials", all_reduce, _identity)
_ReduceScatter = _differentiable("_ReduceScatter", reduce_scatter, all_gather)
_Scatter = _differentiable("_Scatter", _block, all_gather)
_Gather = _differentiable("_Gather", all_gather, _block)
_AllToAll = _differentiable("_AllToAll", all_to_all,
                            lambda grad, src, dst, group: all_to_all(grad, dst, src, group))
_GradSplit = _differentiable("_GradSplit", lambda x, group: x.view_as(x), all_reduce)
_GatherForSplitWork = _differentiable("_GatherForSplitWork", all_gather, reduce_scatter)
_ScatterPieces = _differentiable("_ScatterPieces", _block_of_pieces, _gather_pieces)
_GatherPieces = _differentiable("_GatherPieces", _gather_pieces, _block_of_pieces)
_ReduceScatterPieces = _differentiable("_ReduceScatterPieces", _reduce_scatter_pieces,
                                       _gather_pieces)
_GatherPiecesForSplitWork = _differentiable("_GatherPiecesForSplitWork", _gather_pieces,
                                            _reduce_scatter_pieces)


def sum_partials(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    return _SumPartials.apply(x, group)


def grad_split(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    return _GradSplit.apply(x, group)


def redistribute(x: torch.Tensor, have: Placement, want: Placement, group: TPGroup,
                 split_work: bool = False) -> torch.Tensor:
    """x moved from `have` to `want`; `split_work`: the consumer splits its work, so the
    gradient coming back is each rank's part (see grad_split)."""
    if split_work:
        if isinstance(have, int) and want == R:
            return _GatherForSplitWork.apply(x, have, group)
        if isinstance(have, Strided) and want == R:
            return _GatherPiecesForSplitWork.apply(x, have, group)
        return grad_split(redistribute(x, have, want, group), group)
    if have == want:
        return x
    convert = _CONVERSIONS.get((_kind(have), _kind(want)))
    if convert is None:  # (the solver prices these as impossible: TPCosts.redistribute)
        raise ValueError(f"no redistribution from {have} to {want}")
    return convert(x, have, want, group)


def _kind(p: Placement) -> str:
    return p if p in (P, R) else "pieces" if isinstance(p, Strided) else "S"


# (kind of have, kind of want) -> conversion(x, have, want, group), the module docstring's table
_CONVERSIONS = {
    (P, R): lambda x, have, want, group: _SumPartials.apply(x, group),
    (P, "S"): lambda x, have, want, group: _ReduceScatter.apply(x, want, group),
    (R, "S"): lambda x, have, want, group: _Scatter.apply(x, want, group),
    ("S", R): lambda x, have, want, group: _Gather.apply(x, have, group),
    ("S", "S"): lambda x, have, want, group: _AllToAll.apply(x, have, want, group),
    (P, "pieces"): lambda x, have, want, group: _ReduceScatterPieces.apply(x, want, group),
    (R, "pieces"): lambda x, have, want, group: _ScatterPieces.apply(x, want, group),
    ("pieces", R): lambda x, have, want, group: _GatherPieces.apply(x, have, group),
}
