"""Pipeline schedule IR: golden action lists, text round trip, static checks, bubbles."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.compiler.ir.schedule import (Action, Schedule, ScheduleError, build, gpipe, interleaved,
                                      one_f_one_b, rank_floors, send_releases, simulate,
                                      validate, zero_bubble)

GOLDEN_1F1B_2x4 = """\
0F0 0SF0 0F1 0SF1 0RB0 0B0 0F2 0SF2 0RB1 0B1 0F3 0SF3 0RB2 0B2 0RB3 0B3
1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1RF2 1F2 1B2 1SB2 1RF3 1F3 1B3 1SB3"""

GOLDEN_GPIPE_2x2 = """\
0F0 0SF0 0F1 0SF1 0RB1 0B1 0RB0 0B0
1RF0 1F0 1RF1 1F1 1B1 1SB1 1B0 1SB0"""

GOLDEN_INTERLEAVED_2x2x2 = """\
0F0 0SF0 0F1 0SF1 2RF0 2F0 2SF0 2RF1 2F1 2SF1 2RB0 2B0 2SB0 2RB1 2B1 2SB1 0RB0 0B0 0RB1 0B1
1RF0 1F0 1SF0 1RF1 1F1 1SF1 3RF0 3F0 3B0 3SB0 3RF1 3F1 3B1 3SB1 1RB0 1B0 1SB0 1RB1 1B1 1SB1"""

GOLDEN_ZB_2x3 = """\
0F0 0SF0 0F1 0SF1 0RB0 0I0 0W0 0F2 0SF2 0RB1 0I1 0W1 0RB2 0I2 0W2
1RF0 1F0 1I0 1SB0 1RF1 1F1 1I1 1SB1 1W0 1RF2 1F2 1I2 1SB2 1W1 1W2"""


@pytest.mark.parametrize("schedule, golden", [
    (one_f_one_b(2, 4), GOLDEN_1F1B_2x4),
    (gpipe(2, 2), GOLDEN_GPIPE_2x2),
    (interleaved(2, 2, 2), GOLDEN_INTERLEAVED_2x2x2),
    (zero_bubble(2, 3), GOLDEN_ZB_2x3),
], ids=["1f1b", "gpipe", "interleaved", "zero-bubble"])
def test_golden_action_lists(schedule, golden):
    assert str(schedule) == golden
    validate(schedule)


def schedules():
    return st.tuples(st.sampled_from(["gpipe", "1f1b", "interleaved", "zero-bubble"]),
                     st.integers(1, 5), st.integers(1, 4), st.integers(1, 3))


def make(name, pp, k, v):
    if name == "interleaved":
        return interleaved(pp, pp * k, v)
    return build(name, pp, pp * k - (k > 1))  # also micro-batch counts that are not multiples


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_every_schedule_is_valid_and_round_trips(args):
    s = make(*args)
    validate(s)  # each micro-batch once per stage, F before B, sends pair with receives, no deadlock
    assert Schedule.parse(str(s), s.stages, s.microbatches) == s


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_forward_precedes_backward_on_each_rank(args):
    s = make(*args)
    for actions in s.ranks:
        order = {a: i for i, a in enumerate(actions)}
        for a in actions:
            if a.kind in ("B", "I"):
                assert order[Action(a.stage, "F", a.microbatch)] < order[a]


@settings(max_examples=60, deadline=None)
@given(schedules(), st.lists(st.floats(0.1, 3.0), min_size=6, max_size=6))
def test_a_simulation_without_spans_ends_each_rank_where_its_spans_end(args, times):
    """simulate(spans=False), as the planner times schedules: no span kept, each rank's
    end and the makespan the same as with them."""
    s = make(*args)
    cost = dict(zip(["F", "B", "I", "W", "RF", "RB"], times))
    full, bare = simulate(s, cost), simulate(s, cost, spans=False)
    assert bare.makespan == full.makespan and not any(bare.spans)
    assert bare.ends == tuple(max(end for _, _, end in spans) for spans in full.spans)
    assert full.ends == bare.ends


@pytest.mark.parametrize("maker", [gpipe, one_f_one_b])
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (3, 5)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(maker, pp, m):
    timeline = simulate(maker(pp, m), {"F": 1.0, "B": 2.0})
    for r in range(pp):
        assert timeline.bubble_fraction(r) == pytest.approx((pp - 1) / (m + pp - 1))
        idle = timeline.makespan - timeline.busy(r)
        assert idle / timeline.busy(r) == pytest.approx((pp - 1) / m)


@pytest.mark.parametrize("pp, m", [(2, 8), (4, 8), (4, 16)])
def test_interleaving_and_zero_bubble_shrink_the_bubble(pp, m):
    base = simulate(one_f_one_b(pp, m), {"F": 1.0, "B": 2.0}).bubble_fraction(0)
    # two virtual stages per rank: each chunk costs half
    inter = simulate(interleaved(pp, m, 2), {"F": 0.5, "B": 1.0}).bubble_fraction(0)
    assert inter == pytest.approx(((pp - 1) / 2) / (m + (pp - 1) / 2))
    zb = simulate(zero_bubble(pp, m), {"F": 1.0, "I": 1.0, "W": 1.0})
    assert max(zb.bubble_fraction(r) for r in range(pp)) < inter < base


def test_static_checks_name_the_problem():
    with pytest.raises(ScheduleError, match="rank 1: 1RF1 has no matching 0SF1 on rank 0"):
        validate(Schedule.parse("0F0 0SF0 0F1 0RB0 0B0 0RB1 0B1\n"
                                "1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1", 2, 2))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(Schedule.parse("0RB0 0F0 0SF0 0B0\n1RF0 1F0 1B0 1SB0", 2, 1))
    with pytest.raises(ScheduleError, match="0B0 comes before 0F0"):
        validate(Schedule.parse("0B0 0F0", 1, 1))
    with pytest.raises(ScheduleError, match="no forward 0F1"):
        validate(Schedule.parse("0F0 0B0 0B1", 1, 2))
    with pytest.raises(ScheduleError, match="cannot parse action '0X1'"):
        Schedule.parse("0X1")
    with pytest.raises(ScheduleError, match="multiple of pp"):
        interleaved(2, 3, 2)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build("2f2b", 2, 4)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "zero-bubble", "interleaved"]),
       st.integers(1, 5), st.integers(1, 3), st.integers(1, 3), st.randoms(use_true_random=False))
def test_rank_floors_count_the_built_actions_and_stay_below_the_simulation(
        name, pp, rounds, virtual, rng):
    """rank_floors works without building the schedule: each rank's busy time is the sum
    over the built lists' actions (sends left out) and rank r > 0 starts after
    micro-batch 0's forward through the stages before it; no simulated rank ends before."""
    virtual = virtual if name == "interleaved" else 1
    m = pp * rounds
    s = build(name, pp, m, virtual)
    cost = {(stage, kind): rng.uniform(0.0, 2.0) for stage in range(s.stages)
            for kind in ("F", "B", "I", "W", "RF", "RB", "SF", "SB")}
    floors = rank_floors(name, pp, m, virtual, cost)
    fill = 0.0
    for r, actions in enumerate(s.ranks):
        busy = sum(cost[(a.stage, a.kind)] for a in actions if a.kind not in ("SF", "SB"))
        assert r == 0 or actions[0] == Action(r, "RF", 0)
        assert floors[r] == pytest.approx(fill + busy, rel=1e-12)
        fill += (cost[(r, "RF")] if r else 0.0) + cost[(r, "F")]
    timeline = simulate(s, cost)
    for r, spans in enumerate(timeline.spans):
        assert floors[r] <= max(end for _, _, end in spans) * (1 + 1e-12)


def _tables(stages: int, kind: str | bool):
    """sends_to / receives_from of a pipeline whose stages pass values to the next (and
    gradients back); with skips, stage 0 also sends every stage a value (GPT-2's mask)
    and the last stage sends stage 0 a gradient; "detached": skips, and the last stage
    sends no gradient back (its input does not need one)."""
    to = {(s, "F"): {s + 1} for s in range(stages - 1)}
    to.update({(s, "B"): {s - 1} for s in range(1, stages)})
    if kind:
        to[0, "F"] = set(range(1, stages))
        to[stages - 1, "B"] = {stages - 2, 0}
    if kind == "detached":
        del to[stages - 1, "B"]
    sources: dict = {}
    for (s, phase), dsts in to.items():
        for d in dsts:
            sources.setdefault((d, phase), set()).add(s)
    return (lambda s, ph: sorted(to.get((s, ph), ())),
            lambda s, ph: sorted(sources.get((s, ph), ())))


def _happens_before(s: Schedule, sends_to):
    """(rank, index) -> every (rank, index) after it: the ranks' order, and each send
    before the receive of each stage it goes to. By brute force."""
    where = {(r, a): i for r, actions in enumerate(s.ranks) for i, a in enumerate(actions)}
    edges: dict = {}
    for r, actions in enumerate(s.ranks):
        for i, a in enumerate(actions):
            nxt = [(r, i + 1)] if i + 1 < len(actions) else []
            if a.kind in ("SF", "SB"):
                for d in sends_to(a.stage, a.kind[1]):
                    nxt.append((s.rank_of(d), where[s.rank_of(d), Action(d, "R" + a.kind[1],
                                                                          a.microbatch)]))
            edges[r, i] = nxt

    def after(node):
        seen, todo = set(), [node]
        while todo:
            for n in edges[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen
    return after, where


@pytest.mark.parametrize("args", [("1f1b", 3, 5, 1), ("gpipe", 3, 3, 1), ("zero-bubble", 4, 6, 1),
                                  ("interleaved", 2, 4, 2), ("1f1b", 4, 8, 1)])
@pytest.mark.parametrize("skips", [False, True, "detached"])
def test_a_send_is_let_go_of_only_once_every_receiver_has_it(args, skips):
    """send_releases against the happens-before relation by brute force: where a rank
    lets go of a send, each receive of it came before; and with values only between
    neighbours, every forward send is let go of by its micro-batch's backward."""
    s = build(*args)
    sends_to, receives_from = _tables(s.stages, skips)
    after, where = _happens_before(s, sends_to)
    for r, actions in enumerate(s.ranks):
        releases = send_releases(s, r, sends_to, receives_from)
        let_go = [j for js in releases.values() for j in js]
        assert len(let_go) == len(set(let_go))
        for i, js in releases.items():
            assert actions[i].kind in ("RF", "RB")
            for j in js:
                a = actions[j]
                assert a.kind in ("SF", "SB") and j < i
                for d in sends_to(a.stage, a.kind[1]):
                    if s.rank_of(d) != r:
                        receive = (s.rank_of(d), where[s.rank_of(d), Action(d, "R" + a.kind[1],
                                                                              a.microbatch)])
                        assert (r, i) in after(receive), (r, a, i)
        forward = [j for j, a in enumerate(actions) if a.kind == "SF"
                   and any(s.rank_of(d) != r for d in sends_to(a.stage, "F"))]
        if skips != "detached":
            assert set(forward) <= set(let_go)


@pytest.mark.parametrize("maker", [one_f_one_b, zero_bubble, gpipe])
def test_the_sends_a_rank_holds_do_not_grow_with_the_micro_batches(maker):
    """A 1F1B rank holds a few sends whatever the micro-batch count (it held all of them
    until the end of the step before); GPipe's backward sends wait for the next step."""
    def most_held(m):
        s = maker(4, m)
        sends_to, receives_from = _tables(s.stages, True)
        out = 0
        for r, actions in enumerate(s.ranks):
            releases = send_releases(s, r, sends_to, receives_from)
            held = 0
            for i, a in enumerate(actions):
                held += a.kind in ("SF", "SB") and any(
                    s.rank_of(d) != r for d in sends_to(a.stage, a.kind[1]))
                held -= len(releases.get(i, ()))
                out = max(out, held)
        return out
    if maker is gpipe:  # nothing after the backward sends proves them
        assert most_held(32) > most_held(8)
    else:
        assert most_held(32) == most_held(8) <= 8


@pytest.mark.parametrize("name,pp,microbatches,virtual", [
    ("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("1f1b", 5, 2, 1), ("zero-bubble", 4, 7, 1),
    ("interleaved", 2, 4, 2), ("interleaved", 3, 6, 3)])
def test_one_ranks_actions_are_its_list_in_the_whole_schedule(name, pp, microbatches, virtual):
    from autopar.compiler.ir.schedule import rank_actions
    whole = build(name, pp, microbatches, virtual)
    assert [rank_actions(name, pp, microbatches, virtual, r) for r in range(pp)] == \
        list(whole.ranks)
