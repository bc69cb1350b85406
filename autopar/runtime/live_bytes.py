"""Measured memory of a step on any device: live tensor storage, counted as ops run.

On a GPU `torch.cuda.max_memory_allocated` answers "how much did the step hold at
its peak"; on the CPU nothing does, so `LiveBytes` counts it: a TorchDispatchMode
that sees every storage an op creates and notices when the last reference to it is
gone (a storage weak reference expires). It is what the memory model
(`autopar.compiler.planner.memory`) is judged against.

    with LiveBytes() as live:
        step(*batch)
    live.peak_bytes      # most bytes of storage created inside the block alive at once

Storages that existed before the block (parameters, optimizer states, the user's
batch) are not counted: `held_bytes` measures those.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created and still referenced inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[StorageWeakRef, int] = {}
        self._seen_before: set[int] = set()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_op = ""

    def __enter__(self):
        self._seen_before = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_weak(t).cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t)}
        out = self._fused_fallback(func, args) or func(*args, **kwargs)
        self._collect()
        for t in tree_leaves(out):
            # a tensor subclass (DTensor) holds no storage of its own: the ops on its
            # local tensors, which pass through this mode too, allocate it
            if (isinstance(t, torch.Tensor) and t.device.type != "meta"
                    and not is_traceable_wrapper_subclass(t)):
                ref = _weak(t)
                if ref.cdata in inputs or ref in self._live:
                    continue  # an in-place op or a view: no new storage
                size = t.untyped_storage().nbytes()
                self._live[ref] = size
                self.live_bytes += size
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_op = self.live_bytes, str(func)
        return out

    def _fused_fallback(self, func, args):
        """A fused region that runs its eager fallback (a CPU tensor, the default kernel
        backend) allocates inside the custom op, where this mode is not active: run the
        fallback under the mode so its intermediates count. None for any other op."""
        from autopar.compiler.codegen.kernels import FUSED_OP, region, would_run_fallback

        if func is not FUSED_OP or not would_run_fallback(args[1]):
            return None
        with self:
            return region(args[0]).fallback(list(args[1]))

    def _collect(self) -> None:
        dead = [ref for ref in self._live if ref.expired()]
        for ref in dead:
            self.live_bytes -= self._live.pop(ref)


def _weak(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def measure_step(step, *global_batch: torch.Tensor) -> tuple[int, int]:
    """Run one step (a DistributedStep or a PipelineStep) and return (peak bytes, bytes
    held before it).

    Held: the rank's parameters, the blocks its optimizer updates, optimizer states,
    buffers and its slice of the batch (what the memory model calls static); the
    peak adds the most bytes the step itself had alive at once.
    """
    states = [t for s in step.optimizer.state.values() for t in s.values()]
    held = held_bytes([*step.held_tensors(), *states]) + step.batch_bytes(global_batch)
    with LiveBytes() as live:
        step(*global_batch)
    return held + live.peak_bytes, held
