"""Collectives the compiled graphs call that torch's functional collectives lack.

`_c10d_functional` has all_reduce, reduce_scatter_tensor, all_gather_into_tensor and
broadcast, but no reduce. The hierarchical all-reduce on gloo needs one: gloo
emulates reduce_scatter_tensor with an all-reduce, so inside a node the cheap form
is a reduce to the node's leader and a broadcast back (passes/insert_allreduce.py).

`autopar::reduce(input, dst, group_name)` follows the functional collectives'
contract: it returns a new tensor (the input is left alone), the collective runs
asynchronously, and `_c10d_functional.wait_tensor` on the result waits for it (the
work is registered with c10d's registry for that tensor, as the built-in ones are).
`dst` is the destination's rank within the group. On the destination the result holds
the group's sum; elsewhere its values are unspecified (gloo leaves partial sums in a
non-root buffer), so a graph reads it there only as the buffer a broadcast overwrites.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_LIB = torch.library.Library("autopar", "DEF")  # noqa: TOR901 - an op namespace of ours
_LIB.define("reduce(Tensor input, int dst, str group_name) -> Tensor")


def _reduce(input: torch.Tensor, dst: int, group_name: str) -> torch.Tensor:
    from torch._C._distributed_c10d import _register_work
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = input.clone(memory_format=torch.contiguous_format)
    group = _resolve_process_group(group_name)
    options = dist.ReduceOptions()
    options.rootRank, options.reduceOp = dst, dist.ReduceOp.SUM
    _register_work(out, group.reduce([out], options))
    return out


def _reduce_fake(input: torch.Tensor, dst: int, group_name: str) -> torch.Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


_LIB.impl("reduce", _reduce, "CPU")
_LIB.impl("reduce", _reduce, "CUDA")
_LIB.impl("reduce", _reduce_fake, "Meta")
torch.library.register_fake("autopar::reduce", _reduce_fake, lib=_LIB)

reduce = torch.ops.autopar.reduce.default
