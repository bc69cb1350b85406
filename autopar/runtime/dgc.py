"""Deep Gradient Compression (Lin et al., "Deep Gradient Compression: Reducing the
communication bandwidth for distributed training", ICLR 2018) for SGD with momentum
(Layout.dgc and its dgc_* fields; docs/communication.md).

Phases, by step count:

- **Dense** (the first `Layout.dgc_warmup` steps): the layout's synchronous program, the
  gradients summed over dp in the graph and the user's SGD applies its momentum: bit for
  bit the data-parallel step.
- **Compressed** (after them): the program without the gradient all-reduce, so each
  rank's gradients are those of its own mean loss (their mean over the ranks is the
  global gradient); divided by dp they are its share g of the sum. Then, per tensor:
  - a *compressed* tensor (fp32, at least costs.DGC_DENSE_BELOW elements) takes DGC's
    path: local clipping first (the rank's whole gradient to `dgc_clip` / sqrt(dp)),
    weight decay added (wd * w / dp per rank, so the sum adds wd * w as SGD does), momentum correction u = m u + g, v += u, top-k of |v|
    (k = floor(numel * (1 - sparsity)), at least 1), the values and their int32 indices
    all-gathered (every rank sends exactly k per tensor, so shapes agree), summed into
    a dense gradient G in rank order on every rank (the ranks stay identical),
    momentum factor masking (u and v zeroed where this rank sent), and the update
    w -= lr * G with the optimizer group's learning rate (the optimizer skips these
    tensors: their .grad is None);
  - a *dense* tensor (small or not fp32, e.g. biases and norms) is summed with one
    all-reduce per dtype and stepped by the user's optimizer, momentum and all.
  At the first compressed step u starts from the optimizer's momentum buffer / dp (so
  the ranks' u sum to it) and v from zero, and the buffer is dropped.

The sparsity ramps up over `Layout.dgc_rampup` steps through the paper's stages
1 - 0.25^i (0.75, 0.9375, 0.984375, 0.996, ...) below the final `Layout.dgc`, each an
equal share of the ramp, then stays at the final one.

Top-k (`Layout.dgc_topk`): "exact" is torch.topk of |v|; "sampled" is the paper's
sampled threshold: a quantile of a random 1% sample of |v| (at least SAMPLE_MIN
elements; a generator seeded by step and rank, never the global RNG), set a little
below k/n so that about 2k candidates pass it, and top-k among the candidates gives
the same k as exact top-k whenever there are at least k of them (else the exact top-k
of the whole tensor runs, counted in `stats["sampled_fallbacks"]`).

u and v are optimizer state (`optimizer.state[w]["dgc_momentum"]`, `["dgc_residual"]`).
A checkpoint holds each rank's own (restored in the same layout and world size, so a
resume is bit-exact) and their sums over dp as the tensors DCP reshards: loaded into
another layout or world size, each rank takes sum / dp, which keeps the pending update
(the sum of the residuals) and the momentum (the sum of u).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.compiler.ir.program import Program, bind_groups
from autopar.costs import dgc_compressed, dgc_kept
from autopar.layout import LayoutError
from autopar.runtime.executor import DistributedStep
from autopar.runtime.pipeline import PipelineStep

STAGE_BASE = 0.25  # ramp-up stages 1 - STAGE_BASE**i, i = 1, 2, ...
SAMPLE_FRACTION = 0.01  # the sampled threshold's sample, of the tensor's elements
SAMPLE_MIN = 256  # and at least this many
MOMENTUM, RESIDUAL = "dgc_momentum", "dgc_residual"  # optimizer-state keys of u and v


def ramp_stages(final: float) -> list[float]:
    """The paper's ramp-up sparsities below `final`: 0.75, 0.9375, 0.984375, ..."""
    stages, i = [], 1
    while 1 - STAGE_BASE ** i < final:
        stages.append(1 - STAGE_BASE ** i)
        i += 1
    return stages


def sparsity_at(step: int, final: float, warmup: int, rampup: int) -> float | None:
    """The sparsity of step `step` (0-based): None in the dense warm-up, then the ramp-up's
    stages, each an equal share of `rampup` steps, then `final`."""
    if step < warmup:
        return None
    t = step - warmup
    stages = ramp_stages(final)
    if t >= rampup or not stages:
        return final
    return stages[t * len(stages) // rampup]


def top_k(magnitude: torch.Tensor, k: int, method: str,
          generator: torch.Generator | None = None) -> tuple[torch.Tensor, bool]:
    """Indices of the k largest of the flat `magnitude`, and whether the sampled method
    fell back to the exact one (module docstring)."""
    n = magnitude.numel()
    if method == "exact" or n <= SAMPLE_MIN:
        return torch.topk(magnitude, k, sorted=False).indices, False
    m = min(n, max(SAMPLE_MIN, math.ceil(n * SAMPLE_FRACTION)))
    sample = magnitude[torch.randint(n, (m,), generator=generator)]
    # the sample's (2 k/n + 4/m)-quantile: about 2k + 4n/m candidates, so rarely fewer than k
    taken = min(m, 2 * math.ceil(m * k / n) + 4)
    threshold = torch.topk(sample, taken, sorted=False).values.min()
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices, True
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices], False


def compress(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float, k: int,
             method: str = "exact", generator: torch.Generator | None = None,
             masking: bool = True) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One tensor's DGC step on this rank, in place: u = m u + g, v += u, the top-k of
    |v| taken out of v (error feedback: what is sent plus what stays is what was
    accumulated) and, with momentum factor `masking`, out of u. Returns the flat int64
    indices, their values and whether the sampled top-k fell back to the exact one."""
    u.mul_(momentum).add_(g)
    v.add_(u)
    flat_v = v.view(-1)
    idx, fell_back = top_k(flat_v.abs(), k, method, generator)
    values = flat_v[idx]
    flat_v.index_fill_(0, idx, 0)
    if masking:
        u.view(-1).index_fill_(0, idx, 0)
    return idx, values, fell_back


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """DGC's momentum correction replaces SGD's momentum: refuse anything else."""
    if type(optimizer) is not torch.optim.SGD:
        raise LayoutError(f"Layout.dgc corrects SGD's momentum locally (Lin et al.); the "
                          f"optimizer factory built {type(optimizer).__name__}: use "
                          f"torch.optim.SGD(params, lr, momentum=...) or Layout.dgc=None")
    for i, group in enumerate(optimizer.param_groups):
        bad = [f"{k}={group[k]!r}" for k, ok in (("momentum", group["momentum"] > 0),
                                                 ("dampening", group["dampening"] == 0),
                                                 ("nesterov", not group["nesterov"]),
                                                 ("maximize", not group["maximize"])) if not ok]
        if bad:
            raise LayoutError(f"Layout.dgc needs SGD with momentum > 0, no dampening, no "
                              f"Nesterov and no maximize; parameter group {i} has "
                              f"{', '.join(bad)}")


class _Compression:
    """What DGC adds to a step (DistributedStep or PipelineStep): the schedule, the
    compressed exchange and update, and the residuals in checkpoints. The step provides
    `mesh`, `updated`, `optimizer`, `steps`, `dp_size` and TrainingState's save / load.
    `stats`: what the compressed steps sent from this rank (values, bytes of the sparse
    all-gather), summed dense, compressed whole, and how often the sampled top-k fell
    back."""

    def _init_compression(self, sparsity: float, warmup: int, rampup: int,
                          clip: float | None, topk: str) -> None:
        check_optimizer(self.optimizer)
        self.final, self.warmup, self.rampup = sparsity, warmup, rampup
        self.clip, self.method = clip, topk
        self.compressed = [u.dtype == torch.float32 and dgc_compressed(u.numel(), 4)
                           for u in self.updated]
        self.group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        self._sparsity: float | None = None
        # momentum factor masking (the paper's); off only to compare with the dense sum
        self.momentum_masking = True
        self.stats = {"compressed_steps": 0, "sent_values": 0, "sent_bytes": 0,
                      "dense_values": 0, "whole_values": 0, "sampled_fallbacks": 0}

    def sparsity(self, step: int | None = None) -> float | None:
        """The sparsity of step `step` (default: the next), None for a dense step."""
        return sparsity_at(self.steps if step is None else step, self.final, self.warmup,
                           self.rampup)

    # -- the compressed exchange -------------------------------------------------------------

    def _state(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u and v of `u`, started at the first compressed step from the optimizer's
        momentum buffer / dp (the ranks' u sum to it)."""
        state = self.optimizer.state[u]
        if MOMENTUM not in state:
            buf = state.pop("momentum_buffer", None)
            n = self.dp_size
            state[MOMENTUM] = buf / n if buf is not None else torch.zeros_like(u)
            state[RESIDUAL] = torch.zeros_like(u)
        return state[MOMENTUM], state[RESIDUAL]

    def _share_scale(self, grads: list[torch.Tensor], shares: bool) -> float:
        """What turns this rank's gradients into its share of the sum, times local
        clipping's factor (the rank's whole gradient to `dgc_clip` / sqrt(dp)). `shares`:
        the gradients are shares already (the pipeline's seed divided by dp), else those
        of this rank's own mean loss (their mean over the ranks is the global one)."""
        n = self.dp_size
        base = 1.0 if shares else 1.0 / n
        if self.clip is None:
            return base
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()
        norm *= n * base  # the rank's whole gradient
        limit = self.clip / math.sqrt(n)
        return (limit / norm if norm > limit else 1.0) * base

    def _exchange(self, grads: list[torch.Tensor], loss: torch.Tensor | None,
                  sparsity: float, shares: bool = False) -> torch.Tensor | None:
        """The compressed step's exchange and the compressed tensors' update (`shares`:
        as for _share_scale). With `loss` (this rank's own mean), the global loss, the
        ranks' mean, carried in the fp32 dense all-reduce."""
        group, n = self.mesh.group("dp"), self.dp_size
        scale = self._share_scale(grads, shares)
        dense = [i for i, c in enumerate(self.compressed) if not c]
        dtypes = dict.fromkeys([torch.float32, *(self.updated[i].dtype for i in dense)])
        for dtype in dtypes:
            mine = [i for i in dense if self.updated[i].dtype == dtype]
            parts = [grads[i].reshape(-1) * scale for i in mine]
            if dtype == torch.float32 and loss is not None:
                parts.append(loss.detach().float().reshape(1) / n)
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=group)
            sizes = [grads[i].numel() for i in mine]
            for i, part in zip(mine, flat[:sum(sizes)].split(sizes)):
                self.updated[i].grad = part.view_as(grads[i])
            if dtype == torch.float32 and loss is not None:
                loss = flat[-1].to(loss.dtype)
            self.stats["dense_values"] += flat.numel()
        chosen = [i for i, c in enumerate(self.compressed) if c]
        if not chosen:
            return loss
        generator = torch.Generator().manual_seed(self.steps * 65_537 + self.mesh.rank_in("dp"))
        values, indices = [], []
        for i in chosen:
            w, g = self.updated[i], grads[i]
            group_opts = self.group_of[id(w)]
            g = g * scale
            if group_opts["weight_decay"]:
                g = g.add(w, alpha=group_opts["weight_decay"] / n)
            u, v = self._state(w)
            idx, vals, fell_back = compress(g, u, v, group_opts["momentum"],
                                            dgc_kept(v.numel(), sparsity), self.method,
                                            generator, self.momentum_masking)
            self.stats["sampled_fallbacks"] += fell_back
            values.append(vals)
            indices.append(idx.to(torch.int32))
        # one all-gather: the values, then the int32 indices bit-cast to fp32
        packed = torch.cat([*values, torch.cat(indices).view(torch.float32)])
        everyone = packed.new_empty(n * packed.numel())
        dist.all_gather_single(everyone, packed, group=group)
        sizes = [x.numel() for x in values]
        total = sum(sizes)
        parts = [(part[:total].split(sizes), part[total:].view(torch.int32).split(sizes))
                 for part in everyone.split(packed.numel())]
        for j, i in enumerate(chosen):
            w = self.updated[i]
            summed = torch.zeros_like(w).view(-1)
            for vals, idxs in parts:  # in rank order: every rank adds alike
                summed.index_add_(0, idxs[j].long(), vals[j])
            w.add_(summed.view_as(w), alpha=-self.group_of[id(w)]["lr"])
            w.grad = None
        self.stats["compressed_steps"] += 1
        self.stats["sent_values"] += total
        self.stats["sent_bytes"] += packed.numel() * packed.element_size()
        self.stats["whole_values"] += sum(self.updated[i].numel() for i in chosen)
        return loss

    # -- checkpoints ------------------------------------------------------------------------

    def _residual_states(self) -> list[dict]:
        return [self.optimizer.state[self.updated[i]] for i, c in enumerate(self.compressed)
                if c and MOMENTUM in self.optimizer.state[self.updated[i]]]

    def save(self, path, extra=None, *, background=False):
        """TrainingState.save with u and v: each rank's own (per-rank tensors) and, as the
        optimizer state DCP writes once and reshards, their sums over dp."""
        states = self._residual_states()
        own = {}
        group = self.mesh.group("dp")
        for state in states:
            own[id(state)] = (state[MOMENTUM], state[RESIDUAL])
            sums = [state[MOMENTUM].clone(), state[RESIDUAL].clone()]
            for t in sums:
                dist.all_reduce(t, group=group)
            state[MOMENTUM], state[RESIDUAL] = sums
        self._extra_per_rank = self._own_tensors_of(own)
        try:
            return super().save(path, extra, background=background)
        finally:
            for state in states:
                state[MOMENTUM], state[RESIDUAL] = own[id(state)]
            self._extra_per_rank = {}

    def _own_tensors_of(self, own: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict:
        names = self._param_names()
        out = {"dgc.own": torch.ones((), dtype=torch.int64)}
        for i, c in enumerate(self.compressed):
            state = self.optimizer.state[self.updated[i]]
            if c and id(state) in own:
                name = names[id(self.updated[i])]
                out[f"dgc.{name}.{MOMENTUM}"], out[f"dgc.{name}.{RESIDUAL}"] = own[id(state)]
        return out

    def load(self, path) -> dict:
        """TrainingState.load, then u and v: this rank's own where the checkpoint has the
        same layout and world size, else the saved sums / dp."""
        names = self._param_names()
        like = {"dgc.own": torch.zeros((), dtype=torch.int64)}
        for i, c in enumerate(self.compressed):
            if c:
                name = names[id(self.updated[i])]
                for key in (MOMENTUM, RESIDUAL):
                    like[f"dgc.{name}.{key}"] = torch.zeros_like(self.updated[i])
        self._extra_per_rank = like
        try:
            extra = super().load(path)
        finally:
            self._extra_per_rank = {}
        same = bool(like["dgc.own"])
        n = self.dp_size
        for i, c in enumerate(self.compressed):
            state = self.optimizer.state[self.updated[i]]
            if not (c and MOMENTUM in state):
                continue
            name = names[id(self.updated[i])]
            for key in (MOMENTUM, RESIDUAL):
                state[key] = like[f"dgc.{name}.{key}"].clone() if same else state[key] / n
        return extra


class DGCStep(_Compression, DistributedStep):
    """A DistributedStep whose gradient exchange after the dense warm-up is DGC's: the
    compressed steps run `dgc_program` (no gradient all-reduce; module docstring)."""

    def __init__(self, program: Program, dgc_program: Program, model: torch.nn.Module,
                 optimizer, *, objective=None, sparsity: float, warmup: int = 0,
                 rampup: int = 0, clip: float | None = None, topk: str = "exact"):
        super().__init__(program, model, optimizer, objective=objective)
        self.dgc_gm = bind_groups(dgc_program.gm, self.mesh.group_names) \
            if self.mesh.group_names else dgc_program.gm
        self._init_compression(sparsity, warmup, rampup, clip, topk)

    @property
    def dp_size(self) -> int:
        return self.program.mesh_size("dp")

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        self._sparsity = self.sparsity()
        if self._sparsity is None:
            return super().__call__(*args, **kwargs)
        return self._run(self.dgc_gm, self.graph_inputs(*args, **kwargs))

    def _update(self, grads: list[torch.Tensor], loss: torch.Tensor) -> torch.Tensor:
        if self._sparsity is None:
            return super()._update(grads, loss)
        loss = self._exchange(grads, loss, self._sparsity)
        self.optimizer.step()  # the dense tensors; the compressed ones have no .grad
        return loss


class DGCPipelineStep(_Compression, PipelineStep):
    """DGC on the pipeline runtime (pp > 1 or micro-batches): the schedule runs as in a
    synchronous step; after the dense warm-up the gradients are not summed over dp but
    exchanged as DGC's (each rank's gradients are already its share: the seed divided
    them by dp). The loss is the global one, as the pipeline's."""

    def __init__(self, program, model: torch.nn.Module, optimizer, *, objective=None,
                 sparsity: float, warmup: int = 0, rampup: int = 0,
                 clip: float | None = None, topk: str = "exact"):
        super().__init__(program, model, optimizer, objective=objective)
        self._init_compression(sparsity, warmup, rampup, clip, topk)

    @property
    def dp_size(self) -> int:
        return self.dp

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        self._sparsity = self.sparsity()
        self.sum_over_dp = self._sparsity is None
        return super().__call__(*args, **kwargs)

    def _apply(self, grads: list[torch.Tensor]) -> None:
        if self._sparsity is None:
            return super()._apply(grads)
        self._exchange(grads, None, self._sparsity, shares=True)
        self.optimizer.step()  # the dense tensors; the compressed ones have no .grad
        for u in self.updated:
            u.grad = None
