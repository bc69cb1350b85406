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

from autopar.compiler.passes.tp_rules import P, R, Placement

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


class _SumPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return local_block(x, dim, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return local_block(grad, ctx.dim, ctx.group).contiguous(), None, None


class _GatherForSplitWork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, group):
        ctx.src, ctx.dst, ctx.group = src, dst, group
        return all_to_all(x, src, dst, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.dst, ctx.src, ctx.group), None, None, None


class _GradSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


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
        return grad_split(redistribute(x, have, want, group), group)
    if have == want:
        return x
    if have == P and want == R:
        return _SumPartials.apply(x, group)
    if have == P and isinstance(want, int):
        return _ReduceScatter.apply(x, want, group)
    if have == R and isinstance(want, int):
        return _Scatter.apply(x, want, group)
    if isinstance(have, int) and want == R:
        return _Gather.apply(x, have, group)
    if isinstance(have, int) and isinstance(want, int):
        return _AllToAll.apply(x, have, want, group)
    raise ValueError(f"no redistribution from {have} to {want}")
