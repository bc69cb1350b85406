"""pytest front of the multi-process cases: one torchrun job per world size runs them all."""

from __future__ import annotations

import warnings

import pytest

from tests.dist import jobs
from tests.dist.jobs import CASES


@pytest.fixture(scope="session")
def world_results(tmp_path_factory):
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = jobs.results(world, tmp_path_factory.mktemp(f"dist{world}"))
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
    if "crashed_once" in results[name]:
        warnings.warn(f"case {name} passed when rerun, after its torchrun job crashed in it:\n"
                      f"{results[name]['crashed_once'][-6000:]}", stacklevel=1)
