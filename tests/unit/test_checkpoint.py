"""Checkpoints in one process: round trips, interrupted saves, corruption and mismatches."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from autopar.runtime import checkpoint as ck
from tests.ckpt_util import names_of, tensors_of, train
from autopar.runtime.checkpoint import CheckpointError

REPO = Path(__file__).resolve().parents[2]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": lambda params, lr=1e-2: torch.optim.AdamW(params, lr=lr),
    "sgd-momentum": lambda params, lr=1e-1: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "sgd": lambda params, lr=1e-1: torch.optim.SGD(params, lr=lr),
}


def make_model(seed: int, hidden: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    # BatchNorm brings buffers, one of them an int64 scalar.
    return nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 3))


def manifest_of(model: nn.Module, layout: str = "dp1") -> dict:
    return {"autopar": "0.1.0", "layout": layout, "world_size": 1, "tensors": ck.describe_tensors(tensors_of(model))}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tensors_of(model).items()}


def assert_same(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, t in tensors_of(model).items():
        assert torch.equal(t, expected[name]), name


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    state = None if optimizer is None else ck.optimizer_state_by_name(optimizer, names_of(model))
    ck.save_checkpoint(path, tensors_of(model), state, manifest_of(model))


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    template = None if optimizer is None else ck.optimizer_state_by_name(optimizer, names_of(model))
    state = ck.load_checkpoint(path, tensors_of(model), manifest_of(model), template)
    if optimizer is not None:
        ck.load_optimizer_state_by_name(optimizer, names_of(model), state)


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_round_trip_continues_bitwise(tmp_path: Path, kind: str) -> None:
    model = make_model(0)
    optimizer = OPTIMIZERS[kind](model.parameters())
    train(model, optimizer, steps=2)
    save(tmp_path / "ckpt", model, optimizer)

    # Another seed and learning rate: everything must come from the checkpoint.
    restored = make_model(1)
    restored_opt = OPTIMIZERS[kind](restored.parameters(), lr=123.0)
    load(tmp_path / "ckpt", restored, restored_opt)
    assert_same(restored, snapshot(model))
    assert restored_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]

    train(model, optimizer, steps=1, seed=7)
    train(restored, restored_opt, steps=1, seed=7)
    assert_same(restored, snapshot(model))


def test_optimizer_state_round_trips_types(tmp_path: Path) -> None:
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    train(model, optimizer, steps=2)
    state = ck.optimizer_state_by_name(optimizer, names_of(model))
    state["state"]["0.weight"]["step"] = 2.0  # some optimizers keep a float step
    ck.save_checkpoint(tmp_path / "ckpt", tensors_of(model), state, manifest_of(model))

    fresh = make_model(1)
    template = ck.optimizer_state_by_name(torch.optim.AdamW(fresh.parameters()), names_of(fresh))
    assert template["state"] == {}
    loaded = ck.load_checkpoint(tmp_path / "ckpt", tensors_of(fresh), manifest_of(fresh), template)

    assert loaded["state"]["0.weight"]["step"] == 2.0
    assert torch.equal(loaded["state"]["0.bias"]["step"], state["state"]["0.bias"]["step"])
    assert torch.equal(loaded["state"]["3.weight"]["exp_avg_sq"], state["state"]["3.weight"]["exp_avg_sq"])
    assert loaded["param_groups"] == state["param_groups"]
    assert isinstance(loaded["param_groups"][0]["betas"], tuple)


def test_load_without_optimizer_template(tmp_path: Path) -> None:
    model = make_model(0)
    save(tmp_path / "ckpt", model)
    fresh = make_model(1)
    assert ck.load_checkpoint(tmp_path / "ckpt", tensors_of(fresh), manifest_of(fresh), None) is None
    assert_same(fresh, snapshot(model))


def test_layout_and_world_size_may_differ(tmp_path: Path) -> None:
    model = make_model(0)
    save(tmp_path / "ckpt", model)
    fresh = make_model(1)
    manifest = {**manifest_of(fresh, layout="tp2"), "world_size": 4}
    ck.load_checkpoint(tmp_path / "ckpt", tensors_of(fresh), manifest, None)
    assert_same(fresh, snapshot(model))


def test_save_replaces_previous_checkpoint(tmp_path: Path) -> None:
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save(tmp_path / "ckpt", model, optimizer)
    train(model, optimizer, steps=1)
    save(tmp_path / "ckpt", model, optimizer)
    assert leftovers(tmp_path / "ckpt") == []
    fresh = make_model(1)
    load(tmp_path / "ckpt", fresh)
    assert_same(fresh, snapshot(model))


def test_save_failing_half_way_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    save(tmp_path / "ckpt", model, optimizer)
    saved = snapshot(model)
    train(model, optimizer, steps=1)

    write_data = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):  # the data files exist, .metadata does not
        write_data(self, plan, planner).wait()
        raise OSError("disk full")

    monkeypatch.setattr(FileSystemWriter, "write_data", write_then_fail)
    with pytest.raises(CheckpointError, match="disk full"):
        save(tmp_path / "ckpt", model, optimizer)
    monkeypatch.undo()

    assert leftovers(tmp_path / "ckpt") == []
    fresh = make_model(1)
    load(tmp_path / "ckpt", fresh, torch.optim.AdamW(fresh.parameters()))
    assert_same(fresh, saved)


KILLED_SAVE = """
import os, sys, torch
from torch.distributed.checkpoint import FileSystemWriter
sys.path.insert(0, {tests!r})
from test_checkpoint import make_model, load, save
path = {path!r}
model = make_model(1)
load(path, model)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
{patch}
save(path, model)
sys.exit("the save was expected to be killed")
"""

KILL_AFTER_WRITING = """
write_data = FileSystemWriter.write_data
def write_then_die(self, plan, planner):
    write_data(self, plan, planner).wait()
    os._exit(9)
FileSystemWriter.write_data = write_then_die
"""

# The save renames the old checkpoint aside, then the new one into place: die before the latter.
# (DCP itself renames too, so count nothing but renames onto the checkpoint path.)
KILL_BETWEEN_RENAMES = """
rename = os.rename
def rename_then_die(src, dst):
    if str(dst) == path:
        os._exit(9)
    rename(src, dst)
os.rename = rename_then_die
"""


def run_killed_save(path: Path, patch: str) -> None:
    script = KILLED_SAVE.format(tests=str(Path(__file__).parent), path=str(path), patch=patch)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr


def test_killed_save_keeps_previous_and_next_save_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    model = make_model(0)
    save(path, model)
    run_killed_save(path, textwrap.dedent(KILL_AFTER_WRITING))
    assert [name.split("-")[0] for name in leftovers(path)] == ["ckpt.tmp"]

    fresh = make_model(1)
    load(path, fresh)
    assert_same(fresh, snapshot(model))
    save(path, fresh)
    assert leftovers(path) == []


def test_save_killed_between_renames_is_finished_on_load(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    model = make_model(0)
    save(path, model)
    run_killed_save(path, textwrap.dedent(KILL_BETWEEN_RENAMES))
    assert not path.exists()
    assert sorted(name.split("-")[0] for name in leftovers(path)) == ["ckpt.old", "ckpt.tmp"]

    fresh = make_model(2)
    load(path, fresh)  # the new checkpoint was complete: load puts it in place
    parameters = dict(model.named_parameters())
    expected = {name: t + 1.0 if name in parameters else t for name, t in snapshot(model).items()}
    assert_same(fresh, expected)
    save(path, fresh)
    assert leftovers(path) == []


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"])
def test_corrupted_file_is_named_and_nothing_changes(tmp_path: Path, victim: str) -> None:
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    train(model, optimizer, steps=1)
    save(tmp_path / "ckpt", model, optimizer)
    file = tmp_path / "ckpt" / victim
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))

    fresh = make_model(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match=f"corrupted: {victim} has changed since it was saved"):
        load(tmp_path / "ckpt", fresh, fresh_opt)
    assert_same(fresh, before)
    assert fresh_opt.state_dict()["state"] == {}


def test_corrupted_manifest(tmp_path: Path) -> None:
    model = make_model(0)
    save(tmp_path / "ckpt", model)
    manifest = tmp_path / "ckpt" / ck.MANIFEST_FILE
    manifest.write_text(manifest.read_text().replace('"dtype": "float32"', '"dtype": "float64"', 1))
    with pytest.raises(CheckpointError, match=f"corrupted: {ck.MANIFEST_FILE}"):
        load(tmp_path / "ckpt", make_model(1))


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path: Path) -> None:
    save(tmp_path / "ckpt", make_model(0, hidden=8))
    wider = make_model(1, hidden=16)
    before = snapshot(wider)
    with pytest.raises(CheckpointError) as raised:
        load(tmp_path / "ckpt", wider, torch.optim.AdamW(wider.parameters()))
    message = str(raised.value)
    assert "0.weight: shape (8, 4) in the checkpoint, (16, 4) in this model" in message
    assert "3.weight: shape (3, 8) in the checkpoint, (3, 16) in this model" in message
    assert_same(wider, before)


def test_missing_unexpected_and_dtype_are_named(tmp_path: Path) -> None:
    save(tmp_path / "ckpt", make_model(0))
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 3)).double()
    with pytest.raises(CheckpointError) as raised:
        load(tmp_path / "ckpt", other)
    message = str(raised.value)
    assert "not in the checkpoint: 4.weight, 4.bias" in message
    assert "0.weight: dtype float32 in the checkpoint, float64 in this model" in message


def test_optimizer_groups_must_match(tmp_path: Path) -> None:
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters())
    train(model, optimizer, steps=1)
    save(tmp_path / "ckpt", model, optimizer)
    fresh = make_model(1)
    before = snapshot(fresh)
    partial = torch.optim.AdamW(fresh[0].parameters())
    with pytest.raises(CheckpointError, match="parameter group 0: not in this optimizer: 1.weight"):
        load(tmp_path / "ckpt", fresh, partial)
    assert_same(fresh, before)


def test_optimizer_template_needs_saved_state(tmp_path: Path) -> None:
    save(tmp_path / "ckpt", make_model(0))
    fresh = make_model(1)
    with pytest.raises(CheckpointError, match="no optimizer state in the checkpoint"):
        load(tmp_path / "ckpt", fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no autopar checkpoint at .*nothing-here"):
        load(tmp_path / "nothing-here", make_model(0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no autopar checkpoint at .*empty"):
        load(tmp_path / "empty", make_model(0))


def test_save_refuses_to_replace_other_data(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not an autopar checkpoint"):
        save(tmp_path / "mine", make_model(0))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_save_checks_manifest_describes_tensors(tmp_path: Path) -> None:
    model = make_model(0)
    manifest = manifest_of(make_model(0, hidden=16))
    with pytest.raises(CheckpointError, match=r"0.weight: shape \(16, 4\) in the manifest, \(8, 4\) in the tensors"):
        ck.save_checkpoint(tmp_path / "ckpt", tensors_of(model), None, manifest)
    assert not (tmp_path / "ckpt").exists()


def test_unnamed_optimizer_parameter_is_reported() -> None:
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names = {key: name for key, name in names_of(model).items() if name != "3.bias"}
    with pytest.raises(CheckpointError, match=r"shapes \[\(3,\)\] have no name"):
        ck.optimizer_state_by_name(optimizer, names)
