"""Planning with worker processes (planner/workers.py): the forked workers rewrite their
groups' layouts, the parent costs them, and every prediction, the plan and the search's
record are what one process computes; a worker's refusal reaches the search as its own
would, and a dead worker's layouts are rewritten in the parent."""

from __future__ import annotations

import logging
import time

import pytest

import autopar
from autopar.compiler.planner import search as S
from autopar.compiler.planner.estimate import Estimator
from autopar.compiler.planner.rewrites import Rewrites
from autopar.compiler.planner.workers import CHILD, PARENT, PENDING, available
from autopar.examples import causal_lm_loss
from tests.unit.test_cost_model import meta_gpt2

logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

pytestmark = pytest.mark.skipif(not available(), reason="workers fork: Linux only")

CLUSTER = autopar.ClusterSpec.preset("dgx-h100")


@pytest.fixture(scope="module")
def gpt8():
    return meta_gpt2(layers=8, hidden=256, heads=8, vocab=1000, batch=16, seq=64)


@pytest.mark.slow
def test_a_plan_with_workers_is_the_plan_without(gpt8):
    model, batch = gpt8
    alone = autopar.plan(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2, workers=0,
                         amp="bf16")
    shared = autopar.plan(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2, workers=2,
                          amp="bf16")
    assert (shared.layout, shared.predicted) == (alone.layout, alone.predicted)
    assert shared.alternatives == alone.alternatives
    # the same layouts are skipped for the same kind of reason; the bound a reason quotes
    # (and which bound ruled a layout out) depends on the templates the process knew when
    # it skipped, and a worker's rewrites arrive at other times than the parent's own
    assert [lay for lay, _ in shared.skipped] == [lay for lay, _ in alone.skipped]
    assert [why.split(":")[0] for _, why in shared.skipped] == [
        why.split(":")[0] for _, why in alone.skipped]
    for key in ("layers", "tp_placements", "timeline"):
        assert shared.details[key] == alone.details[key]
    # which skips a bound made and which a pipeline floor made follows the same timing,
    # and so do the templates rewritten to know them; the skips together are the same
    timed = ("seconds", "rewrites", "bounded", "floored")
    assert {k: v for k, v in shared.details["search"].items() if k not in timed} == \
        {k: v for k, v in alone.details["search"].items() if k not in timed}
    assert sum(shared.details["search"][k] for k in timed[2:]) == sum(
        alone.details["search"][k] for k in timed[2:])


def test_workers_rewrite_their_groups_and_the_parent_only_costs(gpt8, monkeypatch):
    model, batch = gpt8
    candidates = S.candidate_layouts(CLUSTER, 16, 8, {"amp": "bf16"})
    unpipelined = [lay for lay in candidates if lay.pp == 1 and lay.tp <= 4 and lay.zero in (0, 3)]
    alone = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    est.start_workers(2, unpipelined, lambda lay: 1.0)  # every group near the least bound
    try:
        workers = set(est.workers.by_group.values())
        assert len(workers) == 2 and all(w.process.is_alive() for w in workers)
        mine = [lay for lay in unpipelined if est.group_of(lay) not in est.workers.by_group]
        theirs = [lay for lay in unpipelined if est.group_of(lay) in est.workers.by_group]
        assert mine and theirs
        rewrites = []  # what the parent rewrites from here on (the workers forked before)
        monkeypatch.setattr(Rewrites, "run_passes", _recording(Rewrites.run_passes,
                                                               rewrites, est.rewrites))
        for lay in unpipelined:
            assert est.predict(lay) == alone.predict(lay), lay
        # the parent rewrote its own groups and those it took back before a worker
        # started them (RewriteWorker.take_back), never one a worker rewrote
        taken = {g for w in workers for g, k in w.slots.items() if w.claims[k] == PARENT}
        by_child = {g for w in workers for g, k in w.slots.items() if w.claims[k] == CHILD}
        assert by_child and rewrites
        assert {est.group_of(lay) for lay in rewrites} <= {
            est.group_of(lay) for lay in mine} | taken
        assert est.tp_placements(theirs[-1]) == alone.tp_placements(theirs[-1])
        assert est.layer_rows(theirs[0]) == alone.layer_rows(theirs[0])
    finally:
        est.close_workers()
    assert not any(w.process.is_alive() for w in workers)


def test_a_group_no_worker_has_started_is_taken_back_and_rewritten_here(gpt8):
    from autopar.compiler.planner.workers import RewriteWorker

    model, batch = gpt8
    candidates = S.candidate_layouts(CLUSTER, 16, 8, {"amp": "bf16"})
    unpipelined = [lay for lay in candidates if lay.pp == 1 and lay.zero == 0]
    alone = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    groups = list(dict.fromkeys(est.group_of(lay) for lay in unpipelined))
    assert len(groups) > 2
    worker = RewriteWorker(est, [], groups[1:])  # nothing ahead: it starts none of them
    est.workers.by_group = dict.fromkeys(groups[1:], worker)
    try:
        assert all(worker.claims[k] == PENDING for k in worker.slots.values())
        for lay in unpipelined:
            assert est.predict(lay) == alone.predict(lay), lay
        assert not est.workers.by_group
        assert all(worker.claims[k] == PARENT for k in worker.slots.values())
    finally:
        worker.close()
    assert not worker.process.is_alive()


def test_a_workers_refusal_is_the_searchs_and_a_dead_workers_layouts_come_home(
        gpt8, monkeypatch):
    model, batch = gpt8
    candidates = S.candidate_layouts(CLUSTER, 16, 8, {"amp": "bf16"})
    unpipelined = [lay for lay in candidates if lay.pp == 1 and lay.microbatches == 1]
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    original = Rewrites.run_passes

    def refuse(self, traced, trace_key, layout, options):
        if layout.zero == 1:
            raise ValueError(f"no placement for {layout}")
        return original(self, traced, trace_key, layout, options)

    monkeypatch.setattr(Rewrites, "run_passes", refuse)  # the workers fork with it
    est.start_workers(1, unpipelined, lambda lay: 1.0)  # every group near the least bound
    try:
        theirs = [lay for lay in unpipelined if est.group_of(lay) in est.workers.by_group]
        refused = next(lay for lay in theirs if lay.zero == 1)
        worker = est.workers.by_group[est.group_of(refused)]
        _wait_for_child(worker, est.group_of(refused))  # else the parent takes it back
        with pytest.raises(ValueError, match="no placement for"):
            est.predict(refused)
        worker.process.kill()
        worker.process.join()
        fine = next(lay for lay in theirs if lay.zero == 2)
        alone = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
        assert est.predict(fine) == alone.predict(fine)
        assert not worker.alive
    finally:
        est.close_workers()


def test_workers_are_refused_without_trace_blocks():
    model, batch = meta_gpt2(layers=2, hidden=64, heads=4, vocab=100, batch=8, seq=16)
    with pytest.raises(ValueError, match="workers needs per-block tracing"):
        autopar.plan(model, CLUSTER, batch, causal_lm_loss, workers=1)
    with pytest.raises(ValueError, match="workers must be a count"):
        autopar.plan(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2, workers=-1)


def _wait_for_child(worker, group, seconds: float = 300.0) -> None:
    """Until the child has started rewriting `group` (it claims its groups in order)."""
    deadline = time.monotonic() + seconds
    while worker.claims[worker.slots[group]] == PENDING and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.claims[worker.slots[group]] == CHILD


def _recording(run, out, mine):
    def wrapped(self, traced, trace_key, layout, options):
        if self is mine:
            out.append(layout)
        return run(self, traced, trace_key, layout, options)
    return wrapped


def test_the_rewrites_asked_put_each_pipelines_widest_template_before_it():
    from autopar.compiler.planner.plan import rewrites_asked, widest_templates

    narrow = autopar.Layout(dp=2, pp=4, microbatches=8)  # micro-batch of 1/16 of the batch
    wide = autopar.Layout(dp=1, pp=4, microbatches=4, schedule="zero-bubble")  # 1/4: widest
    accumulated = autopar.Layout(dp=8, microbatches=2)  # per block, as a flat step: sent
    flat = autopar.Layout(dp=8)
    order = [narrow, flat, accumulated, wide]
    asked = rewrites_asked(order, widest_templates(order))
    assert asked == [wide, narrow, flat, accumulated]


def test_children_get_every_trace_but_the_first_and_rewrite_its_firsts_ahead():
    from autopar.compiler.planner.workers import child_groups, firsts

    # groups are (trace, what the re-tracing passes read): a group goes with its trace
    groups = [("t1", 1), ("t2", 2), ("t3", 1), ("t2", 4), ("t4", 1), ("t5", 1), ("t1", 2)]
    bounds = [1.0, 1.1, 9.0, 9.0, 1.2, 1.4, 9.0]
    # the near traces (bound within AHEAD of the least) round robin from the second, then
    # the far ones (t3); ("t2", 4) is far too, but goes with its trace; last, the groups
    # of the parent's trace but its first
    assert child_groups(groups, bounds, 1) == \
        [[("t2", 2), ("t3", 1), ("t2", 4), ("t4", 1), ("t5", 1), ("t1", 2)]]
    assert child_groups(groups, bounds, 2) == \
        [[("t2", 2), ("t2", 4), ("t5", 1), ("t1", 2)], [("t3", 1), ("t4", 1)]]
    assert child_groups([("t1", 1)], [1.0], 1) == [[]]  # one group: the parent's
    template = autopar.Layout(dp=2, pp=4, microbatches=4)
    flat, zero1 = autopar.Layout(dp=8), autopar.Layout(dp=8, zero=1)
    later = autopar.Layout(dp=2, pp=4, microbatches=4, schedule="gpipe")
    other = autopar.Layout(dp=4, tp=2)
    group_of = lambda lay: lay.tp  # noqa: E731 - the groups of this test: by tp
    assert firsts([flat, template, zero1, other, later], group_of) == [flat, template, other]
    # recomputation's variants share the group's costly part: each is rewritten ahead too
    full = template.replace(recompute="full")
    assert firsts([flat, template, full, zero1.replace(recompute="full")], group_of) == \
        [flat, template, full, zero1.replace(recompute="full")]


def test_a_group_retraces_once_for_every_dp_pp_and_recomputation(gpt8, monkeypatch):
    """Tensor parallelism's solve and AMP's re-trace read tp, sequence parallelism and
    AMP only (given a cluster): two pipelines of one micro-batch size that differ in dp,
    pp and recomputation are one group, and their templates (two stages each, of 8 and
    4 devices) share one re-trace; each prediction is what an Estimator of its own
    computes."""
    from autopar.compiler.ir import trace as T

    model, batch = gpt8
    a = autopar.Layout(dp=2, tp=2, pp=2, microbatches=2, amp="bf16")
    b = autopar.Layout(dp=1, tp=2, pp=4, microbatches=4, amp="bf16", recompute="full")
    fresh = [Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2).predict(lay)
             for lay in (a, b)]
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    assert est.group_of(a) == est.group_of(b)
    retraces = []
    original = T._trace_from
    monkeypatch.setattr(T, "_trace_from", lambda source: retraces.append(1) or original(source))
    assert [est.predict(lay) for lay in (a, b)] == fresh
    assert len(retraces) == 2  # the micro-batch's trace, and one re-trace for both


def test_what_a_child_rewrote_ahead_is_taken_without_asking(gpt8, monkeypatch):
    from autopar.compiler.planner.workers import RewriteWorker

    model, batch = gpt8
    candidates = S.candidate_layouts(CLUSTER, 16, 8, {"amp": "bf16"})
    flat = [lay for lay in candidates if lay.pp == 1 and lay.microbatches == 1 and lay.zero == 0]
    alone = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    groups = list(dict.fromkeys(est.group_of(lay) for lay in flat))[:2]
    ahead = [next(lay for lay in flat if est.group_of(lay) == g) for g in groups]
    worker = RewriteWorker(est, ahead, groups)
    est.workers.by_group = dict.fromkeys(groups, worker)
    try:
        deadline = time.monotonic() + 300
        while len(worker.ready) < len(ahead) and time.monotonic() < deadline:
            worker.collect()
            time.sleep(0.02)
        assert len(worker.ready) == len(ahead)  # sent as each was done
        asked = []
        monkeypatch.setattr(worker, "result", lambda kind, lay, *rest: asked.append(lay))
        for lay in ahead:
            assert est.predict(lay) == alone.predict(lay), lay
        assert not asked and not worker.ready
    finally:
        worker.close()


def _slow_first_group(gpt8, monkeypatch):
    """(the unpipelined layouts without ZeRO or micro-batches, an Estimator alone, one to
    fork, the first two groups, the Rewrites.run_passes in place): rewriting the first
    group sleeps 3 s, long enough for the parent to ask while the child is at it."""
    model, batch = gpt8
    candidates = S.candidate_layouts(CLUSTER, 16, 8, {"amp": "bf16"})
    flat = [lay for lay in candidates if lay.pp == 1 and lay.microbatches == 1 and lay.zero == 0]
    alone = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    groups = list(dict.fromkeys(est.group_of(lay) for lay in flat))[:2]
    original = Rewrites.run_passes

    def slow_child(self, traced, trace_key, layout, options):
        if self.group_of(layout) == groups[0]:  # only the child rewrites it
            time.sleep(3)
        return original(self, traced, trace_key, layout, options)

    monkeypatch.setattr(Rewrites, "run_passes", slow_child)  # the child forks with it
    return flat, alone, est, groups, slow_child


def test_the_parent_rewrites_a_group_the_child_has_not_started_instead_of_waiting(
        gpt8, monkeypatch):
    from autopar.compiler.planner.workers import RewriteWorker

    flat, alone, est, (slow, later), slow_child = _slow_first_group(gpt8, monkeypatch)
    first = next(lay for lay in flat if est.group_of(lay) == slow)
    second = next(lay for lay in flat if est.group_of(lay) == later)
    worker = RewriteWorker(est, [first, second], [slow, later])
    est.workers.by_group = dict.fromkeys([slow, later], worker)
    try:
        _wait_for_child(worker, slow)
        assert est.predict(first) == alone.predict(first)
        # while the child was at `slow`, the parent took `later` and rewrote it itself
        assert worker.claims[worker.slots[later]] == PARENT
        assert later not in est.workers.by_group
        assert est.predict(second) == alone.predict(second)
    finally:
        worker.close()


@pytest.mark.parametrize("fails", [False, True])
def test_while_the_child_answers_the_parent_rewrites_its_own_groups_ahead(
        gpt8, monkeypatch, fails):
    """Kept aside until the search asks; a rewrite ahead that fails is left for the
    search to meet when it asks for that layout."""
    from autopar.compiler.planner.workers import RewriteWorker

    flat, alone, est, (slow, own), slow_child = _slow_first_group(gpt8, monkeypatch)
    if fails:
        def refuse(self, layout):
            raise RuntimeError("not now")
        monkeypatch.setattr(Rewrites, "rewrite_aside", refuse)
    first = next(lay for lay in flat if est.group_of(lay) == slow)
    mine = next(lay for lay in flat if est.group_of(lay) == own)
    worker = RewriteWorker(est, [first], [slow])
    est.workers.by_group = {slow: worker}
    est.workers.ahead = [mine]  # the parent's own group, not yet asked for
    parent = []
    monkeypatch.setattr(Rewrites, "run_passes", _recording(slow_child, parent, est.rewrites))
    try:
        _wait_for_child(worker, slow)
        assert est.predict(first) == alone.predict(first)
        # asking for `first` (the child's, still at it), the parent rewrote `mine`
        # meanwhile, and keeps it aside: the search has not asked for it
        key = est.rewrites.key(mine)
        assert not est.workers.ahead and key not in est.rewrites
        assert worker.claims[worker.slots[slow]] == CHILD
        if fails:
            assert parent == [] and not est.workers.aside
            assert est.predict(mine) == alone.predict(mine)  # rewritten when asked
        else:
            assert parent == [mine] and key in est.workers.aside
            assert est.predict(mine) == alone.predict(mine)
        assert parent == [mine] and not est.workers.aside  # taken, not rewritten again
    finally:
        worker.close()


def test_the_parent_steals_first_a_group_whose_trace_it_has(gpt8, monkeypatch):
    """Of the groups the child has not started, the parent takes back first one whose
    trace it holds (a trace is a third of a group's rewrite), else the child's next."""
    from autopar.compiler.planner.workers import RewriteWorker

    model, batch = gpt8
    candidates = S.candidate_layouts(CLUSTER, 16, 8, {"amp": "bf16"})
    flat = [lay for lay in candidates if lay.pp == 1 and lay.microbatches == 1 and lay.zero == 0]
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    groups = list(dict.fromkeys(est.group_of(lay) for lay in flat))[:4]
    assert len({g[0] for g in groups}) == 4  # four micro-batch sizes: four traces
    original = Rewrites.run_passes

    def slow_child(self, traced, trace_key, layout, options):
        if self.group_of(layout) == groups[0]:
            time.sleep(3)  # the child stays at the first group while the parent steals
        return original(self, traced, trace_key, layout, options)

    monkeypatch.setattr(Rewrites, "run_passes", slow_child)
    ahead = [next(lay for lay in flat if est.group_of(lay) == g) for g in groups]
    worker = RewriteWorker(est, ahead, groups)
    try:
        _wait_for_child(worker, groups[0])
        assert worker.steal(lambda group: group == groups[3]) == (groups[3], ahead[3])
        assert worker.steal(lambda group: False) == (groups[1], ahead[1])
        assert [g for g, _ in worker.ahead] == [groups[0], groups[2]]
        assert worker.claims[worker.slots[groups[3]]] == PARENT
    finally:
        worker.close()


def test_a_group_whose_trace_the_child_made_is_asked_of_it_not_traced_again(gpt8, monkeypatch):
    """Two groups of one trace (the same micro-batch, tp 2 and 4): while the child is at
    the first, the parent neither steals nor takes back the second (it would trace the
    micro-batch again, which the child has); it leaves it with the child and asks."""
    from autopar.compiler.planner.traces import Traces
    from autopar.compiler.planner.workers import RewriteWorker

    model, batch = gpt8
    first, second = autopar.Layout(dp=4, tp=2, amp="bf16"), \
        autopar.Layout(dp=2, tp=4, microbatches=2, amp="bf16")
    alone = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    slow, other = est.group_of(first), est.group_of(second)
    assert slow != other and slow[0] == other[0]  # one trace, two groups
    original = Rewrites.run_passes

    def slow_child(self, traced, trace_key, layout, options):
        if self.group_of(layout) == slow:  # the child is at it while the parent asks
            time.sleep(3)
        return original(self, traced, trace_key, layout, options)

    monkeypatch.setattr(Rewrites, "run_passes", slow_child)
    worker = RewriteWorker(est, [first, second], [slow, other])
    est.workers.by_group = dict.fromkeys([slow, other], worker)
    traced = []  # the traces the parent makes from here on (the child forked before)
    made = Traces._trace
    monkeypatch.setattr(Traces, "_trace", lambda self, layout, key: (
        self is est.traces and traced.append(key), made(self, layout, key))[1])
    try:
        _wait_for_child(worker, slow)
        assert worker.made_trace(slow[0])
        assert worker.steal(lambda group: False) is None
        assert est.predict(second) == alone.predict(second)
        assert worker.claims[worker.slots[other]] == CHILD and other in est.workers.by_group
        assert traced == []
    finally:
        worker.close()


def test_a_group_taken_back_takes_the_unstarted_groups_of_its_trace_with_it(gpt8):
    """The parent traces what it takes back; the child would trace it again for another
    group of the same trace, so those come back too. A group of another trace stays."""
    from autopar.compiler.planner.workers import RewriteWorker

    model, batch = gpt8
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    taken, sibling, other = (est.group_of(lay) for lay in (
        autopar.Layout(dp=4, tp=2, amp="bf16"),
        autopar.Layout(dp=2, tp=4, microbatches=2, amp="bf16"),  # the same micro-batch
        autopar.Layout(dp=8, amp="bf16")))
    assert taken[0] == sibling[0] != other[0]
    worker = RewriteWorker(est, [], [taken, sibling, other])  # nothing ahead: none started
    try:
        assert worker.take_back(taken)
        assert [worker.claims[worker.slots[g]] for g in (taken, sibling, other)] == \
            [PARENT, PARENT, PENDING]
    finally:
        worker.close()


def test_a_group_of_a_trace_the_parent_holds_is_taken_back_alone(gpt8):
    """A child is also given the groups of the parent's own trace (its other tp), last:
    when the parent needs one it has not started, the parent takes back that one only
    and leaves the others to the child, which traces the micro-batch once for them."""
    from autopar.compiler.planner.workers import RewriteWorker, child_groups

    model, batch = gpt8
    est = Estimator(model, CLUSTER, batch, causal_lm_loss, trace_blocks=2)
    first, taken, sibling = (est.group_of(lay) for lay in (
        autopar.Layout(dp=8, amp="bf16"), autopar.Layout(dp=4, tp=2, microbatches=2, amp="bf16"),
        autopar.Layout(dp=2, tp=4, microbatches=4, amp="bf16")))  # one micro-batch size
    assert first[0] == taken[0] == sibling[0] and len({first, taken, sibling}) == 3
    assert child_groups([first, taken, sibling], [1.0, 1.0, 1.0], 1) == [[taken, sibling]]
    worker = RewriteWorker(est, [], [taken, sibling])  # nothing ahead: none started
    try:
        assert worker.take_back(taken, siblings=False)
        assert [worker.claims[worker.slots[g]] for g in (taken, sibling)] == [PARENT, PENDING]
    finally:
        worker.close()
