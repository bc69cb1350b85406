"""Eager references for AMP tests: torch.autocast (+ torch.amp.GradScaler for fp16)."""

from __future__ import annotations

import copy

import torch

from autopar.compiler.ir.batch import as_objective
from autopar.compiler.passes.amp_policy import HALF_DTYPES


def autocast_train(model, batches, loss_fn, optimizer_factory, amp: str, growth_interval=2000,
                   init_scale=2.0**16):
    """Eager autocast training on one process: (losses, state, scales, skipped steps).
    `loss_fn` is an Objective or a loss function of the output and every input.

    Scales and skipped steps are GradScaler's (fp16 only): the scale used at each step
    and the indices of the steps whose optimizer step was skipped."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer_factory(params)
    scaler = (torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
              if amp == "fp16" else None)
    losses, scales, skipped = [], [], []
    for i, batch in enumerate(batches):
        with torch.autocast("cpu", dtype=HALF_DTYPES[amp]):
            loss = as_objective(loss_fn, len(batch)).loss(model, batch)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            if sum(v.item() for v in scaler._found_inf_per_device(opt).values()):
                skipped.append(i)
            scaler.update()
        losses.append(loss.detach().float().item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, scales, skipped
