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

Overlapped averaging (`Layout.local_sgd_overlap` = k > 0): the average of step t's
parameters x_t runs in a background thread while the next k local steps compute, and
is applied after step t + k keeping this rank's own change since x_t: x = avg(x_t) +
(x - x_t). Those k steps compute their gradients at the rank's own parameters, not at
the average (k steps of staleness), in exchange for the average's transfer hidden under
their compute (the idea of Wang et al.'s Overlap Local-SGD, ICASSP 2020, with a fixed
delay so that every rank applies it at the same step, deterministically). An average
due before step t + k (a period below k, or an adaptive one that fell) applies the one
in flight first. The ranks differ by their own changes until the next average; they
hold the same parameters only where nothing ran since the average started, so `save`
right after an averaging step waits for it (the next step then computes at the
average, as without overlap). The background collectives run on process groups of
their own (Mesh.detached_dp_groups): a group runs collectives in the order they are
issued, and the step's own (the loss scaler's, on the default group) go on meanwhile.

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
from concurrent.futures import Future, ThreadPoolExecutor
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
        self.finished(lr, loss)
        self.next_local += self.period

    def started(self) -> None:
        """An overlapped averaging started: the next one's local step, by the period set
        so far (its loss, known when it is applied, sets the period after that)."""
        self.next_local += self.period

    def finished(self, lr: float, loss: float) -> None:
        """An averaging was applied, with the ranks' mean loss `loss` at learning rate
        `lr` when it started: an adaptive period follows them."""
        if self.adaptive:
            if self.lr0 is None:
                self.lr0, self.loss0 = lr, loss
            else:
                self.period = adaptive_period(self.period0, self.lr0, lr, self.loss0, loss)
        self.averagings += 1

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

    def _init_averaging(self, period: int, warmup: int, adaptive: bool,
                        overlap: int = 0, node_split: int = 1) -> None:
        self.schedule = AveragingSchedule(period, warmup, adaptive)
        # every dp rank holds the same parameters: from the start (the weights are
        # broadcast), in the warm-up, after an averaging and after a load
        self.synchronized = True
        self.overlap = overlap  # local steps an average runs under (0: applied at once)
        self._pending: _InFlight | None = None
        self._thread: ThreadPoolExecutor | None = None
        # the overlapped average's own process groups (made here: new_group is collective)
        self._average_groups = self.mesh.detached_dp_groups(node_split) if overlap else None

    def save(self, path, extra=None, *, background=False):
        """TrainingState.save, where every rank holds the same parameters (in the warm-up
        or right after an averaging; an overlapped one is waited for here): between
        averagings a checkpoint would keep one rank's own and drop the others'."""
        if self._pending is not None and self._pending.step == self.steps - 1:
            self._finish_average()
            self.synchronized = True
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
        if self._pending is not None:  # its result is for the parameters being replaced
            self._pending.future.result()
            self._pending = None
        extra = super().load(path)
        self.schedule.restore(extra.pop(SCHEDULE_KEY, None), self.steps)
        self.synchronized = True
        return extra

    def _after_local_step(self, step: int, loss: torch.Tensor) -> None:
        due = self.schedule.due(step)
        if self._pending is not None and (due or step - self._pending.step >= self.overlap):
            self._finish_average()
        if due and self.overlap:
            self._start_average(step, loss)
        elif due:
            self._average(loss)
        self.synchronized = due and not self.overlap

    def _packed(self) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """The updated parameters packed by dtype: (tensors, a flat copy of them)."""
        params = list(self.updated)
        out = []
        for dtype in dict.fromkeys(p.dtype for p in params):
            mine = [p for p in params if p.dtype == dtype]
            out.append((mine, torch.cat([p.detach().reshape(-1) for p in mine])))
        return out

    def _sum_flats(self, flats: list[torch.Tensor], loss: torch.Tensor | None,
                   groups: dict | None = None) -> float:
        """Each of `flats` summed over dp in place; the ranks' mean of `loss` (adaptive),
        else nan."""
        for flat in flats:
            self._sum_over_dp(flat, groups)
        if loss is None:
            return float("nan")
        total = loss.detach().double().reshape(1).clone()
        dist.all_reduce(total, group=groups["dp"] if groups else self.mesh.group("dp"))
        return float(total) / self.dp_size

    def _average(self, loss: torch.Tensor) -> None:
        """Every parameter (and, adaptive, the loss) averaged over dp, in place."""
        dp = self.dp_size
        with torch.no_grad():
            packed = self._packed()
            mean_loss = self._sum_flats([flat for _, flat in packed],
                                        loss if self.schedule.adaptive else None)
            for mine, flat in packed:
                flat /= dp
                for p, part in zip(mine, flat.split([p.numel() for p in mine])):
                    p.copy_(part.view_as(p))
        self.schedule.averaged(float(self.optimizer.param_groups[0]["lr"]), mean_loss)

    def _start_average(self, step: int, loss: torch.Tensor) -> None:
        """Begin the average of the parameters after step `step` in the background: their
        snapshot, and a second copy the thread sums in place (the snapshot stays to take
        this rank's next change from)."""
        with torch.no_grad():
            packed = self._packed()
            sums = [flat.clone() for _, flat in packed]
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="autopar-local-sgd")
        adaptive = loss.detach().clone() if self.schedule.adaptive else None
        future = self._thread.submit(self._sum_flats, sums, adaptive, self._average_groups)
        self._pending = _InFlight(step, packed, sums, future,
                                  float(self.optimizer.param_groups[0]["lr"]))
        self.schedule.started()

    def _finish_average(self) -> None:
        """Wait for the average in flight and apply it keeping this rank's change since
        its snapshot: p = avg + (p - snapshot) (exactly the average where p did not
        change)."""
        pending, self._pending = self._pending, None
        mean_loss = pending.future.result()
        dp = self.dp_size
        with torch.no_grad():
            for (mine, snapshot), total in zip(pending.packed, pending.sums):
                total /= dp
                sizes = [p.numel() for p in mine]
                for p, before, avg in zip(mine, snapshot.split(sizes), total.split(sizes)):
                    p.sub_(before.view_as(p)).add_(avg.view_as(p))
        self.schedule.finished(pending.lr, mean_loss)

    def close_averaging(self) -> None:
        """Wait for an average in flight and stop its thread (the parameters are left as
        the last step made them; an average in flight is applied)."""
        if self._pending is not None:
            self._finish_average()
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None


@dataclass
class _InFlight:
    """An overlapped average: the step after which it started, the parameters packed by
    dtype with their snapshot, the buffers the thread sums, its future, and the learning
    rate at its start (the adaptive period's)."""

    step: int
    packed: list[tuple[list[torch.Tensor], torch.Tensor]]
    sums: list[torch.Tensor]
    future: Future
    lr: float


class LocalSGDStep(_Averaging, DistributedStep):
    """A DistributedStep that runs `local_program` (this rank's gradients only) after the
    warm-up and averages the parameters over dp on its schedule (module docstring).
    The loss it returns in a local step is this rank's own."""

    def __init__(self, program: Program, local_program: Program, model: torch.nn.Module,
                 optimizer, *, objective=None, period: int, warmup: int = 0,
                 adaptive: bool = False, hierarchy_form: str = "leaders",
                 overlap: int = 0):
        super().__init__(program, model, optimizer, objective=objective)
        self.local_gm = bind_groups(local_program.gm, self.mesh.group_names) \
            if self.mesh.group_names else local_program.gm
        self.hierarchy_form = hierarchy_form  # of the average, as the gradients' sum has it
        self._init_averaging(period, warmup, adaptive, overlap, program.node_split)

    def _sum_over_dp(self, flat: torch.Tensor, groups: dict | None = None) -> None:
        """The average's sum: with Layout.allreduce="hierarchical" in the gradients' levels
        (Mesh.sum_over_dp), so that only one rank of each node (leaders) or each rank's
        shard (shards) crosses the network."""
        self.mesh.sum_over_dp(flat, self.program.node_split, self.hierarchy_form, groups)

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
                 hierarchy_form: str = "leaders", overlap: int = 0):
        super().__init__(program, model, optimizer, objective=objective,
                         node_split=node_split, hierarchy_form=hierarchy_form)
        self._init_averaging(period, warmup, adaptive, overlap, node_split)

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
