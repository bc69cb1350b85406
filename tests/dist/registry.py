"""Registry of multi-process test cases (kept apart from runner.py, which runs as __main__)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

CASES: dict[str, tuple[int, Callable[[], None]]] = {}


def case(world: int):
    """Register a case to run on `world` processes; it raises AssertionError on failure."""
    def register(fn):
        CASES[fn.__name__] = (world, fn)
        return fn
    return register


def load_cases() -> dict[str, tuple[int, Callable[[], None]]]:
    import tests.dist as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("cases_"):
            importlib.import_module(f"tests.dist.{info.name}")
    return CASES
