"""What a compiled step saves and loads: the whole training state, in every layout.

A checkpoint of a step (`save` / `load`, written by runtime/checkpoint.py through
torch.distributed.checkpoint) holds:

- every parameter as the whole tensor: a rank's tensor-parallel block and/or ZeRO
  dim-0 block is a DTensor view of it (shards.global_view), so DCP writes each block
  once and reads it back into any layout, resharding;
- the optimizer state of what each rank updates, by parameter name, viewed likewise;
- the buffers, an fp16 step's loss scale and growth tracker, and the step count;
- each rank's RNG state (CPU, and CUDA's where there is one), restored only into the
  same layout and world size: in another layout the ranks draw other masks anyway;
- the caller's `extra` JSON, for example the data-block master's queues (the data
  position is saved with the weights it produced, atomically).

A pipeline rank holds only the parameters its stages read (a tied one is held, equal,
by every rank that reads it): each rank passes its own subset and checkpoint.py checks
that together they cover the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from autopar.compiler.ir.pieces import is_pieced
from autopar.compiler.ir.program import Program, TensorEntry
from autopar.runtime import checkpoint as ckpt
from autopar.runtime.loss_scaler import LossScaler
from autopar.runtime.mesh import Mesh
from autopar.runtime.shards import block_of, global_view, recut

STEPS_KEY = "autopar.steps"


@dataclass
class HeldParam:
    """A parameter this rank holds between steps."""

    entry: TensorEntry
    param: torch.Tensor  # this rank's (tensor-parallel block of the) parameter
    updated: torch.Tensor  # what the optimizer updates: `param`, or its ZeRO dim-0 block
    released: bool  # ZeRO-3: `param` is emptied between steps, `updated` is the weight
    rows: int  # dim 0 of `param` whole


def _pad_rows(block: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A loaded ZeRO block (without padding) back to the padded rows of `like`."""
    if block.dim() == 0 or block.shape[0] == like.shape[0]:
        return block
    out = block.new_zeros((like.shape[0], *block.shape[1:]))
    out[:block.shape[0]] = block
    return out


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["rng.cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["rng.cpu"])
    if "rng.cuda" in state:
        torch.cuda.set_rng_state(state["rng.cuda"])


class TrainingState:
    """`save` / `load` of a compiled step (DistributedStep and PipelineStep).

    The step provides `program`, `mesh`, `optimizer`, `loss_scaler`, `steps` (steps
    taken), `_whole` (each parameter's and buffer's whole shape and dtype, taken
    before any block was cut: `_whole_of(model, program)`), `_held_params()` and `_held_buffers()`.
    """

    program: Program
    mesh: Mesh
    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler | None
    steps: int
    _whole: dict[str, tuple[torch.Size, torch.dtype]]
    # more of this rank's own tensors to save and (same layout and world size) load in
    # place, beside its RNG state: DGC's residuals (runtime/dgc.py)
    _extra_per_rank: dict[str, torch.Tensor] = {}

    def _held_params(self) -> list[HeldParam]:
        raise NotImplementedError

    def _held_buffers(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def _whole_of(model: torch.nn.Module, program: Program) -> dict[str, tuple[torch.Size, torch.dtype]]:
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
        return {e.name: (named[e.name].shape, named[e.name].dtype)
                for e in (*program.params, *program.buffers)}

    # -- what is saved ------------------------------------------------------------------

    def _weight_view(self, h: HeldParam) -> torch.Tensor:
        t = h.updated if h.released else h.param
        return self._view(h, t, h.rows if h.released else None)

    def _state_view(self, h: HeldParam, t: torch.Tensor) -> torch.Tensor:
        """An optimizer state tensor of `h` (shaped like what it updates) as a global view."""
        if t.shape != h.updated.shape:
            return t
        blocked = h.updated is not h.param
        return self._view(h, t, h.rows if blocked else None)

    def _view(self, h: HeldParam, t: torch.Tensor, zero_rows: int | None) -> torch.Tensor:
        """`t` (h's block, or its ZeRO block) as a global view. A block in pieces is viewed
        as a copy re-cut to a plain block (`recut`, collective): `_unview` writes a loaded
        copy back."""
        if is_pieced(h.entry.shard_pieces):
            t = recut(t, h.entry.shard_dim, h.entry.shard_pieces, 1, zero_rows, self.mesh)
        return global_view(t, self._whole[h.entry.name][0], h.entry.shard_dim, zero_rows,
                           self.mesh)

    def _unview(self, h: HeldParam, loaded: torch.Tensor, into: torch.Tensor,
                zero_rows: int | None) -> None:
        """A block in pieces, loaded as its `_view`'s plain block, back into `into`."""
        local = _pad_rows(loaded.to_local() if isinstance(loaded, DTensor) else loaded, into)
        with torch.no_grad():
            into.copy_(recut(local, h.entry.shard_dim, 1, h.entry.shard_pieces, zero_rows,
                             self.mesh))

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        named = {h.entry.name: self._weight_view(h) for h in self._held_params()}
        named.update(self._held_buffers())
        if self.loss_scaler is not None:  # updated in place by load
            named.update(self.loss_scaler.state_tensors())
        named[STEPS_KEY] = torch.tensor(self.steps, dtype=torch.int64)
        return named

    def _manifest(self) -> dict:
        """Every tensor of the model's training state, whole, whichever rank holds it."""
        tensors = {name: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
                   for name, (shape, dtype) in self._whole.items()}
        extra = dict(self.loss_scaler.state_tensors()) if self.loss_scaler is not None else {}
        extra[STEPS_KEY] = torch.tensor(0, dtype=torch.int64)
        tensors.update(ckpt.describe_tensors(extra))
        return {"format": "autopar-checkpoint-2", "layout": self.program.layout,
                "world_size": math.prod(size for _, size in self.program.mesh), "tensors": tensors}

    def _param_names(self) -> dict[int, str]:
        """Names of what the optimizer updates (ZeRO: this rank's blocks)."""
        return {id(h.updated): h.entry.name for h in self._held_params()}

    def _optimizer_state(self) -> dict:
        """The optimizer's state by parameter name, its tensors as global views."""
        state = ckpt.optimizer_state_by_name(self.optimizer, self._param_names())
        held = {h.entry.name: h for h in self._held_params()}
        state["state"] = {name: {k: self._state_view(held[name], v) if isinstance(v, torch.Tensor)
                                 else v for k, v in values.items()}
                          for name, values in state["state"].items()}
        return state

    # -- save and load ---------------------------------------------------------------------

    def save(self, path: str | Path, extra: dict | None = None, *,
             background: bool = False) -> ckpt.PendingSave | None:
        """Collective: write the training state (see the module docstring) atomically with
        torch.distributed.checkpoint; any layout of the same model can load it.
        `extra`: JSON-serialisable state saved with it (for example the data-block
        master's `state_dict()`); `load` returns it. `background`: copy the state and
        write it in a thread while training goes on; returns a `PendingSave` whose
        `wait()` every rank calls before the next save (see checkpoint.save_checkpoint)."""
        return ckpt.save_checkpoint(path, self._named_tensors(), self._optimizer_state(),
                                    self._manifest(), extra,
                                    per_rank={**_rng_state(), **self._extra_per_rank},
                                    background=background)

    def load(self, path: str | Path) -> dict:
        """Collective: restore what `save` wrote, in this layout (tensor-parallel and ZeRO
        blocks and pipeline stages are resharded by DCP); refuses a mismatched or corrupted
        checkpoint without changing anything. Returns the `extra` state saved with it."""
        held = self._held_params()
        named = self._named_tensors()
        state_like = {h.entry.name: self._state_view(h, h.updated) for h in held}
        rng = {k: v.clone() for k, v in _rng_state().items()}
        state = ckpt.load_checkpoint(path, named, self._manifest(), self._optimizer_state(),
                                     state_like, per_rank={**rng, **self._extra_per_rank})
        self.steps = int(named[STEPS_KEY])
        _set_rng_state(rng)  # unchanged unless saved in this layout and world size
        for h in held:  # blocks in pieces were loaded as plain blocks
            if is_pieced(h.entry.shard_pieces):
                self._unview(h, named[h.entry.name], h.updated if h.released else h.param,
                             h.rows if h.released else None)
        by_name = {h.entry.name: h for h in held}
        for name, values in state["state"].items():  # the optimizer holds plain, padded blocks
            h = by_name[name]
            for k, v in values.items():
                if isinstance(v, DTensor) and is_pieced(h.entry.shard_pieces):
                    values[k] = torch.empty_like(h.updated)
                    self._unview(h, v, values[k], h.rows if h.updated is not h.param else None)
                elif isinstance(v, DTensor):
                    values[k] = _pad_rows(v.to_local(), h.updated)
        ckpt.load_optimizer_state_by_name(self.optimizer, self._param_names(), state)
        with torch.no_grad():  # ZeRO-1/2: the blocks the optimizer updates, from the weights
            for h in held:
                if h.updated is not h.param and not h.released:
                    h.updated.copy_(block_of(h.param.detach(), h.updated.shape[0],
                                             self.mesh.rank_in("dp")))
        return ckpt.read_extra(path)
