"""Planning on two cores: a forked process rewrites graphs while the search costs.

Most of a deep model's planning time is tracing and rewriting (export, the joint trace,
the tensor-parallel and AMP re-trace, fusion), once per *group* of layouts that share a
trace and the forward-level passes (`Estimator.group_of`). Groups are independent of
one another, so `RewriteWorker` forks the Estimator once the search knows the order it
will ask for them in (pipeline templates included: plan.rewrites_asked), keeps the
first group for the parent, which needs it at once, and gives the children the others,
round robin: the parent then costs (schedules, replicated pipelines) while they
rewrite. A child rewrites ahead, one at a time, the first template and the first
layout without one of each of its groups (the trace and forward-level passes they
share are the costly part), and answers the parent's requests between them with
what the search reads: the summaries, the pipeline template, the tensor-parallel table
and the trace's FLOPs (plain data; graphs stay in the process that made them).

The search runs unchanged in the parent, in the same order: a layout of the child's
groups is asked of the child (it rewrites it then if it has not yet), any other is
rewritten in the parent as without a worker. A group is rewritten by one process
only, so every prediction is the one a single process computes, and so is the plan.

Only the groups whose FLOP bound is within `AHEAD` of the least are given to the child:
the others (fp32 once bf16 is 15x faster, say) are seldom costed, and a child busy
rewriting one would keep the parent waiting on its next request.

Only for the scaled traces of `trace_blocks` (an exact trace keeps the rewritten graph
for the memory replay, which is not sent). If the child dies, or cannot send a
result, the parent rewrites that layout itself.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import highspy
import torch

from autopar.layout import Layout

AHEAD = 1.5  # groups given to the child: FLOP bound at most this many times the least


def available() -> bool:
    """Whether a worker can be forked here: Linux, and CUDA not started in this process
    (a forked child cannot use it; the traces run on fake tensors, but a model's real
    CUDA tensors would be asked for their device)."""
    return sys.platform.startswith("linux") and not torch.cuda.is_initialized()


class RewriteWorker:
    """The parent's end of the pipe, and which groups the child rewrites."""

    def __init__(self, estimator, members: dict[tuple, list[Layout]]):
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(estimator, child, members),
                                   daemon=True)
        self.process.start()
        child.close()
        self.alive = True

    def result(self, kind: str, layout: Layout) -> tuple[str, Any]:
        """("ok", data) | ("error", message) | ("local", None): `kind` "entry"
        (Estimator.export_entry) or "layers" (Estimator.layer_rows) of `layout`."""
        try:
            self.conn.send((kind, layout))
            return self.conn.recv()
        except (EOFError, OSError):
            self.alive = False
            return "local", None

    def close(self) -> None:
        if self.alive:
            try:
                self.conn.send(None)
            except OSError:
                pass
        self.alive = False
        self.process.join(timeout=1)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _serve(estimator, conn, members: dict[tuple, list[Layout]]) -> None:
    """The child: answer each request as it comes; between them, rewrite ahead."""
    estimator.workers = {}  # the child rewrites all it is asked itself
    # HiGHS's task scheduler (the tensor-parallel integer programs) keeps worker threads
    # that a fork does not copy: a solve in the child would wait on them forever
    highspy.Highs.resetGlobalScheduler(False)
    ahead = [layout for group in members.values() for layout in _firsts(group)]
    while True:
        if ahead and not conn.poll():
            _payload(estimator, "entry", ahead.pop(0))  # kept in the child's caches
            continue
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        payload = _payload(estimator, *message)
        try:
            conn.send_bytes(pickle.dumps(payload))
        except (pickle.PicklingError, TypeError, AttributeError):
            conn.send(("local", None))  # the parent rewrites what cannot be sent


def _firsts(group: list[Layout]) -> list[Layout]:
    """What the child rewrites ahead of a group: its first pipeline template and its first
    layout without one (the trace and the forward-level passes they share are the costly
    part); the others (ZeRO stages, bucket sizes) only when the parent asks."""
    first: dict[bool, Layout] = {}
    for layout in group:
        first.setdefault(layout.pp > 1, layout)
    return list(first.values())


def _payload(estimator, kind: str, layout: Layout) -> tuple[str, Any]:
    try:
        if kind == "layers":
            return "ok", estimator.layer_rows(layout)
        return "ok", estimator.export_entry(layout)
    except ValueError as exc:  # a cut or placement the model cannot take: the search's
        return "error", str(exc)
    except Exception:  # noqa: BLE001 - the parent rewrites it and raises with its traceback
        return "local", None


def child_groups(order: Sequence[tuple], bounds: Sequence[float], children: int
                 ) -> list[list[tuple]]:
    """Of the groups in the search's order (with each one's least FLOP bound), those each
    of `children` children rewrites: among those within AHEAD, round robin from the
    second (the first stays with the parent, and so do those outside AHEAD)."""
    least = min(bounds, default=0.0)
    near = [g for g, b in zip(order, bounds) if b <= least * AHEAD]
    return [near[1 + k::children] for k in range(children)]
