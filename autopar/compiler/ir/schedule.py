"""Pipeline schedules as a small IR: a list of actions per rank, with a text form.

An action is `<stage><kind><microbatch>`:

    F   forward                       SF  send activation to stage+1
    B   backward (input + weights)    RF  receive activation from stage-1
    I   backward, input gradient      SB  send gradient to stage-1
    W   backward, weight gradient     RB  receive gradient from stage+1

so `0F0 0SF0 0F1 0SF1 0RB0 0B0` is rank 0 of a 2-stage pipeline. `Schedule.parse(str(s))
== s`. The runtime executes exactly these lists; `validate` checks statically that
every micro-batch is computed once per stage, that forwards precede their backwards,
and that sends and receives pair up without deadlock; `simulate` gives each rank's
timeline and idle (bubble) fraction.

Generators: `gpipe`, `one_f_one_b`, `interleaved` (virtual stages; stage s lives on
rank s % pp) and `zero_bubble` (ZB-H1: backward split into I and W, W deferred).
"""

from __future__ import annotations

import functools
import heapq
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

COMPUTE = ("F", "B", "I", "W")
COMM = ("SF", "RF", "SB", "RB")
_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|I|W)(\d+)$")


class ScheduleError(ValueError):
    """A schedule that cannot run: the message names the rank, the action and why."""


class Action(NamedTuple):
    """One entry of a rank's list. A named tuple (ordered and hashed by its fields) is
    made in half a frozen dataclass's time: the planner builds schedules of 10^5 of
    them."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text)
        if not match:
            raise ScheduleError(f"cannot parse action {text!r}: expected <stage><kind><microbatch> "
                                f"with kind in {COMPUTE + COMM}, e.g. '0F1'")
        return cls(int(match[1]), match[2], int(match[3]))


def _action(fields: tuple[int, str, int]) -> Action:
    """Action(*fields), made without NamedTuple's Python-level __new__ (a third of the time)."""
    return tuple.__new__(Action, fields)


@dataclass(frozen=True)
class Schedule:
    """Actions per rank, for `stages` pipeline stages over `microbatches` micro-batches."""

    stages: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    # rank -> {action: its index in the rank's list}: `action_index`'s memo, filled per
    # rank on first ask (send_releases asks for the peers a rank talks to, not every
    # rank). Derived from `ranks`, which never changes, so an entry never goes stale;
    # not part of the schedule's value (equality, hash, repr)
    _action_index: dict[int, dict[Action, int]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    @property
    def pp(self) -> int:
        return len(self.ranks)

    def action_index(self, rank: int) -> dict[Action, int]:
        """{action: its index in `rank`'s list}, made once per rank of the schedule (the
        memo's own dict: read it, never change it)."""
        index = self._action_index.get(rank)
        if index is None:
            index = self._action_index[rank] = {a: k for k, a in enumerate(self.ranks[rank])}
        return index

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    @functools.cached_property
    def _steps(self) -> tuple[tuple[tuple, ...], tuple[tuple[int, str], ...], int]:
        """`simulate`'s form of the lists, made once per schedule: per rank, each action as
        (action, index of its cost key, the send it receives or -1, the send it is or -1,
        whether it computes); the cost keys (stage, kind); how many sends there are."""
        sends: dict[tuple[int, str, int], int] = {}
        keys: dict[tuple[int, str], int] = {}
        ranks = []
        for actions in self.ranks:
            steps = []
            for a in actions:
                need = send = -1
                if a.kind == "RF" or a.kind == "RB":
                    need = sends.setdefault((a.stage - 1, "SF", a.microbatch) if a.kind == "RF"
                                            else (a.stage + 1, "SB", a.microbatch), len(sends))
                elif a.kind == "SF" or a.kind == "SB":
                    send = sends.setdefault((a.stage, a.kind, a.microbatch), len(sends))
                steps.append((a, keys.setdefault((a.stage, a.kind), len(keys)), need, send,
                              a.kind in COMPUTE))
            ranks.append(tuple(steps))
        return tuple(ranks), tuple(keys), len(sends)

    def __str__(self) -> str:
        return "\n".join(" ".join(str(a) for a in actions) for actions in self.ranks)

    @classmethod
    def parse(cls, text: str, stages: int | None = None, microbatches: int | None = None) -> Schedule:
        ranks = tuple(tuple(Action.parse(t) for t in line.split()) for line in text.strip().splitlines())
        actions = [a for r in ranks for a in r]
        stages = stages if stages is not None else 1 + max(a.stage for a in actions)
        microbatches = microbatches if microbatches is not None else 1 + max(a.microbatch for a in actions)
        return cls(stages, microbatches, ranks)


# -- generators ---------------------------------------------------------------------------

def _with_comm(stages: int, actions: list[Action]) -> tuple[Action, ...]:
    """One rank's list with the sends and receives each compute action needs, next to it."""
    make = _action  # NOTE: the planner builds 10^5 actions per deep schedule: no per-action lookups
    last = stages - 1
    full: list[Action] = []
    add = full.append
    for a in actions:
        stage, kind, microbatch = a
        if kind == "F":
            if stage > 0:
                add(make((stage, "RF", microbatch)))
            add(a)
            if stage < last:
                add(make((stage, "SF", microbatch)))
        elif kind == "B" or kind == "I":
            if stage < last:
                add(make((stage, "RB", microbatch)))
            add(a)
            if stage > 0:
                add(make((stage, "SB", microbatch)))
        else:
            add(a)
    return tuple(full)


def _gpipe_rank(pp: int, microbatches: int, r: int) -> list[Action]:
    return [_action((r, "F", i)) for i in range(microbatches)] \
        + [_action((r, "B", i)) for i in reversed(range(microbatches))]


def _one_f_one_b_rank(pp: int, microbatches: int, r: int) -> list[Action]:
    warmup = min(pp - 1 - r, microbatches)
    actions = [_action((r, "F", i)) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [_action((r, "F", warmup + i)), _action((r, "B", i))]
    actions += [_action((r, "B", i)) for i in range(microbatches - warmup, microbatches)]
    return actions


def _interleaved_rank(pp: int, microbatches: int, virtual_stages: int, r: int) -> list[Action]:
    total = microbatches * virtual_stages

    def forward(k: int) -> Action:
        chunk = (k // pp) % virtual_stages
        return _action((chunk * pp + r, "F", (k // (pp * virtual_stages)) * pp + k % pp))

    def backward(k: int) -> Action:
        chunk = virtual_stages - 1 - (k // pp) % virtual_stages
        return _action((chunk * pp + r, "B", (k // (pp * virtual_stages)) * pp + k % pp))

    warmup = min((pp - r - 1) * 2 + (virtual_stages - 1) * pp, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def _zero_bubble_rank(pp: int, microbatches: int, r: int) -> list[Action]:
    warmup = min(pp - 1 - r, microbatches)
    actions = [_action((r, "F", i)) for i in range(warmup)]
    pending_w: list[int] = []
    for i in range(microbatches - warmup):
        actions += [_action((r, "F", warmup + i)), _action((r, "I", i))]
        pending_w.append(i)
        if len(pending_w) > r:  # rank r can defer up to r weight gradients
            actions.append(_action((r, "W", pending_w.pop(0))))
    for i in range(microbatches - warmup, microbatches):
        actions.append(_action((r, "I", i)))
        pending_w.append(i)
        actions.append(_action((r, "W", pending_w.pop(0))))
    actions += [_action((r, "W", i)) for i in pending_w]
    return actions


def gpipe(pp: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (in reverse micro-batch order)."""
    return _schedule("gpipe", pp, microbatches)


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """Warm-up forwards, then alternate one forward / one backward, then drain."""
    return _schedule("1f1b", pp, microbatches)


def interleaved(pp: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B: rank r holds stages r, r+pp, ... (Megatron-LM's order).

    Micro-batches go through the rank's chunks in groups of pp; the warm-up is
    longer by (virtual_stages - 1) * pp forwards, the bubble shorter by that factor.
    """
    return _schedule("interleaved", pp, microbatches, virtual_stages)


def zero_bubble(pp: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into I (input gradient, on the critical
    path) and W (weight gradient), W postponed to fill what would be bubbles."""
    return _schedule("zero-bubble", pp, microbatches)


def _schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    _check(pp, microbatches)
    return Schedule(pp * virtual_stages, microbatches,
                    tuple(rank_actions(name, pp, microbatches, virtual_stages, r)
                          for r in range(pp)))


def rank_actions(name: str, pp: int, microbatches: int, virtual_stages: int, rank: int
                 ) -> tuple[Action, ...]:
    """`build(name, pp, microbatches, virtual_stages).ranks[rank]`, made without the other
    ranks' (the planner's memory floors replay a pipeline's end ranks alone)."""
    _check(pp, microbatches)
    if name == "interleaved":
        if microbatches % pp:
            raise ScheduleError(f"the interleaved schedule needs micro-batches ({microbatches}) "
                                f"to be a multiple of pp ({pp}); use "
                                f"{microbatches + (-microbatches) % pp}")
        return _with_comm(pp * virtual_stages,
                          _interleaved_rank(pp, microbatches, virtual_stages, rank))
    makers: dict[str, Callable[[int, int, int], list[Action]]] = {
        "gpipe": _gpipe_rank, "1f1b": _one_f_one_b_rank, "zero-bubble": _zero_bubble_rank}
    if name not in makers:
        raise ScheduleError(f"unknown schedule {name!r}; known: {sorted(makers) + ['interleaved']}")
    if virtual_stages != 1:
        raise ScheduleError(f"virtual_stages={virtual_stages} needs schedule='interleaved'")
    return _with_comm(pp, makers[name](pp, microbatches, rank))


@functools.lru_cache(maxsize=256)
def build(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule named by Layout.schedule (immutable: one object per arguments, as
    the planner asks for the same schedules for many layouts)."""
    return _schedule(name, pp, microbatches, virtual_stages)


def in_flight(name: str, pp: int, microbatches: int) -> tuple[int, ...]:
    """Per stage of a schedule without virtual stages: the most micro-batches whose
    forward it has run and whose backward it has not finished (B, or W under zero-bubble:
    the weight gradient still reads the saved inputs), at any point of its rank's list.
    1F1B runs pp - s forwards on stage s before its first backward; GPipe runs every
    forward first; ZB-H1's stage s defers up to s weight gradients after its pp - s
    warm-up forwards (tests replay the lists)."""
    _check(pp, microbatches)
    if name == "gpipe":
        return (microbatches,) * pp
    if name == "1f1b":
        return tuple(min(microbatches, pp - s) for s in range(pp))
    if name == "zero-bubble":
        return (min(microbatches, pp),) * pp
    raise ScheduleError(f"in_flight is for a schedule without virtual stages (1f1b, gpipe, "
                        f"zero-bubble), got {name!r}")


def _check(pp: int, microbatches: int) -> None:
    if pp < 1 or microbatches < 1:
        raise ScheduleError(f"pp and microbatches must be >= 1, got pp={pp}, microbatches={microbatches}")


# -- static checks and simulation ------------------------------------------------------------

DEFAULT_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass
class Timeline:
    """Start and end time of every compute action per rank, and the idle fractions."""

    spans: list[list[tuple[Action, float, float]]]  # empty lists: simulate(spans=False)
    makespan: float
    ends: tuple[float, ...] = ()  # per rank: when its last compute action ends

    def busy(self, rank: int) -> float:
        return sum(end - start for _, start, end in self.spans[rank])

    def bubble_fraction(self, rank: int) -> float:
        """Idle time / makespan on this rank."""
        return 1.0 - self.busy(rank) / self.makespan


def simulate(s: Schedule, cost: dict | None = None, spans: bool = True) -> Timeline:
    """Run the per-rank lists in order: sends are asynchronous (cost 0), a receive
    waits for its send, compute takes `cost[(stage, kind)]` or else `cost[kind]`.
    Raises ScheduleError on deadlock. `spans` False: each rank's end only (the planner
    times thousands of actions per rank and reads the spans of one plan).

    Each rank runs until a receive whose send has not happened yet; the send wakes
    it. Times do not depend on which rank runs first (an action starts at its rank's
    clock or its send's end, whichever is later), so this is one pass over the actions."""
    cost = {**DEFAULT_COST, **(cost or {})}
    ranks, keys, count = s._steps
    seconds = [cost.get(key, cost.get(key[1], 0.0)) for key in keys]
    sent: list[float | None] = [None] * count  # when each send ended
    waiting = [-1] * count  # the rank blocked on each send's receive
    clock = [0.0] * s.pp
    cursor = [0] * s.pp
    kept: list[list[tuple[Action, float, float]]] = [[] for _ in range(s.pp)]
    ends = [0.0] * s.pp
    ready = list(range(s.pp - 1, -1, -1))
    while ready:
        r = ready.pop()
        steps, k, now, mine = ranks[r], cursor[r], clock[r], kept[r]
        last = ends[r]
        while k < len(steps):
            a, key, need, send, computes = steps[k]
            if need >= 0:
                when = sent[need]
                if when is None:
                    waiting[need] = r
                    break
                if when > now:
                    now = when
            end = now + seconds[key]
            if send >= 0:
                sent[send] = end
                if waiting[send] >= 0:
                    ready.append(waiting[send])
                    waiting[send] = -1
            elif computes:
                last = end
                if spans:
                    mine.append((a, now, end))
            now = end
            k += 1
        cursor[r], clock[r], ends[r] = k, now, last
    stuck = {r: str(s.ranks[r][cursor[r]]) for r in range(s.pp) if cursor[r] < len(s.ranks[r])}
    if stuck:
        raise ScheduleError(f"deadlock: every rank waits on a receive whose send never comes "
                            f"first; blocked at {stuck}")
    return Timeline(kept, max(clock), tuple(ends))


def rank_floors(name: str, pp: int, microbatches: int, virtual_stages: int = 1,
                cost: dict | None = None) -> list[float]:
    """Per rank of `build(name, pp, microbatches, virtual_stages)`: seconds its last
    compute action cannot end before, in `simulate` with `cost`, without building it.

    Every schedule here runs, for each micro-batch, each stage's F and its B (I and W
    under zero-bubble) once, with a receive before each F but the first stage's and
    before each B or I but the last stage's (`_with_comm`; tests hold the count to the
    built lists). A rank runs its actions one after another, so it is busy for at least
    the sum of their costs (sends left out: they may come after its last compute), from
    no earlier than its first action: for rank r > 0, the receive of micro-batch 0's
    forward input, which comes once micro-batch 0 went forward through stages 0..r-1
    with their receives. Far cheaper than simulating: no waits after the first action."""
    cost = {**DEFAULT_COST, **(cost or {})}
    stages = pp * virtual_stages
    backward = ("I", "W") if name == "zero-bubble" else ("B",)

    def at(stage: int, kind: str) -> float:
        return cost.get((stage, kind), cost.get(kind, 0.0))

    busy = [0.0] * pp
    for stage in range(stages):
        kinds = ["F", *backward] + (["RF"] if stage else []) + \
            (["RB"] if stage < stages - 1 else [])
        busy[stage % pp] += microbatches * sum(at(stage, kind) for kind in kinds)
    out, fill = [], 0.0
    for r in range(pp):
        out.append(fill + busy[r])
        fill += (at(r, "RF") if r else 0.0) + at(r, "F")  # micro-batch 0 through stage r
    return out


def send_releases(s: Schedule, rank: int,
                  sends_to: Callable[[int, str], Iterable[int]],
                  receives_from: Callable[[int, str], Iterable[int]]) -> dict[int, tuple[int, ...]]:
    """When the buffers of `rank`'s sends can be let go: {index of one of its receive
    actions: indices of its send actions that every receiver has received by then}.

    `sends_to(stage, phase)` names the stages that stage's values of phase "F" or "B" go
    to, `receives_from(stage, phase)` those its receive of that phase reads from (the
    program's tables, stages on the same rank included: a value may skip stages). Ranks
    run their lists in order and a receive blocks until its data is in, so a receive
    proves what the sender had done before its send; two such proofs:

    - rank q: once this rank has received what q sent at q's action k, q is past every
      receive before k, and a send to q that q received before k is complete;
    - a micro-batch's backward: a stage's F follows its RF and precedes its B, and its SB
      follows its B (the data needs that order, in any schedule). So when stage t's
      RB(mb) is in, every stage from which backward values lead to t through stages'
      B has received its RF(mb): a forward send of mb to those stages is complete, and
      let go of there (not before: until then the micro-batch's values, the sent one
      among them, are kept anyway).

    A send neither proves stays until the end of the step. Waiting for a proven send
    returns at once. Only the schedule's order and the tables are used, so the runtime
    and the memory model let go of the same buffers at the same action."""
    position: dict[int, dict[Action, int]] = {}  # rank -> s.action_index(rank), as asked

    def index(q: int, action: tuple[int, str, int]) -> int:
        if q not in position:
            position[q] = s.action_index(q)
        return position[q][action]

    leads_to: dict[int, set[int]] = {}  # stage -> stages whose backward values reach it
    for src in range(s.stages):
        for dst in sends_to(src, "B"):
            leads_to.setdefault(dst, set()).add(src)
    for t in list(leads_to):  # closed over paths
        todo, seen = list(leads_to[t]), set(leads_to[t])
        while todo:
            for up in leads_to.get(todo.pop(), ()):
                if up not in seen:
                    seen.add(up)
                    todo.append(up)
        leads_to[t] = seen

    pp = s.pp
    # (stage, phase) -> the stages on other ranks it sends to (and whether its backward
    # proves them) or receives from, with their ranks: asked once per stage, not per
    # action (actions are looked up as plain tuples: an Action equals its fields)
    sends: dict[tuple[int, str], tuple[list[tuple[int, int]], bool]] = {}
    receives: dict[tuple[int, str], list[tuple[int, int]]] = {}
    passed: dict[int, int] = {}  # peer rank -> the last index it is known to be past
    waiting: dict[int, list[tuple[int, int]]] = {}  # peer rank -> heap of (its receive, send)
    left: dict[int, int] = {}  # unproven send -> how many of its receivers are not proven
    forward: dict[tuple[int, int], int] = {}  # (stage, mb) -> its forward send, if RB proves it
    out: dict[int, tuple[int, ...]] = {}
    for i, (stage, kind, microbatch) in enumerate(s.ranks[rank]):
        if kind == "SF" or kind == "SB":
            phase = kind[1]
            if (stage, phase) not in sends:
                dsts = [d for d in sends_to(stage, phase) if d % pp != rank]
                sends[stage, phase] = ([(d, d % pp) for d in dsts], phase == "F" and bool(dsts)
                                       and set(dsts) <= leads_to.get(stage, set()))
            dsts, proven = sends[stage, phase]
            if not dsts:
                continue
            if proven:
                # proven by the micro-batch's backward, before its environment (which
                # holds what was sent) is dropped: no need to watch the receivers
                forward[stage, microbatch] = i
                left[i] = 1
                continue
            receive = "R" + phase
            need: dict[int, int] = {}
            for dst, q in dsts:
                need[q] = max(need.get(q, -1), index(q, (dst, receive, microbatch)))
            for q, k in need.items():
                heapq.heappush(waiting.setdefault(q, []), (k, i))
            left[i] = len(need)
        elif kind == "RF" or kind == "RB":
            phase = kind[1]
            if (stage, phase) not in receives:
                receives[stage, phase] = [(src, src % pp) for src in receives_from(stage, phase)
                                          if src % pp != rank]
            send = "S" + phase
            done = []
            for src, q in receives[stage, phase]:
                passed[q] = max(passed.get(q, -1), index(q, (src, send, microbatch)))
                heap = waiting.get(q, [])
                while heap and heap[0][0] < passed[q]:
                    j = heapq.heappop(heap)[1]
                    if j in left:
                        left[j] -= 1
                        if not left[j]:
                            del left[j]
                            done.append(j)
            if phase == "B" and forward.get((stage, microbatch), -1) in left:
                j = forward.pop((stage, microbatch))
                del left[j]
                done.append(j)
            if done:
                out[i] = tuple(sorted(done))
    return out


def validate(s: Schedule) -> None:
    """Raise ScheduleError unless the schedule can run and computes the full step."""
    for r, actions in enumerate(s.ranks):
        for a in actions:
            if not 0 <= a.stage < s.stages or s.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r}: {a} names stage {a.stage}, which lives on rank "
                                    f"{s.rank_of(a.stage) if 0 <= a.stage < s.stages else 'none'}")
            if not 0 <= a.microbatch < s.microbatches:
                raise ScheduleError(f"rank {r}: {a} names micro-batch {a.microbatch} of {s.microbatches}")
        _check_each_once(r, actions, s)
        _check_order(r, actions)
    _check_pairs(s)
    simulate(s)


def _check_each_once(r: int, actions: Iterable[Action], s: Schedule) -> None:
    seen: dict[Action, int] = {}
    for a in actions:
        seen[a] = seen.get(a, 0) + 1
    for a, n in seen.items():
        if n > 1:
            raise ScheduleError(f"rank {r}: {a} appears {n} times")
    for stage in range(r, s.stages, s.pp):
        for i in range(s.microbatches):
            if Action(stage, "F", i) not in seen:
                raise ScheduleError(f"rank {r}: no forward {Action(stage, 'F', i)}")
            split = Action(stage, "I", i) in seen or Action(stage, "W", i) in seen
            needed = ("I", "W") if split else ("B",)
            for kind in needed:
                if Action(stage, kind, i) not in seen:
                    raise ScheduleError(f"rank {r}: no {kind} for stage {stage}, micro-batch {i}")


def _check_order(r: int, actions: list[Action]) -> None:
    position = {a: k for k, a in enumerate(actions)}
    for a in actions:
        before = {"B": "F", "I": "F", "W": "I"}.get(a.kind)
        if before and position.get(Action(a.stage, before, a.microbatch), len(actions)) > position[a]:
            raise ScheduleError(f"rank {r}: {a} comes before {a.stage}{before}{a.microbatch}")


_PEER = {"RF": ("SF", -1), "SF": ("RF", 1), "RB": ("SB", 1), "SB": ("RB", -1)}


def _check_pairs(s: Schedule) -> None:
    """Every receive has its send on the neighbouring stage's rank, and every send its receive."""
    present = {(r, a) for r, actions in enumerate(s.ranks) for a in actions}
    for r, actions in enumerate(s.ranks):
        for a in actions:
            if a.kind not in _PEER:
                continue
            kind, step = _PEER[a.kind]
            peer_stage = a.stage + step
            peer = Action(peer_stage, kind, a.microbatch)
            if not 0 <= peer_stage < s.stages or (s.rank_of(peer_stage), peer) not in present:
                raise ScheduleError(f"rank {r}: {a} has no matching {peer} on rank "
                                    f"{s.rank_of(peer_stage) if 0 <= peer_stage < s.stages else 'none'}")
