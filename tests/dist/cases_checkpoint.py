"""Checkpoint round trip and error agreement across ranks (gloo, 2 processes).

Every rank holds the same (replicated) model, as plain tensors do under data
parallelism. Run by tests/dist/runner.py with the other 2-process cases.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime import checkpoint as ck
from tests.ckpt_util import names_of, tensors_of, train
from tests.dist.registry import case


def make_model(seed: int, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def manifest_of(model: nn.Module) -> dict:
    return {"layout": "dp2", "world_size": dist.get_world_size(), "tensors": ck.describe_tensors(tensors_of(model))}


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    state = ck.optimizer_state_by_name(optimizer, names_of(model))
    ck.save_checkpoint(path, tensors_of(model), state, manifest_of(model))


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    template = ck.optimizer_state_by_name(optimizer, names_of(model))
    state = ck.load_checkpoint(path, tensors_of(model), manifest_of(model), template)
    ck.load_optimizer_state_by_name(optimizer, names_of(model), state)


def assert_equal_models(got: nn.Module, want: nn.Module, what: str) -> None:
    for (name, a), b in zip(tensors_of(got).items(), tensors_of(want).values()):
        assert torch.equal(a, b), f"rank {dist.get_rank()}: {name} differs {what}"


def expect_error(fragment: str, action) -> None:
    try:
        action()
    except ck.CheckpointError as e:
        assert fragment in str(e), f"rank {dist.get_rank()}: {fragment!r} not in {e}"
    else:
        raise AssertionError(f"rank {dist.get_rank()}: no CheckpointError containing {fragment!r}")


def check_round_trip(path: Path) -> nn.Module:
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, steps=1)
    save(path, model, optimizer)
    train(model, optimizer, steps=1)
    save(path, model, optimizer)  # replaces the first one
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name], list(path.parent.iterdir())

    restored = make_model(1)
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=5.0)
    load(path, restored, restored_opt)
    assert_equal_models(restored, model, "after load")
    train(model, optimizer, steps=1, seed=7)
    train(restored, restored_opt, steps=1, seed=7)
    assert_equal_models(restored, model, "one step after load")
    return model


def check_errors_agree(path: Path) -> None:
    wider = make_model(2, hidden=32)
    expect_error("0.weight: shape (16, 4) in the checkpoint, (32, 4) in this model",
                 lambda: load(path, wider, torch.optim.AdamW(wider.parameters())))
    if dist.get_rank() == 0:  # only rank 0 verifies, so the other ranks learn of it by broadcast
        victim = sorted(path.glob("*.distcp"))[0]
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    dist.barrier()
    fresh = make_model(3)
    before = {name: t.detach().clone() for name, t in tensors_of(fresh).items()}
    victim_name = sorted(path.glob("*.distcp"))[0].name
    expect_error(f"corrupted: {victim_name} has changed since it was saved",
                 lambda: load(path, fresh, torch.optim.AdamW(fresh.parameters())))
    assert all(torch.equal(t, before[name]) for name, t in tensors_of(fresh).items())


@case(world=2)
def checkpoint_round_trip_and_errors_agree_across_ranks() -> None:
    root = [tempfile.mkdtemp(prefix="autopar-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)  # one directory that every rank sees
    path = Path(root[0]) / "checkpoint-worker" / "ckpt"
    check_round_trip(path)
    check_errors_agree(path)
    dist.barrier()
