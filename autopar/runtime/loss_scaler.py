"""Dynamic loss scaling for fp16 steps, with torch.amp.GradScaler's semantics.

The compiled fp16 step takes the scale as its trailing input (LOSS_SCALE_INPUT) and
returns gradients of loss * scale. Per step the scaler:

1. unscales the gradients in place and looks for inf/NaN with the same kernel
   GradScaler uses (`torch._amp_foreach_non_finite_check_and_unscale_`);
2. agrees on "found inf" over all ranks (all_reduce MAX on the default group), so a
   step is skipped everywhere or nowhere (ranks hold different gradients under
   tp / zero, and dp ranks would otherwise diverge);
3. tells the caller to skip `optimizer.step()` on inf/NaN;
4. updates the scale with GradScaler's kernel (`torch._amp_update_scale_`): x0.5 on
   inf/NaN, x2 after `growth_interval` clean steps in a row.

The scale and growth tracker are tensors, so checkpoints save them with the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class LossScaler:
    """GradScaler's state machine over the gradients a compiled step returns."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = torch.full((), init_scale, dtype=torch.float32)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.skipped_steps = 0

    def scale_input(self) -> torch.Tensor:
        """The value of the step's loss-scale input (a copy: the graph must not alias it)."""
        return self.scale.clone()

    def unscale_and_check(self, grads: Sequence[torch.Tensor]) -> bool:
        """Unscale `grads` in place; True if every rank's gradients are finite."""
        found_inf = torch.zeros(1, dtype=torch.float32)
        # GradScaler computes the inverse in double, then rounds it to fp32
        inv_scale = self.scale.double().reciprocal().float().reshape(1)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        self._found_inf = found_inf
        return found_inf.item() == 0

    def update(self) -> None:
        """The scale for the next step, from this step's found-inf (GradScaler.update)."""
        found_inf = self._found_inf
        if found_inf.item() != 0:
            self.skipped_steps += 1
        scale = self.scale.reshape(1)
        torch._amp_update_scale_(scale, self.growth_tracker, found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors for checkpoints (restored in place)."""
        return {"autopar.loss_scaler.scale": self.scale,
                "autopar.loss_scaler.growth_tracker": self.growth_tracker}

    def get_scale(self) -> float:
        return float(self.scale)
