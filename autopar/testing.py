"""Parity between a compiled parallel step and plain single-process PyTorch.

Used by autopar's own tests and by `autopar train --parity`; use it to check that
a layout is equivalent on your own model.

The reference trains a copy of the same model on the whole global batch with the
same optimizer; the comparison covers the loss of every step and every weight.
Tolerances (fp32), see FINDINGS.md "Numerics of parity checks":
- loss: 1e-5 relative;
- weights: 1e-5 of the weight's magnitude, or, with Adam, 1e-2 of how far the
  weight moved (Adam amplifies rounding noise on weights whose true gradient is
  ~0, such as key biases under softmax, and on elements whose gradient is far
  below the rest of their tensor's: plain gradient accumulation over 4 micro-batches
  moves one of GPT-2's MLP weights 5.8e-3 of the tensor's movement away from the
  full-batch step; in float64 the two agree to 5e-12 of the move, so it is rounding:
  tests/unit/test_testing.py). SGD gets no such allowance, so a
  gradient scale error (sum instead of mean, 1.0001x) fails there;
- an absolute floor of 1e-6 of the largest movement of any weight in the model: a
  weight whose true gradient is zero and that starts at zero (BERT's key biases)
  only ever holds rounding noise (~1e-13), which no relative test can judge.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from autopar.compiler.ir.batch import as_objective

LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-5
ADAM_MOVE_RTOL = 1e-2
GLOBAL_MOVE_FLOOR = 1e-6


def make_batches(batch: tuple[torch.Tensor, ...], steps: int, seed: int = 1234) -> list[tuple]:
    """`steps` different global batches shaped like `batch` (ids stay in range)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        new = []
        for x in batch:
            if x.is_floating_point():
                new.append(torch.randn(x.shape, generator=gen, dtype=x.dtype))
            else:
                high = int(x.max()) + 1
                new.append(torch.randint(0, max(high, 2), x.shape, generator=gen, dtype=x.dtype))
        out.append(tuple(new))
    return out


def reference_train(model, batches, loss_fn, optimizer_factory):
    """Plain PyTorch: forward, loss, backward, optimizer step on the whole batch.
    `batches` are flat; `loss_fn` is an Objective (how the batch reaches the model and
    the loss, as the compiled step was given it) or a plain loss function of the output
    and every input."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer_factory(params)
    losses = []
    for batch in batches:
        loss = as_objective(loss_fn, len(batch)).loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class ParityReport:
    loss_rel_err: float
    worst: list[tuple[str, float, float, float]] = field(default_factory=list)  # name, err, |w|, moved
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        head = f"loss rel err {self.loss_rel_err:.2e}; "
        worst = ", ".join(f"{n}: err {e:.1e} (|w| {w:.1e}, moved {m:.1e})" for n, e, w, m in self.worst[:3])
        return head + "worst weights: " + worst + ("; FAILED: " + "; ".join(self.failures[:5]) if self.failures else "")


def compare(losses, ref_losses, state, ref_state, init_state, adam: bool) -> ParityReport:
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    report = ParityReport(rel)
    if len(losses) != len(ref_losses):
        report.failures.append(f"{len(losses)} losses vs {len(ref_losses)}")
    if not rel <= LOSS_RTOL:  # NOTE: written so that a NaN loss fails
        report.failures.append(f"losses {losses} vs reference {ref_losses}")
    missing = sorted(set(ref_state) - set(state))
    if missing:
        report.failures.append(f"weights missing from full_state_dict: {missing[:5]}")
    rows = []
    for name, ref in ref_state.items():
        if name not in state or not ref.is_floating_point():
            continue
        got = state[name]
        if got.shape != ref.shape:
            report.failures.append(f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
            continue
        err = (got.double() - ref.double()).abs().max().item()
        mag = ref.double().abs().max().item()
        moved = (ref.double() - init_state[name].double()).abs().max().item()
        rows.append((name, err, mag, moved))
    floor = GLOBAL_MOVE_FLOOR * max((moved for *_, moved in rows), default=0.0)
    for name, err, mag, moved in rows:
        within = (err <= WEIGHT_RTOL * mag or err <= floor
                  or (adam and err <= ADAM_MOVE_RTOL * moved))
        if not within:
            report.failures.append(f"{name}: max err {err:.2e}, |w| {mag:.2e}, moved {moved:.2e}")
    report.worst = sorted(rows, key=lambda r: -r[1] / max(r[2], 1e-12))
    return report
