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


# cases per torchrun job: every case builds its own process groups (a DeviceMesh per
# step), and gloo keeps each group's sockets until the job ends; in one job of all 203
# world-2 cases, creating a group failed with "Broken pipe" in the 199th-202nd case once
# (each of those passed in a job of its own). A job per this many cases starts afresh.
CASES_PER_JOB = 70


def _run_world(world: int, tmp_dir: Path) -> dict:
    names = [n for n, (w, _) in CASES.items() if w == world]
    results: dict = {}
    for first in range(0, len(names), CASES_PER_JOB):
        chunk = names[first:first + CASES_PER_JOB]
        results.update(_run_job(world, chunk, tmp_dir / f"results_{world}_{first}.json"))
    return results


def _run_job(world: int, names: list[str], out: Path) -> dict:
    """One torchrun job running `names`: {case: verdict}. When the job dies in a case, the
    cases before it keep their verdicts (OUT.partial), the case it died in fails with the
    job's output, and the cases after it run in a new job."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "tests.dist.runner", "--out", str(out), *names]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if out.exists():
        return json.loads(out.read_text())
    partial = Path(str(out) + ".partial")
    done: dict = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            try:
                done.update(json.loads(line))
            except ValueError:  # the line the crash cut short
                break
    crash = f"exit code {proc.returncode}\n" + proc.stdout[-4000:] + proc.stderr[-12000:]
    if len(done) == len(names):  # every case ran: the job died leaving; the last one fails
        done[names[-1]] = {"ok": False, "error": f"the torchrun job died after its last "
                           f"case:\n{crash}"}
        return done
    crashed, rest = names[len(done)], names[len(done) + 1:]
    done[crashed] = {"ok": False, "error": f"the torchrun job died in this case (after "
                     f"{len(done)} of its {len(names)} cases had passed or failed):\n{crash}"}
    if rest:
        done.update(_run_job(world, rest, out.with_name(out.stem + "_rest.json")))
    return done


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
def test_case(name, world_results, record_property):
    world, _ = CASES[name]
    results = world_results(world)
    assert name in results, f"case {name} did not run"
    # the case's own time inside its torchrun job (conftest lists the slowest)
    record_property("dist_seconds", results[name].get("seconds", 0.0))
    assert results[name]["ok"], results[name]["error"]
