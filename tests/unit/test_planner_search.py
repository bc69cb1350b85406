"""The planner's search: ranking properties on synthetic predictions (hypothesis),
the cached search against costing every candidate on its own (brute force), and
its errors."""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.cluster import ClusterSpec
from autopar import costs
from autopar.compiler.planner import search as S
from autopar.examples import gpt2
from autopar.compiler.planner.result import Prediction
from tests.cluster_util import with_fast_link
from tests.unit.test_cost_model import cluster

logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


def fake_prediction(seconds: float, memory: int) -> Prediction:
    parts = {"compute": seconds * 0.6, "exposed_comm": seconds * 0.3, "bubble": seconds * 0.1,
             "optimizer": 0.0, "comm": seconds * 0.3}
    return Prediction(seconds, 1e12, 1.0, 0.5, memory, 0.1, parts, {"activations": memory})


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1, 2), (1, 4), (2, 4), (1, 8)]), st.integers(1, 4), st.booleans(),
       st.data())
def test_the_chosen_layout_is_the_fastest_that_fits(shape, blocks, bounded, data):
    """With `bounded`, the search gets a lower bound of each step (a random fraction of
    it) and each step's time before its memory: branch and bound must not change the
    plan."""
    c = cluster(nodes=shape[0], per_node=shape[1])  # 10 GB devices
    candidates = S.candidate_layouts(c, 16, blocks, {})
    assert candidates and all(lay.world_size == c.world_size for lay in candidates)
    assert all(lay.tp <= c.devices_per_node and lay.pp <= blocks for lay in candidates)
    costs = {lay: fake_prediction(data.draw(st.floats(1e-3, 1.0)), data.draw(st.integers(1, 2 * 10**10)))
             for lay in candidates}
    below = {lay: costs[lay].step_time_s * data.draw(st.floats(0.0, 1.0)) for lay in candidates}
    held = {lay: costs[lay].peak_memory_bytes * data.draw(st.floats(0.0, 1.0))
            for lay in candidates}
    floors = {lay: costs[lay].peak_memory_bytes * data.draw(st.floats(0.0, 1.0))
              for lay in candidates}
    bound = below.__getitem__ if bounded else None
    memory_bound = held.__getitem__ if bounded else None
    memory_floor = floors.__getitem__ if bounded else None
    capacity = 0.9 * 10**10
    fitting = [lay for lay in candidates if costs[lay].peak_memory_bytes <= capacity]
    if not fitting:  # the error names the smallest peak, bounds or not
        with pytest.raises(S.PlanError, match="fits no layout|could be costed") as info:
            S.search(candidates, S.Costing(costs.__getitem__, bound=bound,
                                           memory_bound=memory_bound,
                                           memory_floor=memory_floor), c)
        with pytest.raises(S.PlanError) as unbounded:
            S.search(candidates, S.Costing(costs.__getitem__), c)
        assert str(info.value) == str(unbounded.value)
        return
    timed = (lambda lay: costs[lay].step_time_s) if bounded else None
    plan = S.search(candidates, S.Costing(costs.__getitem__, bound=bound,
                                          memory_bound=memory_bound, timed=timed,
                                          memory_floor=memory_floor), c)
    for lay, why in plan.skipped:  # not costed: slower than the plan, or cannot fit
        assert why.startswith("not costed") and bounded
        assert (costs[lay].step_time_s >= below[lay] > plan.predicted.step_time_s
                or costs[lay].peak_memory_bytes >= held[lay] > capacity
                or costs[lay].step_time_s > plan.predicted.step_time_s
                and S.TIMED_ONLY in why
                or costs[lay].peak_memory_bytes >= floors[lay] > capacity
                and S.MEMORY_FLOOR_ONLY in why)
    # brute force: the first of the fastest fitting candidates
    best = min(fitting, key=lambda lay: (costs[lay].step_time_s, candidates.index(lay)))
    assert plan.layout == best and plan.predicted.peak_memory_bytes <= capacity
    for lay, pred, why in plan.alternatives:
        assert pred.step_time_s >= plan.predicted.step_time_s or pred.peak_memory_bytes > capacity
        assert ("does not fit" in why) == (pred.peak_memory_bytes > capacity)
    seen = {lay for lay, _, _ in plan.alternatives} | {lay for lay, _ in plan.skipped}
    assert seen | {plan.layout} == set(candidates)
    assert all(reason for _, reason in plan.skipped)


def _parts(compute: float, exposed: float, memory: int) -> Prediction:
    parts = {"compute": compute, "exposed_comm": exposed, "bubble": 0.0, "optimizer": 0.0,
             "comm": exposed}
    return Prediction(compute + exposed, 1e12, 1.0, 0.5, memory, 0.0, parts,
                      {"activations": memory})


def test_recomputing_that_hides_communication_is_not_pruned_by_the_step_without_it():
    """A layout over memory whose step is slower than a fitting one, but whose selective
    recomputation moves its collectives and hides most of them (as ZeRO-3's gathers on
    the 18.4B Megatron row): skipped on its step time, it is still tried recomputing,
    because its compute floor is below the fastest fitting step; with its step as the
    floor (no `compute_floor`) the search would keep the slower plan."""
    c = cluster(nodes=1, per_node=4)  # 10 GB devices, 9 GB allowed
    fitting = autopar.Layout(dp=2, tp=2)
    hiding = autopar.Layout(dp=4, zero=3)
    table = {fitting: _parts(0.6, 0.3, 5 * 10**9),
             hiding: _parts(0.5, 0.5, 20 * 10**9),  # 1.0 s, over memory
             hiding.replace(recompute="full"): _parts(0.7, 0.4, 4 * 10**9),  # 1.1 s
             hiding.replace(recompute="selective"): _parts(0.52, 0.18, 7 * 10**9)}  # 0.7 s

    def costing(**floor):
        return S.Costing(table.__getitem__, timed=lambda lay: table[lay].step_time_s,
                         variants=S.recompute_variants({}), **floor)

    floor = {"compute_floor": lambda lay: table[lay].breakdown["compute"]}
    plan = S.search([fitting, hiding], costing(**floor), c)
    assert plan.layout == hiding.replace(recompute="selective")
    assert any(lay == hiding and S.TIMED_ONLY in why for lay, why in plan.skipped)
    assert S.search([fitting, hiding], costing(), c).layout == fitting  # the unsound floor


def test_a_full_variant_its_bound_rules_out_still_leaves_the_selective_one_to_try():
    """A layout over memory (its memory floor) is varied with full recomputation, whose
    bound is above the fastest fitting step: not tried. Selective recomputation adds less
    compute, and whether it fits is not known, so it is still tried (the 39.1B Megatron
    row: `dp=64 tp=2 pp=4` selective, 0.13% faster than the plan without it)."""
    c = cluster(nodes=1, per_node=4)  # 10 GB devices, 9 GB allowed
    fitting = autopar.Layout(dp=2, tp=2)
    over = autopar.Layout(dp=4, zero=3)
    full, selective = over.replace(recompute="full"), over.replace(recompute="selective")
    table = {fitting: (fake_prediction(1.0, 5 * 10**9), 0.5),  # (prediction, bound)
             over: (fake_prediction(0.7, 20 * 10**9), 0.6),
             full: (fake_prediction(1.3, 4 * 10**9), 1.2),  # bound above fitting's 1.0 s
             selective: (fake_prediction(0.8, 8 * 10**9), 0.75)}
    costing = S.Costing(lambda lay: table[lay][0], bound=lambda lay: table[lay][1],
                        memory_floor=lambda lay: 15 * 10**9 if lay == over else 0,
                        variants=S.recompute_variants({}))
    plan = S.search([fitting, over], costing, c)
    assert plan.layout == selective and plan.predicted.step_time_s == 0.8
    assert any(lay == over and S.MEMORY_FLOOR_ONLY in why for lay, why in plan.skipped)
    assert full not in {lay for lay, _, _ in plan.alternatives}  # never costed


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(1, 4), (2, 4), (1, 8)]), st.floats(0.2, 3.0),
       st.sampled_from([0.3, 1.0, 3.0]), st.data())
def test_the_memory_floor_changes_neither_the_plan_nor_the_refusal(shape, room, scale, data):
    """With the refinements (recomputation, bucket sizes): layouts left out on a memory
    floor below their peak still reach the recomputation rounds, with their step times
    (asked only when a bound does not settle it), so the plan, and with nothing fitting
    the PlanError, are those of the search without the floor; and so are those of the
    search that tries recomputation as it finds layouts over memory."""
    c = cluster(nodes=shape[0], per_node=shape[1])  # 10 GB devices
    candidates = S.candidate_layouts(c, 16, 4, {})
    # peaks of 0.3-1 x 30 GB x scale on 10 GB devices: at scale 3 nothing fits unless
    # recomputation leaves little (room < 1.5); floors close to the peaks
    base = {lay: (data.draw(st.floats(1e-3, 1.0)), data.draw(st.floats(0.3, 1.0)) * 3e10 * scale)
            for lay in candidates}
    floor_share = {lay: data.draw(st.floats(0.6, 1.0)) for lay in candidates}
    recompute = {"none": (1.0, 1.0), "selective": (1.1, room * 0.35),
                 "full": (1.3, room * 0.2)}  # time and memory factors

    def predict(lay):
        seconds, memory = base[lay.replace(recompute="none", bucket_mb=25.0)]
        more_time, less_memory = recompute[lay.recompute]
        return fake_prediction(seconds * more_time * (1 + lay.bucket_mb / 1e3),
                               int(memory * min(less_memory, 1.0)))

    asked = []

    def timed(lay):
        asked.append(lay)
        return predict(lay).step_time_s

    def floor(lay):
        return predict(lay).peak_memory_bytes * floor_share[lay.replace(recompute="none",
                                                                          bucket_mb=25.0)]

    def bound(lay):
        return predict(lay).step_time_s * 0.5

    rounds = S.refinements({})
    # as autopar.plan searches: recomputation tried as layouts are found over memory
    # (not in rounds), skipped where the layout without it is slower than a fitting one
    floored = S.Costing(predict, bound=bound, timed=timed, memory_floor=floor)
    eager = (S.refinements({}, recompute=False),
             dataclasses.replace(floored, variants=S.recompute_variants({}),
                                 prepared=lambda lay: data.draw(st.booleans())))
    try:
        plain = S.search(candidates, S.Costing(predict), c, refine=rounds)
    except S.PlanError as exc:
        for more, costing in ((rounds, floored), eager):
            with pytest.raises(S.PlanError) as refused:
                S.search(candidates, costing, c, refine=more)
            assert str(refused.value) == str(exc)
        return
    fast = S.search(candidates, floored, c, refine=rounds)
    assert (fast.layout, fast.predicted) == (plain.layout, plain.predicted)
    quick = S.search(candidates, eager[1], c, refine=eager[0])
    assert (quick.layout, quick.predicted) == (plain.layout, plain.predicted)
    over = [lay for lay, why in fast.skipped if S.MEMORY_FLOOR_ONLY in why]
    assert all(predict(lay).peak_memory_bytes > 0.9 * 10**10 for lay in over)


def test_why_not_names_the_part_that_costs_more():
    best = fake_prediction(1.0, 10)
    worse = Prediction(1.5, 1e12, 1.0, 0.5, 10, 0.3,
                       {"compute": 0.6, "exposed_comm": 0.3, "bubble": 0.6, "optimizer": 0.0})
    assert S.why_not(worse, best, 100) == ("slower by 50.0% (+500 ms), mostly pipeline bubble "
                                           "(+500 ms)")
    assert S.why_not(fake_prediction(1.0, 3 * 10**9), best, 2e9) == (
        "does not fit: 3 GB per device (the fullest rank) over the 2 GB allowed, by 1 GB")


def test_constraints_fix_fields_and_bad_ones_are_named():
    c = cluster(per_node=8)
    only = S.candidate_layouts(c, 16, 4, S.check_constraints({"tp": 2, "schedule": "gpipe"})[0])
    assert only and all(lay.tp == 2 and lay.schedule == "gpipe" for lay in only)
    assert all(lay.pp > 1 for lay in only)  # gpipe is a pipeline schedule
    with pytest.raises(autopar.LayoutError, match=r"unknown plan constraint\(s\) \['tpp'\]"):
        S.check_constraints({"tpp": 2})
    with pytest.raises(autopar.LayoutError, match="Layout.amp must be one of"):
        S.check_constraints({"amp": "fp8"})
    with pytest.raises(autopar.LayoutError, match="max_memory_fraction must be in"):
        S.check_constraints({"max_memory_fraction": 1.5})
    assert S.check_constraints({"zero": 1})[0] == {"zero": 1}


# -- on a real model -----------------------------------------------------------------------

def test_search_equals_costing_each_candidate_alone():
    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    c = ClusterSpec.local(nprocs=2)
    plan = autopar.plan(ex.model, c, ex.batch, ex.loss_fn)
    costed = [(plan.layout, plan.predicted)] + [(lay, p) for lay, p, _ in plan.alternatives]
    # timed: slower than the plan, their memory not costed; floored: a pipeline's busiest
    # rank alone slower than the plan, its schedule not simulated
    timed = [lay for lay, why in plan.skipped if S.TIMED_ONLY in why]
    floored = [lay for lay, why in plan.skipped if S.FLOOR_ONLY in why]
    seen = [lay for lay, _ in costed] + timed + floored
    assert {lay.tp for lay in seen} == {1, 2} and {lay.pp for lay in seen} == {1, 2}
    for lay in timed + floored:
        alone = autopar.estimate(ex.model, c, lay, ex.batch, ex.loss_fn)
        assert alone.step_time_s > plan.predicted.step_time_s, lay
    for lay, pred in costed:
        alone = autopar.estimate(ex.model, c, lay, ex.batch, ex.loss_fn)
        assert pred.step_time_s == pytest.approx(alone.step_time_s, rel=1e-9), lay
        assert pred.peak_memory_bytes == alone.peak_memory_bytes
        assert plan.predicted.step_time_s <= pred.step_time_s
    # skipped: a ZeRO stage the layout cannot take, or slower than the plan by the bound
    assert all("zero" in why or why.startswith("not costed") for _, why in plan.skipped)
    # a Plan round-trips through JSON and compile takes it as its layout
    again = autopar.Plan.from_dict(plan.to_dict())
    assert again.layout == plan.layout and again.alternatives[0][2] == plan.alternatives[0][2]


def test_a_model_that_fits_nowhere_names_the_memory_that_would_fit():
    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    small = ClusterSpec.from_dict({**ClusterSpec.local(nprocs=2).to_dict(),
                                   "device": {**ClusterSpec.local(2).device.model_dump(),
                                              "memory_bytes": 10**6}})
    with pytest.raises(autopar.PlanError, match=r"fits no layout .* at least 0\.00\d+ GB .*"
                                                 r"fits none of nodes=\[2, 4, 8\]"):
        autopar.plan(ex.model, small, ex.batch, ex.loss_fn, tp=1, pp=1)


def test_compile_takes_a_plan_as_its_layout():
    import torch

    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    plan = autopar.plan(ex.model, ClusterSpec.local(nprocs=1), ex.batch, ex.loss_fn)
    assert plan.layout == autopar.Layout() and not plan.alternatives
    step = autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=plan)
    assert torch.isfinite(step(*ex.batch))


def _with_memory(c: ClusterSpec, nbytes: int) -> ClusterSpec:
    data = c.to_dict()
    return ClusterSpec.from_dict({**data, "device": {**data["device"], "memory_bytes": nbytes}})


def test_recomputation_is_searched_where_memory_is_short():
    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    c = ClusterSpec.local(nprocs=1)
    peak = {policy: autopar.estimate(ex.model, c, autopar.Layout(recompute=policy), ex.batch,
                                     ex.loss_fn).peak_memory_bytes
            for policy in ("none", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["none"]
    # room for full recomputation only (at max_memory_fraction=0.9)
    tight = _with_memory(c, int((peak["full"] + peak["selective"]) / 2 / 0.9))
    # one micro-batch: accumulation saves activations too (the next test)
    plan = autopar.plan(ex.model, tight, ex.batch, ex.loss_fn, microbatches=1)
    assert plan.layout == autopar.Layout(recompute="full")
    why = {lay: w for lay, _, w in plan.alternatives}
    assert why[autopar.Layout()].startswith("does not fit")
    assert why[autopar.Layout(recompute="selective")].startswith("does not fit")
    # with room for everything, recomputation is not tried: it only costs time
    roomy = autopar.plan(ex.model, c, ex.batch, ex.loss_fn)
    assert roomy.layout.recompute == "none"
    assert all(lay.recompute == "none" for lay, _, _ in roomy.alternatives)
    # a fixed field is never varied
    with pytest.raises(autopar.PlanError, match="fits no layout"):
        autopar.plan(ex.model, tight, ex.batch, ex.loss_fn, recompute="none", microbatches=1)


def test_gradient_accumulation_is_searched_where_memory_is_short():
    """Without a pipeline the search tries 2 micro-batches and micro-batches of one
    sequence: where one micro-batch's activations do not fit and recomputation and ZeRO
    are ruled out, accumulation is the plan, costed from the per-block trace as
    `estimate` costs it."""
    ex = gpt2(layers=4, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    c = ClusterSpec.local(nprocs=2)
    whole = autopar.estimate(ex.model, c, autopar.Layout(dp=2), ex.batch,
                             ex.loss_fn).peak_memory_bytes
    halves = autopar.estimate(ex.model, c, autopar.Layout(dp=2, microbatches=2), ex.batch,
                              ex.loss_fn).peak_memory_bytes
    assert halves < whole
    tight = _with_memory(c, int((halves + whole) / 2 / 0.9))
    # recomputation and ZeRO, which save memory too, ruled out
    plan = autopar.plan(ex.model, tight, ex.batch, ex.loss_fn, recompute="none", zero=0, tp=1,
                        pp=1, workers=0)
    assert plan.layout.dp == 2 and plan.layout.microbatches in (2, 4)
    assert plan.details["tracing"].startswith("per block")
    again = autopar.estimate(ex.model, tight, plan.layout, ex.batch, ex.loss_fn)
    assert again.step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert again.peak_memory_bytes <= 0.9 * tight.device.memory_bytes
    why = {lay: w for lay, _, w in plan.alternatives}
    assert why[autopar.Layout(dp=2)].startswith("does not fit")


def test_bucket_sizes_are_searched_for_the_best_data_parallel_layout():
    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    plan = autopar.plan(ex.model, ClusterSpec.local(nprocs=2), ex.batch, ex.loss_fn, tp=1, pp=1)
    costed = {plan.layout} | {lay for lay, _, _ in plan.alternatives}
    base = min((lay for lay in costed if lay.bucket_mb == 25.0),
               key=lambda lay: next(p.step_time_s for l2, p, _ in plan.alternatives if l2 == lay)
               if lay != plan.layout else plan.predicted.step_time_s)
    timed = {lay for lay, why in plan.skipped if S.TIMED_ONLY in why}
    assert {base.replace(bucket_mb=mb) for mb in S.BUCKET_MB_CHOICES} <= costed | timed
    fixed = autopar.plan(ex.model, ClusterSpec.local(nprocs=2), ex.batch, ex.loss_fn, tp=1, pp=1,
                         bucket_mb=25.0)
    assert {lay.bucket_mb for lay, _, _ in fixed.alternatives} \
        | {lay.bucket_mb for lay, _ in fixed.skipped} == {25.0}


def test_compute_bound_is_below_every_prediction_and_prunes_without_changing_the_plan():
    from autopar.compiler.planner.estimate import Estimator
    from autopar.compiler.planner.plan import compute_bound

    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    data = cluster(per_node=2, flops=1e9, bandwidth=1e13).to_dict()  # compute-bound devices
    data["device"]["peak_flops"] = {"fp32": 1e9, "bf16": 1.6e10}
    c = ClusterSpec.from_dict(data)
    candidates = S.candidate_layouts(c, 8, 2, {})
    assert {lay.amp for lay in candidates} == {"off", "bf16"}
    est = Estimator(ex.model, c, ex.batch, ex.loss_fn)
    bound = compute_bound(est, candidates, costs.DEFAULT_EFFICIENCY)
    everything = S.search(candidates, S.Costing(est.predict), c)
    pruned = S.search(candidates, S.Costing(est.predict, bound=bound), c)
    costed = [(everything.layout, everything.predicted)] + [
        (lay, p) for lay, p, _ in everything.alternatives]
    for lay, pred in costed:  # every reference is costed now: the bound is its tightest
        assert 0 < bound(lay) <= pred.step_time_s, lay
    pipelined = [lay for lay, _ in costed if lay.pp > 1 and lay.schedule in ("1f1b", "gpipe")]
    fresh = compute_bound(Estimator(ex.model, c, ex.batch, ex.loss_fn), candidates,
                          costs.DEFAULT_EFFICIENCY)  # nothing costed: FLOPs only
    assert pipelined and all(bound(lay) > fresh(lay) for lay in pipelined)
    assert pruned.layout == everything.layout and pruned.predicted == everything.predicted
    assert pruned.layout.amp == "bf16"
    # fp32 is 16x slower at the peak: none of its layouts needed costing
    not_costed = [lay for lay, why in pruned.skipped if why.startswith("not costed")]
    assert {lay for lay in candidates if lay.amp == "off"} <= set(not_costed)
    assert all(lay.amp == "bf16" for lay, _, _ in pruned.alternatives)


def test_whole_step_bound_counts_the_gradient_sync_and_prunes_comm_bound_layouts():
    """On slow links a whole-graph step is bound by its collectives (one stream) and its
    optimizer: plan.compute_bound's floor from the parameters' shapes stays below every
    unpipelined prediction, rules out layouts before they are costed, and the plan is
    the one costing everything finds."""
    from autopar.compiler.planner.estimate import Estimator
    from autopar.compiler.planner.pipeline_cost import after_schedule_floor
    from autopar.compiler.planner.plan import BOUND_MARGIN, compute_bound

    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    c = cluster(per_node=4, intra=(1e8, 1e-5), flops=1e12, bandwidth=1e12)  # comm-bound
    candidates = [lay for lay in S.candidate_layouts(c, 8, 2, {}) if lay.pp == 1]
    est = Estimator(ex.model, c, ex.batch, ex.loss_fn)
    bound = compute_bound(est, candidates, costs.DEFAULT_EFFICIENCY)
    params = [(tuple(p.shape), p.element_size()) for p in ex.model.parameters()]
    everything = S.search(candidates, S.Costing(est.predict), c)
    costed = [(everything.layout, everything.predicted)] + [
        (lay, p) for lay, p, _ in everything.alternatives]
    synced = 0
    for lay, pred in costed:
        floor = after_schedule_floor(params, c, lay) * BOUND_MARGIN
        assert floor <= bound(lay) <= pred.step_time_s, lay
        synced += lay.dp > 1 and floor > 0.5 * pred.step_time_s
    assert synced >= 3  # the floor is most of these steps
    fresh = Estimator(ex.model, c, ex.batch, ex.loss_fn)
    pruned = S.search(candidates, S.Costing(
        fresh.predict, bound=compute_bound(fresh, candidates, costs.DEFAULT_EFFICIENCY)), c)
    assert (pruned.layout, pruned.predicted) == (everything.layout, everything.predicted)
    assert any(why.startswith("not costed") for _, why in pruned.skipped)


def test_static_bound_is_below_every_predicted_peak_and_prunes_without_tracing():
    from autopar.compiler.planner.estimate import Estimator
    from autopar.compiler.analysis.memory import static_lower_bound
    from autopar.compiler.planner.plan import bucketed_gradients, prune_static

    ex = gpt2(layers=4, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    c = ClusterSpec.local(nprocs=4)
    param_bytes = sum(p.numel() * p.element_size() for p in ex.model.parameters())
    plan = autopar.plan(ex.model, c, ex.batch, ex.loss_fn)
    estimator = Estimator(ex.model, c, ex.batch, ex.loss_fn)  # the ones timed too
    costed = [(plan.layout, plan.predicted)] + [(lay, p) for lay, p, _ in plan.alternatives] \
        + [(lay, estimator.predict(lay)) for lay, why in plan.skipped
           if S.TIMED_ONLY in why or S.FLOOR_ONLY in why]
    assert {lay.zero for lay, _ in costed} == {0, 1, 2, 3} and {lay.pp for lay, _ in costed} > {1}
    # the gradient buckets of a whole-graph step: wte (tied to the head) is left out
    bucketed = bucketed_gradients(ex.model, estimator, costed[0][0])
    assert len(bucketed) == sum(1 for _ in ex.model.parameters()) - 2  # wte, wpe
    more = [autopar.Layout(dp=4, zero=z, grad_comm_dtype=g) for z in range(4)
            for g in (None, "bf16")] \
        + [autopar.Layout(dp=2, tp=2, zero=z) for z in (0, 3)] \
        + [autopar.Layout(dp=4, zero=z, overlap_comm=False) for z in (2, 3)]
    costed += [(lay, estimator.predict(lay)) for lay in more]
    for lay, pred in costed:
        assert static_lower_bound(param_bytes, lay, "adamw") <= pred.peak_memory_bytes, lay
        with_buckets = static_lower_bound(param_bytes, lay, "adamw", bucketed)
        assert with_buckets <= pred.peak_memory_bytes, lay
        if lay.pp == lay.microbatches == 1 and lay.zero >= 2:
            # reduce-scatters waited for at the output hold whole buckets: the bound;
            # overlapped, each is waited for two buckets later: no bound from them
            assert (with_buckets > static_lower_bound(param_bytes, lay, "adamw")) == \
                (not lay.overlap_comm), lay
    # without tensor parallelism the buckets are what the step's gradient collectives
    # hold, but for the embedding tables' terms (the head's term of the tied wte is
    # reduced on its own) and the loss's scalar
    for lay in (autopar.Layout(dp=4, zero=2), autopar.Layout(dp=4, grad_comm_dtype="bf16")):
        summary = estimator.rewritten_summary(lay)
        held = sum(summary.ops[op.uses[0]].allocates for op in summary.ops
                   if op.collective in ("all_reduce", "reduce_scatter") and op.group == "dp")
        wire = 2 if lay.grad_comm_dtype else 4
        floor = sum(math.prod(shape) * wire for shape, _ in bucketed)
        tables = sum(p.numel() * wire for p in (ex.model.transformer.wte.weight,
                                                ex.model.transformer.wpe.weight))
        assert floor <= held - 4 <= floor + tables, (lay, held, floor)
    # on a device with room for less than the bound, those layouts are not traced
    tight = _with_memory(c, int(static_lower_bound(param_bytes, autopar.Layout(dp=4), "adamw")))
    keep, pruned = prune_static(S.candidate_layouts(tight, 8, 4, {}), ex.model, tight, 0.9,
                                "adamw")
    assert pruned and keep and all("not traced" in why for _, why in pruned)
    assert autopar.Layout(dp=4) in {lay for lay, _ in pruned}
    assert autopar.Layout(dp=4, zero=3) in keep


def test_layouts_that_differ_past_the_forward_level_passes_share_their_graph():
    """The Estimator rewrites the forward-level passes (tensor parallelism, AMP,
    recomputation) once for every dp, ZeRO stage and bucket size; each prediction is
    still what `autopar.estimate` of that layout alone gives."""
    from autopar.compiler.planner.estimate import Estimator

    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    c = cluster(per_node=4)
    layouts = [autopar.Layout(dp=2, tp=2, zero=z, recompute="full") for z in (0, 1, 2, 3)]
    layouts.append(layouts[2].replace(bucket_mb=5.0))
    est = Estimator(ex.model, c, ex.batch, ex.loss_fn)
    shared = [est.predict(lay) for lay in layouts]
    # one graph before recomputation (shared by its variants), one after
    assert est.rewrites.forward_graphs == 2 and est.counts()["rewrites"] == len(layouts)
    for lay, pred in zip(layouts, shared):
        alone = autopar.estimate(ex.model, c, lay, ex.batch, ex.loss_fn)
        assert pred == alone, lay


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["1f1b", "gpipe"]), st.integers(2, 8), st.integers(0, 8), st.data())
def test_the_fill_and_drain_bound_is_below_the_simulated_schedule(name, pp, extra, data):
    """plan.bubble_factor: any stage times t (forward + backward per micro-batch) give a
    1F1B or GPipe makespan of at least sum(t) / (1 - (1 - 1/m)^pp), by our simulator."""
    from autopar.compiler.planner.plan import bubble_factor
    from autopar.compiler.ir.schedule import build, simulate

    m = pp + extra
    times = {(s, kind): data.draw(st.floats(0.0, 1.0)) for s in range(pp) for kind in "FB"}
    total = sum(times.values())
    layout = autopar.Layout(dp=1, pp=pp, microbatches=m, schedule=name)
    floor = bubble_factor(layout) * total * m / pp  # the factor is over the mean rank's work
    assert simulate(build(name, pp, m), times).makespan >= floor * (1 - 1e-9)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 8), st.floats(0.05, 1.0), st.data())
def test_the_fill_bound_is_below_the_simulated_zero_bubble_schedule(pp, extra, ratio, data):
    """plan.fill_factor: stages of c_s blocks whose F takes at least f c_s and whose F, I
    and W at least w c_s give a zero-bubble makespan of at least fill_factor(pp, m, f / w)
    times the mean rank's m w sum(c) / pp, by our simulator."""
    from autopar.compiler.planner.plan import fill_factor
    from autopar.compiler.ir.schedule import build, simulate

    m, w = pp + extra, 1.0
    f = ratio * w
    uniform = data.draw(st.booleans())  # balanced stages at their floors: the tight case
    counts = [1.0 if uniform else data.draw(st.floats(0.0, 4.0)) for _ in range(pp)]
    more = (lambda: 0.0) if uniform else (lambda: data.draw(st.floats(0.0, 1.0)))
    times = {}
    for s, c in enumerate(counts):
        times[s, "F"] = f * c + more()
        times[s, "I"] = (0.5 if uniform else data.draw(st.floats(0.0, 1.0))) * (w - f) * c
        times[s, "W"] = (w - f) * c - times[s, "I"] + more()
    floor = fill_factor(pp, m, f / w) * m * w * sum(counts) / pp
    makespan = simulate(build("zero-bubble", pp, m), times).makespan
    assert makespan >= floor * (1 - 1e-9)
    if uniform and ratio < 0.5:  # 1F1B's fill and drain would be above it: W fills the drain
        assert makespan < fill_factor(pp, m, 1.0) * m * w * sum(counts) / pp


@pytest.mark.parametrize("pp, m, ratio", [(2, 2, 1.0), (4, 4, 1.0), (4, 8, 1.0), (8, 8, 1.0),
                                          (3, 7, 1.0), (16, 32, 1.0), (4, 8, 0.3),
                                          (16, 32, 1 / 3), (6, 12, 0.05)])
def test_the_fill_and_drain_bound_is_the_least_makespan_over_stage_times(pp, m, ratio):
    """The closed form is the optimum of min_c max_k (ratio sum_{i<k} c_i + m c_k) with
    sum c = pp / m (one unit of work per rank), solved as an LP by HiGHS; ratio 1 is
    1F1B's and GPipe's bubble_factor."""
    import highspy
    import numpy as np

    from autopar.compiler.planner.plan import bubble_factor, fill_factor

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    inf = highspy.kHighsInf
    for _ in range(pp + 1):  # t_0 .. t_{pp-1}, then the makespan L
        h.addVar(0.0, inf)
    h.changeColCost(pp, 1.0)
    for k in range(pp):  # sum_{i<k} t_i + m t_k - L <= 0
        h.addRow(-inf, 0.0, k + 2, np.array([*range(k), k, pp], dtype=np.int32),
                 np.array([ratio] * k + [float(m), -1.0]))
    h.addRow(pp / m, pp / m, pp, np.arange(pp, dtype=np.int32), np.ones(pp))
    h.run()
    assert h.getInfo().objective_function_value == pytest.approx(fill_factor(pp, m, ratio),
                                                                 rel=1e-7)
    layout = autopar.Layout(dp=1, pp=pp, microbatches=m)
    if ratio == 1.0:
        assert bubble_factor(layout) == fill_factor(pp, m, 1.0)
    assert bubble_factor(layout.replace(schedule="zero-bubble")) == 1.0


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_reference_bound_is_below_every_prediction_on_the_local_cpu_cluster(name):
    """On a CPU (launch overhead, memory-bound ops, first touch, fused regions' fallbacks)
    every layout's bound from its costed reference stays below its prediction, and the
    bounded search gives the same plan."""
    from autopar.compiler.planner.estimate import Estimator
    from autopar.compiler.planner.plan import compute_bound, reference_layout
    from autopar.examples import llama

    from autopar.compiler.planner.cost_model import model_compute_floor

    maker = gpt2 if name == "gpt2" else llama
    ex = maker(layers=3, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    c = ClusterSpec.local(nprocs=4)
    candidates = S.candidate_layouts(c, 8, 3, {})
    est = Estimator(ex.model, c, ex.batch, ex.loss_fn)
    bound = compute_bound(est, candidates, costs.DEFAULT_EFFICIENCY)
    everything = S.search(candidates, S.Costing(est.predict), c)
    costed = [(everything.layout, everything.predicted)] + [
        (lay, p) for lay, p, _ in everything.alternatives]
    assert {lay.schedule for lay, _ in costed if lay.pp > 1} == {"1f1b", "gpipe", "zero-bubble"}
    for lay, pred in costed:
        assert reference_layout(lay) in {other for other, _ in costed}, lay
        assert bound(lay) <= pred.step_time_s, (lay, bound(lay), pred.step_time_s)
    # two stages of three blocks: one rank holds two, 4/3 of the blocks' mean share
    # (with only the reference costed: no sibling bound yet; plain SGD and a link of
    # 5 GB/s at 20 us a message, whose one pass and gradient sum keep the floor after
    # the schedule below this one: gloo's ~0.4 ms a message would lift it above)
    zb = next(lay for lay, _ in costed if lay.schedule == "zero-bubble")
    fast = with_fast_link(c)
    sgd = Estimator(ex.model, fast, ex.batch, ex.loss_fn, optimizer="sgd")
    sgd.predict(reference_layout(zb))
    whole, blocks = model_compute_floor(sgd.rewritten_summary(reference_layout(zb)), fast)
    assert 0 < blocks < whole < blocks * 4 / 3
    assert compute_bound(sgd, candidates, costs.DEFAULT_EFFICIENCY)(zb) == pytest.approx(
        blocks * 4 / 3 * 0.99)
    # its ZeRO siblings, once it is costed: its compute plus bubble
    alone = Estimator(ex.model, c, ex.batch, ex.loss_fn)
    alone.predict(reference_layout(zb))
    sibling = zb.replace(zero=1)
    pred = alone.predict(zb)
    assert compute_bound(alone, candidates, costs.DEFAULT_EFFICIENCY)(sibling) >= (
        pred.breakdown["compute"] + pred.breakdown["bubble"]) * 0.99
    pruned = S.search(candidates, S.Costing(est.predict, bound=compute_bound(
        Estimator(ex.model, c, ex.batch, ex.loss_fn), candidates, costs.DEFAULT_EFFICIENCY)), c)
    assert pruned.layout == everything.layout and pruned.predicted == everything.predicted


def test_a_model_that_fits_only_on_more_nodes_names_them_and_a_layout_that_fits():
    """The hint's layout is the first that fits on the larger cluster (smallest static
    memory bound first, full recomputation first): it must fit there, and nothing may
    fit on the cluster asked for."""
    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    one = ClusterSpec.local(nprocs=2)
    two = ClusterSpec.from_dict({**one.to_dict(), "nodes": 2})

    from autopar.compiler.planner.estimate import Estimator

    def smallest_peak(c):
        est = Estimator(ex.model, c, ex.batch, ex.loss_fn)  # what estimate predicts, traced once
        return min(est.predict(lay.replace(recompute=r)).peak_memory_bytes
                   for lay in S.candidate_layouts(c, 8, 2, {"tp": 1, "pp": 1})
                   for r in ("none", "full", "selective"))

    low, high = smallest_peak(two), smallest_peak(one)
    assert low < high  # ZeRO over four ranks holds less than over two
    memory = int((low + high) / 2 / 0.9)
    small = ClusterSpec.from_dict({**one.to_dict(),
                                   "device": {**one.device.model_dump(), "memory_bytes": memory}})
    with pytest.raises(autopar.PlanError, match=r"fits no layout .*smallest cluster of these "
                                                 r"nodes that fits: nodes=2 \(4 devices, e\.g\. "
                                                 r"(Layout\(.*\))\)") as info:
        autopar.plan(ex.model, small, ex.batch, ex.loss_fn, tp=1, pp=1)
    named = eval(re.search(r"e\.g\. (Layout\(.*\))\)", str(info.value)).group(1),
                 {"Layout": autopar.Layout})
    bigger = ClusterSpec.from_dict({**small.to_dict(), "nodes": 2})
    assert autopar.estimate(ex.model, bigger, named, ex.batch,
                            ex.loss_fn).peak_memory_bytes <= 0.9 * memory


def test_equal_bounds_cost_unpipelined_layouts_then_the_shortest_fill_first():
    """search.costing_order: the pipelines' bounds come from the unpipelined layouts,
    and a fast schedule costed early prunes the slow ones; without a bound the
    candidates are costed as given (a memory bound prunes them smallest first)."""
    c = cluster(nodes=1, per_node=4)
    candidates = S.candidate_layouts(c, 16, 4, {})
    seen = []

    def predict(layout):
        seen.append(layout)
        return fake_prediction(1.0, 1)

    S.search(candidates, S.Costing(predict, bound=lambda lay: 0.0), c)
    pipelined = [lay.pp > 1 or lay.microbatches > 1 for lay in seen]
    assert pipelined == sorted(pipelined) and any(pipelined)
    schedules = [lay.schedule for lay in seen if lay.pp > 1]
    assert schedules.index("zero-bubble") < schedules.index("1f1b") < schedules.index("gpipe")
    seen.clear()
    S.search(candidates, S.Costing(predict), c)
    assert seen == candidates


def test_the_search_pauses_the_garbage_collector_and_restores_it():
    """plan() runs with Python's cyclic collector off (its millions of acyclic tuples
    would trigger full collections over everything torch holds) and leaves it as found."""
    import gc

    from autopar.compiler.planner.plan import collector_paused

    seen = []
    ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    assert gc.isenabled()
    autopar.plan(ex.model, ClusterSpec.local(nprocs=2), ex.batch, ex.loss_fn, tp=1, pp=1,
                 progress=lambda *_: seen.append(gc.isenabled()))
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before: off after
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("an error inside")
    assert gc.isenabled()


def test_recomputation_variants_share_the_graph_before_it(monkeypatch):
    """Rewrites._forward_level: the layouts that differ only in recomputation run tensor
    parallelism and AMP (the solve and the re-trace) once, and each predicts what it
    predicts alone."""
    from autopar.compiler.passes.amp import AutoMixedPrecision
    from autopar.compiler.planner.estimate import Estimator
    from autopar.examples import causal_lm_loss
    from tests.unit.test_cost_model import meta_gpt2

    model, batch = meta_gpt2(layers=4, hidden=128, heads=4, vocab=500, batch=8, seq=32)
    c = ClusterSpec.preset("dgx-h100")
    runs = []
    original = AutoMixedPrecision.run
    monkeypatch.setattr(AutoMixedPrecision, "run",
                        lambda self, tg, ctx: runs.append(tg.history) or original(self, tg, ctx))
    shared = Estimator(model, c, batch, causal_lm_loss, trace_blocks=2)
    layouts = [autopar.Layout(dp=4, tp=2, amp="bf16", recompute=r)
               for r in ("full", "selective", "none")]
    layouts += [autopar.Layout(dp=2, tp=2, pp=2, microbatches=2, amp="bf16", recompute=r)
                for r in ("full", "none")]
    predictions = [shared.predict(lay) for lay in layouts]
    # one trace (2 samples a rank: the template's too), one tp and AMP; the trace itself
    # was made with AMP's hook (Traces._first_trace: its FLOPs; a layout without tp
    # starts from it)
    assert runs == [(), ("tensor_parallel",)]
    for lay, pred in zip(layouts, predictions):
        assert Estimator(model, c, batch, causal_lm_loss, trace_blocks=2).predict(lay) == pred


def test_each_default_pass_declares_the_layout_fields_it_reads():
    """The planner shares a rewritten graph among the layouts every pass reads alike
    (GraphPass.reads): a pass that reads a field it does not declare would give two
    layouts one graph. Every `ctx.layout.X` in a pass's module is among its
    layout_fields (tensor parallelism reads world_size only without a cluster: the
    planner always has one); recompute="auto" reads the whole layout."""
    import inspect
    import sys

    from autopar.compiler.passes.defaults import default_passes, reads_of

    everything = autopar.Layout(dp=2, tp=2, zero=3, recompute="full", amp="bf16")
    piped = autopar.Layout(dp=2, tp=2, pp=2, microbatches=2, recompute="selective")
    for p in {type(p): p for p in default_passes(everything) + default_passes(piped)}.values():
        source = inspect.getsource(sys.modules[type(p).__module__])
        read = set(re.findall(r"ctx\.layout\.(\w+)", source)) - {"world_size"}
        assert read and read <= p.layout_fields, (p, read - p.layout_fields)
    auto = everything.replace(recompute="auto")
    assert reads_of(default_passes(auto), auto) != reads_of(default_passes(auto.replace(
        bucket_mb=5.0)), auto.replace(bucket_mb=5.0))
    # one pipeline's micro-batch counts read alike where each stage keeps as many in
    # flight (assign_stages weighs them); its schedules alike in the planner's two-block
    # templates, whose cut is pinned; a pass list that differs (no shards: no
    # global_loss_mean) does not
    from autopar.compiler.planner.rewrites import planner_passes

    a, b = piped.replace(schedule="gpipe", microbatches=4), piped.replace(dp=1, microbatches=1)
    more = piped.replace(microbatches=4)  # 1F1B: 2 and 1 in flight, as with 2
    assert reads_of(default_passes(more), more) == reads_of(default_passes(piped), piped)
    assert reads_of(default_passes(a), a) != reads_of(default_passes(piped), piped)
    assert reads_of(planner_passes(a, template=True), a) == \
        reads_of(planner_passes(piped, template=True), piped)
    assert reads_of(default_passes(b), b) != reads_of(default_passes(piped), piped)


def test_pipelines_are_tried_with_micro_batches_of_one_sequence():
    """A rank's share of 7 sequences on pp=4 gives 7 micro-batches of one (besides pp and
    2 pp), though the batch of 14 does not split over the dp x pp = 8 ranks of the
    unpipelined layout the search bounds pipelines with: that bound is left out, the
    layout is costed."""
    assert S._micro_batch_counts(4, 2, 14) == [4, 7, 8]
    assert S._micro_batch_counts(1, 2, 14) == [1, 2, 7]  # accumulation: 2, and 7 of one
    assert S._micro_batch_counts(1, 2, None) == [1]
    ex = gpt2(layers=4, hidden=64, heads=4, vocab=256, batch=14, seq=32)
    c = ClusterSpec.preset("dgx-h100")
    plan = autopar.plan(ex.model, c, ex.batch, ex.loss_fn, workers=0, tp=1, pp=4, dp=2,
                        zero=0, amp="bf16", schedule="1f1b", recompute="none")
    costed = [plan.layout] + [lay for lay, _, _ in plan.alternatives]
    skipped = [lay for lay, _ in plan.skipped]
    # 4 and 8 micro-batches do not split the batch of 14 over dp=2: not candidates
    assert {lay.microbatches for lay in costed + skipped} == {7}
