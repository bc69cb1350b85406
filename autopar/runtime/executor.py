"""Run a compiled Program: one training step per call, on this rank's slice of the batch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from autopar.compiler.ir.batch import BatchError, Objective, normalizer_means
from autopar.compiler.ir.program import LOSS_SCALE_INPUT, Program, bind_groups, runnable
from autopar.runtime.loss_scaler import LossScaler
from autopar.runtime.mesh import Mesh, build_mesh
from autopar.runtime.shards import (
    block_of,
    gather_into,
    gathered,
    own_block,
    whole,
    zero_block,
)
from autopar.runtime.training_state import HeldParam, TrainingState

log = logging.getLogger("autopar.runtime")

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class DistributedStep(TrainingState):
    """A compiled training step bound to this rank's mesh, weights and optimizer.

    The model's own parameters are the weights: the graph reads them and the
    optimizer updates them in place, so `model` stays usable after training. With
    tensor parallelism a rank holds only its block of each split parameter (a new
    Parameter; the model's own keeps its initial value): `full_state_dict()` gathers
    the trained weights.
    """

    def __init__(self, program: Program, model: torch.nn.Module,
                 optimizer: OptimizerFactory, *, mesh: Mesh | None = None,
                 objective: Objective | None = None):
        self.program = program
        self.mesh = mesh or build_mesh(program.mesh, program.node_split)
        self.mesh.split_dp(program.node_split)  # a mesh passed in: its two levels, if needed
        self.gm = bind_groups(program.gm, self.mesh.group_names) if self.mesh.group_names \
            else program.gm
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
        self._whole = self._whole_of(model, program)  # for checkpoints, before blocks are cut
        self.params = [named[p.name] for p in program.params]
        self.buffers = [named[b.name] for b in program.buffers]
        self._model = model
        self._sync_initial_weights()
        self.params = [own_block(t, e, self.mesh.rank_in("tp"), program.mesh_size("tp"))
                       for t, e in zip(self.params, program.params)]
        # ZeRO: the optimizer updates this rank's dim-0 block of each parameter that divides
        # by dp (its state is 1/dp), then the blocks are gathered back into the parameter
        self.zero = int(program.layout.get("zero", 0))
        self.rows = [p.shape[0] if p.dim() else 0 for p in self.params]  # whole dim 0
        self.updated = [self._zero_block(p) for p in self.params] if self.zero else self.params
        # ZeRO-3: the step takes those blocks and gathers the rest where it is used; the
        # whole parameters are released (full_state_dict gathers them)
        self.in_graph_block = [b > 1 for b in program.param_blocks] or [False] * len(self.params)
        self.graph_params = [u if b else p for p, u, b in
                             zip(self.params, self.updated, self.in_graph_block)]
        for p, b in zip(self.params, self.in_graph_block):
            if b:
                p.data = p.data.new_empty(0)
        self.optimizer = optimizer(self.updated)
        self.steps = 0
        # an fp16 AMP step takes the loss scale as its trailing input (not the user's)
        scaled = bool(program.inputs) and program.inputs[-1].name == LOSS_SCALE_INPUT
        self.loss_scaler = LossScaler() if scaled else None
        self._n_user_inputs = len(program.inputs) - scaled - len(program.normalizers)
        # how a call's arguments make the flat batch (default: the tensors positionally)
        self.objective = objective or Objective(None, self._n_user_inputs)

    # -- the step ---------------------------------------------------------------------------

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """One step on a global batch, passed as the example batch was (see Objective)."""
        return self._run(self.gm, self.graph_inputs(*args, **kwargs))

    def _run(self, gm, inputs: list[torch.Tensor]) -> torch.Tensor:
        """Run `gm` on `inputs`, step the optimizer on the gradients it returns, write
        its mutated buffers back; the loss."""
        with torch.no_grad():
            outs = runnable(gm, inputs)(*inputs)  # on a CPU: the fused regions' ops inline
            loss, rest = outs[0], outs[1:]
            grads, new_buffers = rest[:len(self.params)], rest[len(self.params):]
            grads = [self._grad_of_updated(u, g) for u, g in zip(self.updated, grads)]
            for u, g in zip(self.updated, grads):
                u.grad = g
            loss = self._update(grads, loss)
            for u in self.updated:
                u.grad = None
            by_name = {b.name: t for b, t in zip(self.program.buffers, self.buffers)}
            for name, value in zip(self.program.mutated_buffers, new_buffers):
                by_name[name].copy_(value)
        self.steps += 1
        return loss.detach()

    def _update(self, grads: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        """Step the optimizer on `grads` (already on each updated tensor's .grad): unscaled
        and skipped on an overflow with fp16 AMP, then ZeRO's blocks gathered back. Returns
        the step's loss (`loss`, the graph's)."""
        if self.loss_scaler is None or self.loss_scaler.unscale_and_check(grads):
            self.optimizer.step()
            self._gather_zero_blocks()
        if self.loss_scaler is not None:
            self.loss_scaler.update()
        return loss

    def graph_inputs(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> list[torch.Tensor]:
        """What this rank's graph takes for one step on the global batch `args`/`kwargs`:
        its parameters (or ZeRO-3 blocks), buffers, batch slice, the loss normalizers'
        divisors, and the loss scale of an fp16 step."""
        local = self.local_batch(self.objective.flatten(args, kwargs))
        scale = [self.loss_scaler.scale_input()] if self.loss_scaler else []
        return [*self.graph_params, *self.buffers, *local, *scale]

    def held_tensors(self) -> list[torch.Tensor]:
        """What this rank keeps across steps (besides optimizer state): its parameters,
        the blocks its optimizer updates, buffers."""
        return [*self.params, *self.updated, *self.buffers]

    def batch_bytes(self, global_batch: Sequence[torch.Tensor]) -> int:
        """Bytes of this rank's slice of the global batch."""
        return sum(x.numel() * x.element_size() for x in self.local_batch(global_batch))

    def local_batch(self, global_batch: Sequence[torch.Tensor],
                    divisors: bool = True) -> list[torch.Tensor]:
        """This rank's slice of the global batch along each input's batch dimension, and
        after it the divisor of each batch-decided count the loss divides by
        (global_loss_mean.py)."""
        spec = self.program.inputs[:self._n_user_inputs]
        if len(global_batch) != len(spec):
            raise BatchError(f"the step takes {len(spec)} input tensors (as the example inputs), "
                             f"got {len(global_batch)}")
        dp = self.program.mesh_size("dp")
        rank = self.mesh.rank_in("dp")
        out = []
        for entry, dim, x in zip(spec, self.program.batch_dims, global_batch):
            if dim is not None:
                if x.shape[dim] != entry.shape[dim] * dp:
                    raise BatchError(
                        f"{entry.name}: global batch of {x.shape[dim]} along dim {dim}, but the "
                        f"program was compiled for {entry.shape[dim] * dp} "
                        f"({entry.shape[dim]} per rank x dp={dp}); compile again for a new size")
                x = x.narrow(dim, rank * entry.shape[dim], entry.shape[dim])
            if tuple(x.shape) != entry.shape:
                raise BatchError(f"{entry.name}: shape {tuple(x.shape)} per rank, the program was "
                                 f"compiled for {entry.shape}")
            out.append(x)
        if not divisors:  # a program without the global loss mean (Local SGD's)
            return out
        return out + normalizer_means(self.program.normalizers, global_batch,
                                      self.program.batch_dims, dp)

    def _sync_initial_weights(self) -> None:
        """Every rank starts from rank 0's weights (as DDP does)."""
        if self.mesh.device_mesh is None:
            return
        with torch.no_grad():
            for t in self.params + self.buffers:
                dist.broadcast(t.data, src=0)

    # -- ZeRO ----------------------------------------------------------------------------

    def _zero_block(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        return zero_block(p, self.program.mesh_size("dp"), self.mesh.rank_in("dp"))

    def _block_of(self, whole: torch.Tensor, rows: int) -> torch.Tensor:
        return block_of(whole, rows, self.mesh.rank_in("dp"))

    def _grad_of_updated(self, updated: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of what the optimizer updates: the step's output, or (ZeRO-1, or a
        gradient all-reduced whole) this rank's block of it."""
        if grad.shape == updated.shape:
            return grad
        return self._block_of(grad, updated.shape[0])

    def _gather_zero_blocks(self) -> None:
        """Every rank's updated blocks, gathered back into the whole parameters (not under
        ZeRO-3: the next step gathers them where it uses them)."""
        for p, u, in_graph in zip(self.params, self.updated, self.in_graph_block):
            if u is not p and not in_graph:
                gather_into(p, u, self.program.mesh_size("dp"), self.mesh.group("dp"))

    def _gathered(self, u: torch.Tensor, rows: int) -> torch.Tensor:
        return gathered(u, rows, self.program.mesh_size("dp"), self.mesh.group("dp"))

    # -- weights and checkpoints ------------------------------------------------------------

    def _held_params(self) -> list[HeldParam]:
        return [HeldParam(e, p, u, b, rows) for e, p, u, b, rows in
                zip(self.program.params, self.params, self.updated, self.in_graph_block, self.rows)]

    def _held_buffers(self) -> dict[str, torch.Tensor]:
        return {b.name: t for b, t in zip(self.program.buffers, self.buffers)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights under their original names (tied names included);
        collective when the step is tensor-parallel."""
        out = {}
        mine = [self._gathered(g, rows) if b else g
                for g, b, rows in zip(self.graph_params, self.in_graph_block, self.rows)]
        for entry, t in zip(self.program.params + self.program.buffers, mine + self.buffers):
            full = whole(t, entry, self.mesh.group("tp"), self.program.mesh_size("tp"))
            for name in (entry.name, *entry.aliases):
                out[name] = full if name == entry.name else full.clone()
        return out

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        return iter(self.params)
