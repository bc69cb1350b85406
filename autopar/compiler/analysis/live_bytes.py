"""Measured memory of a step on any device: live tensor storage, counted as ops run.

On a GPU `torch.cuda.max_memory_allocated` answers "how much did the step hold at
its peak"; on the CPU nothing does, so `LiveBytes` counts it: a TorchDispatchMode
that sees every storage an op creates and notices when the last reference to it is
gone (a storage weak reference expires). It is what the memory model
(`autopar.compiler.analysis.memory`) is judged against.

    with LiveBytes() as live:
        step(*batch)
    live.peak_bytes      # most bytes of storage created inside the block alive at once

Storages that existed before the block (parameters, optimizer states, the user's
batch) are not counted: `held_bytes` measures those.

A storage made before the block and grown in place inside it (FSDP2 allocates and
frees its unsharded parameters with `UntypedStorage.resize_`, which no op reports) is
counted by what it grew, given as `LiveBytes(resizable=tensors)`.

Tensor subclasses (DTensor): an op on one runs its inner ops while the mode is off, so
the storage such an op returns is counted by the subclass's op, through the tensors
the subclass wraps; what the inner ops create and free within the one op (a
redistribute's buffers) is not seen, which leaves a DTensor program's peak a lower
bound.

Collectives: an issued collective's work holds its tensors, and on gloo it lets go of
them on the process group's worker thread whenever that thread gets to it (before
the wait or a while after it), so when such a storage expires depends on thread
scheduling. The count makes it deterministic and states the program's own lifetime,
as the memory model does: a storage a collective touched lives from its birth to its
last use by an op, a collective's input to the wait on that collective (the issued
collective holds it), whenever the worker thread actually freed it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

from autopar.compiler.ir import comm_ops


@dataclass
class _Tracked:
    """A storage created inside the block."""

    size: int
    collective: bool = False  # touched by a collective: its lifetime is re-stated
    last_use: int = 0  # index of the last op that read or wrote it


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created and still referenced inside the block."""

    def __init__(self, resizable: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        # storages made before the block that may be resized in place inside it (a
        # storage's `resize_` is no op this mode sees): counted by what they grew
        distinct = {_weak(t).cdata: t for t in resizable}  # one storage once
        self._resizable = [(t, t.untyped_storage().nbytes()) for t in distinct.values()]
        self._live: dict[StorageWeakRef, _Tracked] = {}
        self._by_cdata: dict[int, StorageWeakRef] = {}
        # collective output storage -> the input storages its work holds until the wait
        self._in_flight: dict[int, list[_Tracked]] = {}
        self._ops: list[str] = []
        self._timeline: list[int] = []  # bytes alive after each op, as observed
        self._expired: list[tuple[_Tracked, int]] = []  # collectives' storages, op they expired at
        self._depth = 0  # a fused fallback re-enters the mode
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_op = ""

    def __enter__(self):
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._depth -= 1
        if not self._depth:
            self._finish()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {_weak(t).cdata for t in _plain(tree_leaves((args, kwargs)))}
        out = self._fused_fallback(func, args) or func(*args, **kwargs)
        index = len(self._ops)  # after a fused fallback's own ops
        for cdata in inputs:
            ref = self._by_cdata.get(cdata)
            if ref is not None:
                self._live[ref].last_use = index
        self._collect(index)
        for t in _plain(tree_leaves(out)):
            if t.device.type != "meta":
                ref = _weak(t)
                if ref.cdata in inputs or ref in self._live:
                    continue  # an in-place op or a view: no new storage
                size = t.untyped_storage().nbytes()
                self._live[ref] = _Tracked(size, last_use=index)
                self._by_cdata[ref.cdata] = ref
                self.live_bytes += size
        self._track_collective(func, args, out, index)
        self._ops.append(str(func))
        self._timeline.append(self.live_bytes + sum(
            max(0, t.untyped_storage().nbytes() - before) for t, before in self._resizable))
        return out

    def _fused_fallback(self, func, args):
        """A fused region that runs its eager fallback (a CPU tensor, the default kernel
        backend) allocates inside the custom op, where this mode is not active: run the
        fallback under the mode so its intermediates count. None for any other op."""
        from autopar.compiler.codegen.kernels import (
            FUSED_OP,
            region,
            would_run_fallback,
        )

        if func is not FUSED_OP or not would_run_fallback(args[1]):
            return None
        with self:
            return region(args[0]).fallback(list(args[1]))

    def _track_collective(self, func, args, out, index: int) -> None:
        if getattr(func, "namespace", "") != "_c10d_functional" and func is not comm_ops.reduce:
            return
        if func.__name__.startswith("wait_tensor"):
            for tracked in self._in_flight.pop(_weak(args[0]).cdata, []):
                tracked.last_use = index  # the issued collective held it until here
            return
        touched = [self._live[self._by_cdata[_weak(t).cdata]] for t in tree_leaves((args, out))
                   if isinstance(t, torch.Tensor) and _weak(t).cdata in self._by_cdata]
        for tracked in touched:
            tracked.collective = True
        inputs = [self._live[self._by_cdata[_weak(t).cdata]] for t in tree_leaves(args)
                  if isinstance(t, torch.Tensor) and _weak(t).cdata in self._by_cdata]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._in_flight[_weak(t).cdata] = inputs

    def _collect(self, index: int) -> None:
        """Drop the storages that expired before op `index` finished."""
        for ref in [ref for ref in self._live if ref.expired()]:
            tracked = self._live.pop(ref)
            del self._by_cdata[ref.cdata]
            self.live_bytes -= tracked.size
            if tracked.collective:
                self._expired.append((tracked, index))

    def _finish(self) -> None:
        """The peak with each collective's storage alive through its last use (or the
        wait on it) instead of until the worker thread let go of it."""
        timeline = list(self._timeline)
        for tracked, expired in self._expired:
            # counted alive through op expired-1; the program held it through last_use
            held_to = tracked.last_use + 1
            lo, hi, sign = ((held_to, expired, -1) if held_to < expired
                            else (expired, held_to, 1))
            for i in range(lo, min(hi, len(timeline))):
                timeline[i] += sign * tracked.size
        if timeline:
            at = max(range(len(timeline)), key=timeline.__getitem__)
            self.peak_bytes, self.peak_op = timeline[at], self._ops[at]


def _plain(leaves) -> list[torch.Tensor]:
    """The plain tensors among `leaves`, a tensor subclass (DTensor) by the tensors it
    wraps: an op on a subclass runs its inner ops while this mode is off (a mode does not
    see the ops its own handler calls), so the storage they create is counted by the
    subclass's op that returns it, and read by the ops that take the subclass."""
    out = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out += _plain(getattr(t, name) for name in names)
        else:
            out.append(t)
    return out


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
