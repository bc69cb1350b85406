"""Local SGD: every rank steps its optimizer on its own gradients, and the parameters
are averaged over the data-parallel ranks every H steps (Layout.local_sgd).

Post-local SGD (Lin et al., 2020): the first `Layout.local_sgd_warmup` steps run the
synchronous program, gradients summed every step, bit for bit the data-parallel step;
after them the local program runs, compiled as dp=1 on this rank's share of the batch
(no gradient collective; a tensor-parallel layout keeps its tp collectives), and the
parameters are averaged after local step 0, H, 2H, ...: ceil((T - W) / H) averagings
in T steps, as torch's PeriodicModelAverager counts them.

The average is one all-reduce of every parameter packed together over the dp group
(with `Layout.allreduce="hierarchical"`, the gradients' three levels: Mesh.sum_over_dp),
divided by dp and copied back in place into the tensors the optimizer updates (torch's
averager rebinds `p.data`, which would leave an optimizer holding the old tensors).
Optimizer state (momentum, Adam's moments) stays each rank's own, as in Lin et al.'s
local SGD and torch's PostLocalSGDOptimizer. Buffers are not averaged. A checkpoint is
taken where the ranks agree (`save` refuses otherwise) and keeps the schedule's state
(an adaptive period's too) in its extra JSON; `load` restores it, or for a checkpoint
of another schedule puts it where the step count says. The
optimizer state a checkpoint keeps is one rank's (in Local SGD each rank's momentum is
its own); after a load every rank starts from it.

Adaptive period (`Layout.local_sgd_adaptive`): AdaComm (Wang and Joshi, "Adaptive
communication strategies to achieve the best error-runtime trade-off in local-update
SGD", SysML 2019), tau = ceil(sqrt(lr0 * F / (lr * F0)) * tau0), clamped to [1,
MAX_PERIOD]: F is the training loss averaged over the ranks at an averaging (carried
in the same all-reduce as the parameters, so every rank takes the same period), F0 and
lr0 those at the first averaging, tau0 = Layout.local_sgd. tau0 multiplies the square
root, as in the paper, so the period starts where the user set it; the form with tau0
under the root would start at sqrt(tau0). The period falls as the loss falls and grows
as the learning rate decays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.compiler.ir.program import Program, bind_groups
from autopar.runtime.executor import DistributedStep
from autopar.runtime.pipeline import PipelineStep

MAX_PERIOD = 16  # the adaptive period's upper clamp (a rank drifts at most this far)
SCHEDULE_KEY = "autopar.local_sgd"  # the schedule's state in a checkpoint's extra JSON


def adaptive_period(period0: int, lr0: float, lr: float, loss0: float, loss: float) -> int:
    """AdaComm's period: ceil(sqrt(lr0 * loss / (lr * loss0)) * period0), in [1, MAX_PERIOD]."""
    if lr <= 0 or loss0 <= 0 or not math.isfinite(loss):
        return period0
    ratio = max(lr0 * loss / (lr * loss0), 0.0)
    return min(MAX_PERIOD, max(1, math.ceil(math.sqrt(ratio) * period0)))


@dataclass
class AveragingSchedule:
    """When Local SGD averages: after local step 0 (the first after the warm-up), then
    every `period` local steps; an adaptive schedule sets the period at each averaging."""

    period: int
    warmup: int
    adaptive: bool = False
    next_local: int = 0  # the local step after which the next averaging comes
    lr0: float | None = None
    loss0: float | None = None
    averagings: int = 0
    period0: int = field(init=False)  # the period the layout set (an adaptive one's tau0)

    def __post_init__(self) -> None:
        self.period0 = self.period

    def synchronous(self, step: int) -> bool:
        """Whether step `step` (0-based) sums its gradients (the warm-up)."""
        return step < self.warmup

    def due(self, step: int) -> bool:
        """Whether to average after step `step` (0-based, past the warm-up)."""
        return step - self.warmup == self.next_local

    def averaged(self, lr: float, loss: float) -> None:
        """An averaging happened with the ranks' mean loss `loss` at learning rate `lr`:
        the next one's local step."""
        if self.adaptive:
            if self.lr0 is None:
                self.lr0, self.loss0 = lr, loss
            else:
                self.period = adaptive_period(self.period0, self.lr0, lr, self.loss0, loss)
        self.averagings += 1
        self.next_local += self.period

    def state(self) -> dict:
        """What a checkpoint keeps of the schedule (JSON)."""
        return {"period": self.period, "period0": self.period0, "warmup": self.warmup,
                "adaptive": self.adaptive, "next_local": self.next_local, "lr0": self.lr0,
                "loss0": self.loss0, "averagings": self.averagings}

    def restore(self, state: dict | None, steps: int) -> None:
        """Back to a saved `state` where it is this schedule's (same period, warm-up and
        adaptivity: an adaptive period goes on from where it was), else `resume`."""
        if state and all(state.get(k) == getattr(self, k)
                         for k in ("period0", "warmup", "adaptive")):
            self.period, self.next_local = state["period"], state["next_local"]
            self.lr0, self.loss0 = state["lr0"], state["loss0"]
            self.averagings = state["averagings"]
        else:
            self.resume(steps)

    def resume(self, steps: int) -> None:
        """After `steps` steps restored from a checkpoint: the next averaging where a run
        without the restart would have it (a fixed period), or after the next local step
        (an adaptive one, whose loss and learning rate are anchored again there)."""
        local = max(steps - self.warmup, 0)
        if self.adaptive:
            self.next_local, self.lr0, self.loss0, self.period = local, None, None, self.period0
        else:
            self.next_local = -(-local // self.period) * self.period
        self.averagings = -(-local // self.period) if not self.adaptive else 0


class _Averaging:
    """What Local SGD adds to a step (DistributedStep or PipelineStep): the schedule, the
    in-place parameter average over dp, and checkpoints only where the ranks agree. The
    step provides `mesh`, `updated`, `optimizer`, `steps`, `dp_size` and TrainingState's
    save / load."""

    schedule: AveragingSchedule
    synchronized: bool

    def _init_averaging(self, period: int, warmup: int, adaptive: bool) -> None:
        self.schedule = AveragingSchedule(period, warmup, adaptive)
        # every dp rank holds the same parameters: from the start (the weights are
        # broadcast), in the warm-up, after an averaging and after a load
        self.synchronized = True

    def save(self, path, extra=None, *, background=False):
        """TrainingState.save, where every rank holds the same parameters (in the warm-up
        or right after an averaging): between averagings a checkpoint would keep one
        rank's own and drop the others'."""
        if not self.synchronized:
            raise RuntimeError(
                f"Local SGD: after step {self.steps} the ranks' parameters differ (the next "
                f"average follows step {self.schedule.warmup + self.schedule.next_local + 1}); "
                f"save right after an averaging, when step.synchronized is True")
        extra = {**(extra or {}), SCHEDULE_KEY: self.schedule.state()}
        return super().save(path, extra, background=background)

    def load(self, path) -> dict:
        """TrainingState.load, then the averaging schedule: as saved (an adaptive period
        included), or where the step count says for a checkpoint of another schedule."""
        extra = super().load(path)
        self.schedule.restore(extra.pop(SCHEDULE_KEY, None), self.steps)
        self.synchronized = True
        return extra

    def _after_local_step(self, step: int, loss: torch.Tensor) -> None:
        self.synchronized = self.schedule.due(step)
        if self.synchronized:
            self._average(loss)

    def _average(self, loss: torch.Tensor) -> None:
        """Every parameter (and, adaptive, the loss) averaged over dp, in place."""
        group, dp = self.mesh.group("dp"), self.dp_size
        params = list(self.updated)
        with torch.no_grad():
            for dtype in dict.fromkeys(p.dtype for p in params):
                mine = [p for p in params if p.dtype == dtype]
                flat = torch.cat([p.reshape(-1) for p in mine])
                self._sum_over_dp(flat)
                flat /= dp
                for p, part in zip(mine, flat.split([p.numel() for p in mine])):
                    p.copy_(part.view_as(p))
            mean_loss = float("nan")
            if self.schedule.adaptive:
                total = loss.detach().double().reshape(1).clone()
                dist.all_reduce(total, group=group)
                mean_loss = float(total) / dp
        self.schedule.averaged(float(self.optimizer.param_groups[0]["lr"]), mean_loss)


class LocalSGDStep(_Averaging, DistributedStep):
    """A DistributedStep that runs `local_program` (this rank's gradients only) after the
    warm-up and averages the parameters over dp on its schedule (module docstring).
    The loss it returns in a local step is this rank's own."""

    def __init__(self, program: Program, local_program: Program, model: torch.nn.Module,
                 optimizer, *, objective=None, period: int, warmup: int = 0,
                 adaptive: bool = False, hierarchy_form: str = "leaders"):
        super().__init__(program, model, optimizer, objective=objective)
        self.local_gm = bind_groups(local_program.gm, self.mesh.group_names) \
            if self.mesh.group_names else local_program.gm
        self.hierarchy_form = hierarchy_form  # of the average, as the gradients' sum has it
        self._init_averaging(period, warmup, adaptive)

    def _sum_over_dp(self, flat: torch.Tensor) -> None:
        """The average's sum: with Layout.allreduce="hierarchical" in the gradients' levels
        (Mesh.sum_over_dp), so that only one rank of each node (leaders) or each rank's
        shard (shards) crosses the network."""
        self.mesh.sum_over_dp(flat, self.program.node_split, self.hierarchy_form)

    @property
    def dp_size(self) -> int:
        return self.program.mesh_size("dp")

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        step = self.steps
        if self.schedule.synchronous(step):
            return super().__call__(*args, **kwargs)
        # the local program takes no global-loss divisors: the batch slice alone
        local = self.local_batch(self.objective.flatten(args, kwargs), divisors=False)
        scale = [self.loss_scaler.scale_input()] if self.loss_scaler else []
        loss = self._run(self.local_gm, [*self.graph_params, *self.buffers, *local, *scale])
        self._after_local_step(step, loss)
        return loss


class LocalSGDPipelineStep(_Averaging, PipelineStep):
    """Local SGD on the pipeline runtime (pp > 1 or micro-batches): after the warm-up
    the schedule runs as in a synchronous step, but the gradients are not summed over
    dp. The seed divided each rank's gradient by dp (its share of the global one), so
    they are multiplied back: each rank steps on its own share's gradient (with the
    loss's counts taken over the global batch, as the warm-up's). The loss a local step
    returns is its own pipeline's (summed over pp only)."""

    def __init__(self, program, model: torch.nn.Module, optimizer, *, objective=None,
                 period: int, warmup: int = 0, adaptive: bool = False, node_split: int = 1,
                 hierarchy_form: str = "leaders"):
        super().__init__(program, model, optimizer, objective=objective,
                         node_split=node_split, hierarchy_form=hierarchy_form)
        self._init_averaging(period, warmup, adaptive)

    @property
    def dp_size(self) -> int:
        return self.dp

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        step = self.steps
        self.sum_over_dp = self.schedule.synchronous(step)
        loss = super().__call__(*args, **kwargs)
        if not self.sum_over_dp:
            self._after_local_step(step, loss)
        return loss

    def _sync_grads(self, parts: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        grads = super()._sync_grads(parts)
        if not self.sum_over_dp:
            for g in grads:
                g.mul_(self.dp)
        return grads

    def _finish_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if self.sum_over_dp or self.mesh.device_mesh is None:
            return super()._finish_loss(losses)
        total = self._local_loss(losses)
        dist.all_reduce(total, group=self.mesh.group("pp"))  # the last stage's, on every stage
        return total
