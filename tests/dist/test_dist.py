"""pytest front of the multi-process cases: one torchrun job per world size runs them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.registry import load_cases

ROOT = Path(__file__).resolve().parents[2]
CASES = load_cases()
TIMEOUT_S = 1200


def _run_world(world: int, tmp_dir: Path) -> dict:
    out = tmp_dir / f"results_{world}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "tests.dist.runner", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if not out.exists():  # the job died before rank 0 wrote the verdicts
        return {"__crash__": f"exit code {proc.returncode}\n" + proc.stdout[-4000:]
                + proc.stderr[-8000:]}
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def world_results(tmp_path_factory):
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = _run_world(world, tmp_path_factory.mktemp(f"dist{world}"))
        return cache[world]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, world_results):
    world, _ = CASES[name]
    results = world_results(world)
    if "__crash__" in results:
        pytest.fail(f"the torchrun job for world size {world} crashed:\n{results['__crash__']}")
    assert name in results, f"case {name} did not run"
    assert results[name]["ok"], results[name]["error"]
