"""Planning on two cores: a forked process rewrites graphs while the search costs.

Most of a deep model's planning time is tracing and rewriting (export, the joint trace,
the tensor-parallel and AMP re-trace, fusion), once per *group* of layouts that share a
trace and the re-tracing passes' graph (`Estimator.group_of`: the same micro-batch, tp,
sequence parallelism and AMP; every dp, pp, ZeRO stage and recomputation policy). Groups
are independent of one another, so `RewriteWorker` forks the Estimator once the search
knows the order it will ask for them in (pipeline templates included:
plan.rewrites_asked), keeps the first group's trace for the parent, which needs it at
once, and gives the children the others, by trace (below): the parent then costs
(schedules, replicated pipelines) while they rewrite. A child rewrites ahead, one at a
time, the first template and the first layout without one of each of its groups and
recomputation policies (the trace and re-traces they share are the costly part), sends
each as soon as it is done, and answers the parent's requests between them. What it
sends is what the search reads: the summaries, the pipeline template, the
tensor-parallel table and the trace's FLOPs (plain data; graphs stay in the process that
made them). The parent keeps what was sent ahead until the search asks for it
(`RewriteWorker.ready`): a child busy with its next group never keeps the parent waiting
for one it has finished. While the parent waits for a child's answer it rewrites ahead
the first layouts of its own groups (`WorkerPool.ahead`), kept aside the same way
(`WorkerPool.aside`) until the search asks for them.

The search runs unchanged in the parent, in the same order: a layout of the child's
groups is asked of the child (it rewrites it then if it has not yet), any other is
rewritten in the parent as without a worker. A group is rewritten by one process
only, so every prediction is the one a single process computes, and so is the plan.

Groups are given by trace (`child_groups`), each trace with every group of it, in the
order a child rewrites them ahead: first the traces of the groups whose FLOP bound is
within `AHEAD` of the least, then the others (fp32 once bf16 is 15x faster, say: seldom
costed), then the other groups of the parent's own trace (its other tp degrees), which
a child traces again for them: a child otherwise idle once its near groups are done
rewrites what the parent would rewrite alone late in the search. A child sends no
graph, so the parent never traces what a child has: it does not take back or steal a
group whose trace the child has made and it has not, but asks the child for it; a
group it takes back takes with it the other unstarted groups of its trace, unless the
parent holds that trace already (its own).

Only for the scaled traces of `trace_blocks` (an exact trace keeps the rewritten graph
for the memory replay, which is not sent). If the child dies, or cannot send a
result, the parent rewrites that layout itself.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import pickle
import sys
from collections.abc import Callable, Sequence
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


class WorkerPool:
    """The RewriteWorkers of one Estimator, by the groups each rewrites (`by_group`).
    Empty: the Estimator rewrites every layout itself (as a child does)."""

    def __init__(self) -> None:
        self.by_group: dict[tuple, RewriteWorker] = {}
        # the parent's own groups' `firsts`, in the search's order: what it rewrites
        # ahead while a child answers it (`_rewrite_ahead`), kept aside by rewrite key
        # until the search asks (as what a child sends ahead is)
        self.ahead: list[Layout] = []
        self.aside: dict[tuple, Any] = {}  # rewrites.ExportedEntry

    def start(self, estimator, count: int, order: Sequence[Layout],
              bound: Callable[[Layout], float]) -> None:
        """Fork `count` RewriteWorkers for the groups of `order` (the layouts in the order
        the search asks for them, `bound` their FLOP bounds) that child_groups gives
        them; each rewrites ahead, in that order, the first template and the first
        layout without one of each of its groups (`firsts`)."""
        least: dict[tuple, float] = {}  # group -> its least bound, in the search's order
        for layout in order:
            group = estimator.group_of(layout)
            least[group] = min(least.get(group, math.inf), bound(layout))
        bounds = list(least.values())
        parents = parent_trace(list(least), bounds)  # its groups come last in a child's order
        for share in child_groups(list(least), bounds, count):
            if share:
                mine = set(share)
                ahead = firsts([lay for lay in order if estimator.group_of(lay) in mine],
                               estimator.group_of)
                ahead.sort(key=lambda lay: estimator.group_of(lay)[0] == parents)
                worker = RewriteWorker(estimator, ahead, share)
                self.by_group.update(dict.fromkeys(share, worker))
        if self.by_group:
            self.ahead = firsts([lay for lay in order
                                 if estimator.group_of(lay) not in self.by_group],
                                estimator.group_of)

    def close(self) -> None:
        for worker in set(self.by_group.values()):
            worker.close()
        self.by_group = {}
        self.ahead, self.aside = [], {}

    def alive(self, group: tuple) -> RewriteWorker | None:
        """The worker that rewrites `group`, if it is alive."""
        worker = self.by_group.get(group)
        return worker if worker is not None and worker.alive else None

    def fetch(self, estimator, layout: Layout) -> tuple | None:
        """The rewrite key of `layout`'s entry, kept by `estimator`, when a worker
        rewrites its group (None: the estimator rewrites it). While the worker is busy,
        the estimator rewrites a group the worker has not started rather than wait."""
        group = estimator.group_of(layout)
        worker = self.alive(group)
        if worker is None:
            if self.aside:  # one of the parent's own, perhaps rewritten ahead
                key = estimator.rewrites.key(layout)
                if key in self.aside:
                    return estimator.adopt(layout, self.aside.pop(key))
            return None
        traces = estimator.traces
        # not started there: rewritten here rather than waited for, unless the child has
        # (or is making) its trace and this process has not: a trace costs more than a wait
        if traces.has_graph(group[0]) or not worker.made_trace(group[0]):
            if worker.take_back(group, siblings=not traces.has_graph(group[0])):
                del self.by_group[group]
                return None
        else:
            worker.leave(group)
        while True:
            worker.collect()
            if group[0] in worker.traces:  # the trace the search needs now, from the child
                traces.keep(worker.traces[group[0]])
            if group[0] in traces:
                key = estimator.rewrites.key(layout)
                if key in estimator.rewrites:
                    return key
                if key in worker.ready:
                    return estimator.adopt(layout, worker.ready.pop(key))
            stolen = worker.steal(lambda other: traces.has_graph(other[0]))
            if stolen is None:
                break
            del self.by_group[stolen[0]]
            with contextlib.suppress(ValueError):  # reported when the search asks for it
                estimator.rewrite(stolen[1])
        status, data = worker.result("entry", layout, lambda: self._rewrite_ahead(estimator))
        if status == "error":
            raise ValueError(data)
        return estimator.adopt(layout, data) if status == "ok" else None

    def _rewrite_ahead(self, estimator) -> bool:
        """Rewrite the next layout of the parent's own `ahead` not rewritten yet, while a
        child answers (both processes busy, where the parent would wait), and keep it
        aside; False when none is left. Kept aside, not in the estimator: the bounds
        the search decides by read the templates it has asked for, so a template known
        early could settle a layout by another bound and queue other variants. Work the
        search may never ask for: whatever fails here (a cut or placement the model
        cannot take, a micro-batch that does not trace) is left for the search to meet,
        and report, if it asks for that layout."""
        while self.ahead:
            layout = self.ahead.pop(0)
            try:
                key = estimator.rewrites.key(layout)
                if key in estimator.rewrites or key in self.aside:
                    continue
                self.aside[key] = estimator.rewrites.rewrite_aside(layout)
            except Exception:  # noqa: BLE001 - raised again where the search asks for it
                pass
            return True
        return False


PENDING, CHILD, PARENT = 0, 1, 2  # who rewrites a child's group (RewriteWorker.claims)
AHEAD_DONE, REPLY = "ahead", "reply"  # what the child sends: a group rewritten ahead, an answer


class RewriteWorker:
    """The parent's end of the pipe, and which groups the child rewrites.

    `claims` (shared memory, one slot per group given to the child) says who rewrites
    each: a group the child has not started yet when the parent first needs it is
    taken back (`take_back`) rather than waited for, so a slow child never holds up a
    parent that is free to rewrite it; either way one process rewrites a group."""

    def __init__(self, estimator, ahead: list[Layout], groups: Sequence[tuple]):
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.slots = {group: k for k, group in enumerate(groups)}
        self.ahead = [(estimator.group_of(layout), layout) for layout in ahead]
        self.claims = ctx.Array("b", len(groups))
        self.process = ctx.Process(target=_serve,
                                   args=(estimator, child, ahead, self.slots, self.claims),
                                   daemon=True)
        self.process.start()
        child.close()
        self.alive = True
        # sent ahead, not yet asked for: entries by their key, and the traces they came
        # from by theirs (WorkerPool.fetch adopts them when the search asks)
        self.ready: dict[tuple, Any] = {}  # rewrites.ExportedEntry
        self.traces: dict[tuple, Any] = {}  # traces.TracedEntry

    def take_back(self, group: tuple, siblings: bool = True) -> bool:
        """Whether the parent takes `group` back: the child has not started it, and now
        never will (False: the child has it, the parent asks for its results). With it
        go the other groups of its trace the child has not started (`siblings`): the
        parent makes that trace, so the child would make it a second time; not when the
        parent holds the trace already (siblings=False), where the child, idle
        otherwise, may still rewrite them. A group taken back leaves `ahead`, so that
        `steal` does not take it a second time."""
        with self.claims.get_lock():
            slot = self.slots[group]
            if self.claims[slot] == PENDING:
                for other, k in self.slots.items():
                    if (other == group or siblings) and other[0] == group[0] \
                            and self.claims[k] == PENDING:
                        self.claims[k] = PARENT
            taken = self.claims[slot] == PARENT
            mine = {g for g, k in self.slots.items() if self.claims[k] == PARENT}
        if taken:
            self.ahead = [(g, lay) for g, lay in self.ahead if g not in mine]
        return taken

    def made_trace(self, trace_key: tuple) -> bool:
        """Whether the child has started a group of the trace `trace_key`: it has that
        trace's graph, or is making it."""
        with self.claims.get_lock():
            return any(self.claims[slot] == CHILD for group, slot in self.slots.items()
                       if group[0] == trace_key)

    def leave(self, group: tuple) -> None:
        """Leave `group` with the child (it rewrites what the parent asks of it), so that a
        later `take_back` does not trace it in the parent as well."""
        with self.claims.get_lock():
            slot = self.slots[group]
            if self.claims[slot] == PENDING:
                self.claims[slot] = CHILD

    def steal(self, traced: Callable[[tuple], bool] = lambda group: False
              ) -> tuple[tuple, Layout] | None:
        """(group, its first layout rewritten ahead) of the first group in the child's
        order that it has not started, taken back: the parent rewrites it while the
        child finishes the one the parent waits for. First among those whose trace the
        parent has (`traced(group)`): a trace is a third of a group's rewrite; never one
        whose trace the child has and the parent has not. None: the child has them all."""
        for group, layout in sorted(self.ahead, key=lambda item: not traced(item[0])):
            if not traced(group) and self.made_trace(group[0]):
                continue
            if self.take_back(group, siblings=not traced(group)):
                return group, layout
        return None

    def result(self, kind: str, layout: Layout,
               meanwhile: Callable[[], bool] = lambda: False) -> tuple[str, Any]:
        """("ok", data) | ("error", message) | ("local", None): `kind` "entry"
        (Estimator.export_entry) or "layers" (Estimator.layer_rows) of `layout`.
        `meanwhile()` does a piece of the parent's own work while the child has sent
        nothing (False: none is left, so wait)."""
        try:
            self.conn.send((kind, layout))
            while True:
                if not self.conn.poll() and meanwhile():
                    continue
                tag, payload = self.conn.recv()
                if tag == REPLY:
                    return payload
                self._keep(payload)
        except (EOFError, OSError):
            self.alive = False
            return "local", None

    def collect(self) -> None:
        """Keep what the child has sent ahead since the last call (without waiting)."""
        try:
            while self.conn.poll():
                tag, payload = self.conn.recv()
                self._keep(payload)  # replies come only to `result`, which waits for them
        except (EOFError, OSError):
            self.alive = False

    def _keep(self, exported) -> None:
        """Keep a rewrites.ExportedEntry the child sent ahead, and the trace it came from."""
        self.ready[exported.key] = exported
        self.traces[exported.trace.key] = exported.trace

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


def _serve(estimator, conn, ahead: list[Layout], slots: dict, claims) -> None:
    """The child: answer each request as it comes; between them, rewrite ahead the
    groups the parent has not taken back."""
    estimator.workers = WorkerPool()  # the child rewrites all it is asked itself
    # HiGHS's task scheduler (the tensor-parallel integer programs) keeps worker threads
    # that a fork does not copy: a solve in the child would wait on them forever
    highspy.Highs.resetGlobalScheduler(False)
    ahead = list(ahead)
    while True:
        if ahead and not conn.poll():
            layout = ahead.pop(0)
            with claims.get_lock():
                slot = slots[estimator.group_of(layout)]
                if claims[slot] == PARENT:
                    continue
                claims[slot] = CHILD
            status, entry = _payload(estimator, "entry", layout)  # kept in the child too
            if status == "ok":  # an error or a failure is reported when the parent asks
                _send(conn, (AHEAD_DONE, entry))
            continue
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        payload = _payload(estimator, *message)
        if not _send(conn, (REPLY, payload)):
            conn.send((REPLY, ("local", None)))  # the parent rewrites what cannot be sent


def _send(conn, message: tuple) -> bool:
    """Whether `message` could be pickled and was sent."""
    try:
        data = pickle.dumps(message)
    except (pickle.PicklingError, TypeError, AttributeError):
        return False
    conn.send_bytes(data)
    return True


def firsts(order: Sequence[Layout], group_of) -> list[Layout]:
    """What a child rewrites ahead, in the order the search will ask: of each group and
    recomputation policy, its first pipeline template and its first layout without one
    (the trace and the re-traces they share are the costly part; a policy adds only
    recomputation and the joint-graph passes); the others (ZeRO stages, bucket sizes)
    only when the parent asks."""
    seen, out = set(), []
    for layout in order:
        key = (group_of(layout), layout.pp > 1, layout.recompute)
        if key not in seen:
            seen.add(key)
            out.append(layout)
    return out


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
    of `children` children rewrites, in the order it rewrites them ahead. A group goes
    with its trace (`group[0]`): the traces of the groups within AHEAD, in order, round
    robin from the second (the first is the parent's), then the other traces, and with
    each trace every group of it, near or not; last, the parent's trace's groups but its
    first (the parent takes back each one it needs before a child starts it). A child
    sends no graph, so a group of a trace the child made would otherwise be traced a
    second time in the parent."""
    least = min(bounds, default=0.0)
    near = list(dict.fromkeys(g[0] for g, b in zip(order, bounds) if b <= least * AHEAD))
    far = [t for t in dict.fromkeys(g[0] for g in order) if t not in near]
    owner = {trace: k % children for k, trace in enumerate(near[1:] + far)}
    shares: list[list[tuple]] = [[] for _ in range(children)]
    for group in order:
        if group[0] in owner:
            shares[owner[group[0]]].append(group)
    # then the parent's trace's other groups, last: a child done with its own traces it
    # again, rather than wait, for the ones the parent has not taken back by then
    parents = near[0] if near else None  # what parent_trace names: the first near trace
    for k, group in enumerate([g for g in order if g[0] == parents][1:]):
        shares[k % children].append(group)
    return shares


def parent_trace(order: Sequence[tuple], bounds: Sequence[float]) -> tuple | None:
    """The trace the parent keeps (`child_groups`): that of the first group in the
    search's order whose FLOP bound is within AHEAD of the least (None: no group)."""
    least = min(bounds, default=0.0)
    return next((g[0] for g, b in zip(order, bounds) if b <= least * AHEAD), None)
