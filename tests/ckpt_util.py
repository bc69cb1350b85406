"""Helpers shared by the single-process and the multi-process checkpoint tests."""

from __future__ import annotations

import torch
from torch import nn


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 100) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=gen)).pow(2).mean().backward()
        optimizer.step()


def tensors_of(model: nn.Module) -> dict[str, torch.Tensor]:
    # keep_vars: the live parameters and buffers, so an in-place load updates the model.
    return dict(model.state_dict(keep_vars=True))


def names_of(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}
