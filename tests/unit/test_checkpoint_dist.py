"""Runs tests/dist/checkpoint_worker.py under torchrun: two gloo ranks save, load and agree on errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_checkpoint_across_two_ranks(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    worker = REPO / "tests" / "dist" / "checkpoint_worker.py"
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(worker), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "checkpoint worker OK" in done.stdout
