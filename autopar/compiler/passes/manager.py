"""PassManager: runs a list of passes, checks their contracts, instruments them.

The manager (not the passes) checks `requires` before each pass, verifies the
graph after it, times it, logs a one-line summary, and writes the IR after each
pass to `dump_dir/NNN_passname.py` when a dump directory is given (the
`AUTOPAR_DUMP` environment variable, read by `autopar.compile`). It also runs the
deferred re-trace hand-off between forward-level passes (passes/base.py's docstring).

A graph a pass returns is the next pass's to rewrite in place (`PassContext.owns_input`,
`base.writable`): only the caller's input graph is copied, once, by the first pass that
rewrites it. So a pass returns a graph it made, or its input, never one it keeps.

When a pass raises, the exception propagates as it was raised, with a note
(`add_note`, shown under the traceback) naming the pass and the passes that ran
before it. A graph a pass returns that fails verification raises VerificationError
naming the pass.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torch.fx import Node

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.printing import graph_text
from autopar.compiler.ir.trace import complete_pending_retrace
from autopar.compiler.ir.verify import VerificationError, verify
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
                 dump_dir: str | Path | None = None, record_rewrites: bool = False):
        self.passes = list(passes)
        # mark each node whose op or inputs a pass changed with M.REWRITTEN_BY (what
        # autopar.bisect names); off by default: the planner runs passes many times
        self.record_rewrites = record_rewrites
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
        if self.dump_dir:  # the traced graph is dumped first: a pending trace is done now
            tg = self._complete_pending_retrace(tg, None)
            self._dump(0, "traced", tg)
        results = []
        left_by = None  # the pass whose re-trace is pending in tg, if one is
        given = tg.graph  # the caller's: a pass copies it before rewriting it
        for index, p in enumerate(self.passes, start=1):
            start = time.perf_counter()
            if not p.retraces_from_source:  # a re-trace left for a pass that does them
                tg = self._complete_pending_retrace(tg, left_by)
            before = _signatures(tg.graph) if self.record_rewrites else None
            follows = self.passes[index] if index < len(self.passes) else None
            may_defer = follows is not None and follows.retraces_from_source
            # a graph other than the caller's was made in this run (by the pass before, or
            # a re-trace) and nothing else holds it: the pass may rewrite it in place
            owns = tg.graph is not given and not tg.retrace_pending
            try:
                new, result = p.run(tg, dataclasses.replace(ctx, may_defer_retrace=may_defer,
                                                            owns_input=owns))
            except Exception as exc:
                # the caller may catch this type (a LayoutError the planner skips, a
                # StageError a test expects): it goes on as raised, with where it came from
                exc.add_note(f"in pass {p.name!r} ({self._where(index, tg, left_by)})")
                raise
            if before is not None and not _retraced(tg, new):
                _mark_rewrites(new.graph, before, p.name)
            elif before is not None:
                new.attrs["retraced_by"] = [*tg.attrs.get("retraced_by", ()), p.name]
            result.seconds = time.perf_counter() - start
            new = dataclasses.replace(new, provides=(tg.provides - p.invalidates) | p.provides,
                                      history=tg.history + (p.name,))
            if self.verify_each and not new.retrace_pending:  # a pending gm is not the step's
                try:
                    verify(new)
                except VerificationError as exc:
                    raise VerificationError(f"pass {p.name!r} returned an invalid graph "
                                            f"({self._where(index, tg, left_by)}): {exc}") from exc
            log.info("%s (%.3f s)", result.summary(), result.seconds)
            if self.dump_dir:
                self._dump(index, p.name, new)
            results.append(result)
            if new.retrace_pending and not tg.retrace_pending:
                left_by = p.name
            tg = new
        return self._complete_pending_retrace(tg, left_by), results

    def _where(self, index: int, tg: TrainGraph, left_by: str | None) -> str:
        """Where pass number `index` (from 1) stands, given its input `tg`: its place in
        the list and the passes that ran before it on the graph (`tg.history`: this
        list's and those of earlier runs on the same graph)."""
        ran = ", ".join(map(repr, tg.history)) or "none"
        pending = (f"; it also ran the re-trace {left_by or 'an earlier pass'!r} left to it"
                   if tg.retrace_pending else "")
        return f"pass {index} of {len(self.passes)}; ran before it: {ran}{pending}"

    @staticmethod
    def _complete_pending_retrace(tg: TrainGraph, left_by: str | None) -> TrainGraph:
        """tg with the re-trace pass `left_by` left to the next one done (the hook that
        fails in it, if one does, is most likely that pass's)."""
        try:
            return complete_pending_retrace(tg)
        except Exception as exc:
            who = f"pass {left_by!r}" if left_by else \
                "the input graph's last pass (or its first trace, if it came pending)"
            exc.add_note(f"in the re-trace {who} left to the next pass (passes run: "
                         f"{', '.join(map(repr, tg.history)) or 'none'})")
            raise

    def _dump(self, index: int, name: str, tg: TrainGraph) -> None:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"{index:03d}_{name}.py"
        pending = ("# its re-trace is left to the next pass: the IR below is the one before it\n"
                   if tg.retrace_pending else "")
        path.write_text(f"# after pass {name!r}; history: {list(tg.history)}\n{pending}"
                        + graph_text(tg))


def _retraced(old: TrainGraph, new: TrainGraph) -> bool:
    """Whether the pass traced the step again (its nodes are new, whatever their names)."""
    return new.source is not None and old.source is not None and \
        (new.source.hooks != old.source.hooks or new.retrace_pending)


def _signatures(graph) -> dict[str, tuple]:
    """Each node's op with its constant arguments, and the names of its inputs."""
    def constant(a):
        return "node" if isinstance(a, Node) else repr(a)

    # an input is known by the node it computes: fusion's getitems stand for the nodes
    # they replaced, so reading one instead is no rewiring
    return {n.name: ((M.op_key(n), tuple(map(constant, n.args)),
                      tuple((k, constant(v)) for k, v in n.kwargs.items())),
                     tuple(a.meta.get(M.COMPUTES, (a.name,))[0] for a in n.all_input_nodes))
            for n in graph.nodes}


def _mark_rewrites(graph, before: dict[str, tuple], pass_name: str) -> None:
    """On the nodes of `graph` that `before` has a node of the same name for: M.REWRITTEN_BY
    gains the pass if it changed the op or a constant argument, M.REWIRED_BY names it if
    it changed the inputs (a node the pass created carries M.CREATED_BY instead)."""
    for node, (name, (op, inputs)) in zip(graph.nodes, _signatures(graph).items()):
        if name not in before:
            continue
        if before[name][0] != op:
            node.meta[M.REWRITTEN_BY] = (*node.meta.get(M.REWRITTEN_BY, ()), pass_name)
        if before[name][1] != inputs:
            node.meta[M.REWIRED_BY] = pass_name
