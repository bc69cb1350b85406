"""PassManager: runs a list of passes, checks their contracts, instruments them.

The manager (not the passes) checks `requires` before each pass, verifies the
graph after it, times it, logs a one-line summary, and writes the IR after each
pass to `dump_dir/NNN_passname.py` when a dump directory is given (the
`AUTOPAR_DUMP` environment variable, read by `autopar.compile`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.printing import graph_text
from autopar.compiler.ir.trace import materialize
from autopar.compiler.ir.verify import verify
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult

log = logging.getLogger("autopar.passes")

_REGISTRY: dict[str, type[GraphPass] | Callable[[], GraphPass]] = {}


class PassOrderError(RuntimeError):
    """A pass was scheduled before the passes that establish what it requires."""


def register_pass(factory: type[GraphPass] | Callable[[], GraphPass],
                  name: str | None = None) -> type[GraphPass] | Callable[[], GraphPass]:
    """Make a pass available by name (usable as a class decorator)."""
    key = name or getattr(factory, "name", None) or factory.__name__
    if key in _REGISTRY and _REGISTRY[key] is not factory:
        raise ValueError(f"a pass named {key!r} is already registered ({_REGISTRY[key]})")
    _REGISTRY[key] = factory
    return factory


def get_pass(name: str) -> GraphPass:
    if name not in _REGISTRY:
        raise KeyError(f"no pass named {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()


def registered_passes() -> list[str]:
    return sorted(_REGISTRY)


class PassManager:
    def __init__(self, passes: Sequence[GraphPass], *, verify_each: bool = True,
                 dump_dir: str | Path | None = None):
        self.passes = list(passes)
        self.verify_each = verify_each
        self.dump_dir = Path(dump_dir) if dump_dir else None

    def check_order(self, provided: frozenset[str]) -> None:
        """Refuse a pipeline in which a pass needs what no earlier pass provides."""
        have = set(provided)
        for index, p in enumerate(self.passes):
            missing = set(p.requires) - have
            if missing:
                suppliers = {m: [q.name for q in self.passes[index + 1:] if m in q.provides]
                             for m in missing}
                raise PassOrderError(
                    f"pass {p.name!r} (position {index}) requires {sorted(missing)}, which no "
                    f"earlier pass provides; later passes that provide it: {suppliers}")
            have = (have - set(p.invalidates)) | set(p.provides)

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, list[PassResult]]:
        self.check_order(tg.provides)
        if self.dump_dir:
            self._dump(0, "traced", tg)
        results = []
        for index, p in enumerate(self.passes, start=1):
            start = time.perf_counter()
            if not p.retraces_from_source:  # a re-trace left for a pass that does them
                tg = materialize(tg)
            follows = self.passes[index] if index < len(self.passes) else None
            defer = follows is not None and follows.retraces_from_source
            new, result = p.run(tg, dataclasses.replace(ctx, defer_retrace=defer))
            result.seconds = time.perf_counter() - start
            new = dataclasses.replace(new, provides=(tg.provides - p.invalidates) | p.provides,
                                      history=tg.history + (p.name,))
            if self.verify_each:
                verify(new)
            log.info("%s (%.3f s)", result.summary(), result.seconds)
            if self.dump_dir:
                self._dump(index, p.name, new)
            results.append(result)
            tg = new
        return materialize(tg), results

    def _dump(self, index: int, name: str, tg: TrainGraph) -> None:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"{index:03d}_{name}.py"
        pending = ("# its re-trace is left to the next pass: the IR below is the one before it\n"
                   if tg.retrace_pending else "")
        path.write_text(f"# after pass {name!r}; history: {list(tg.history)}\n{pending}"
                        + graph_text(tg))
