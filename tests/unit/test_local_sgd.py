"""Local SGD (Layout.local_sgd): the averaging schedule and AdaComm's adaptive period on
scripted traces, the layout's bad values, the steady state's passes, its cost and the
planner's `allow`. The multi-process results are tests/dist/cases_local_sgd.py."""

import math

import pytest

import autopar
from autopar.compiler.passes.defaults import default_passes
from autopar.compiler.planner.plan import PlanArgumentError
from autopar.examples import gpt2
from autopar.layout import LayoutError
from autopar.runtime.local_sgd import MAX_PERIOD, AveragingSchedule, adaptive_period
from tests.unit.test_hierarchical import cluster


def test_adaptive_period_follows_the_loss_and_the_learning_rate_with_its_clamp():
    # tau = ceil(sqrt(lr0 * loss / (lr * loss0)) * tau0)
    assert adaptive_period(4, 0.1, 0.1, 4.0, 4.0) == 4
    assert adaptive_period(4, 0.1, 0.1, 4.0, 1.0) == 2  # sqrt(1/4) * 4
    assert adaptive_period(4, 0.1, 0.1, 4.0, 0.5) == 2  # ceil(1.41)
    assert adaptive_period(4, 0.1, 0.1, 4.0, 0.0) == 1  # clamped below
    assert adaptive_period(4, 0.1, 0.01, 4.0, 4.0) == 13  # ceil(sqrt(10) * 4)
    assert adaptive_period(4, 0.1, 0.001, 4.0, 4.0) == MAX_PERIOD == 16  # 40, clamped
    assert adaptive_period(4, 0.1, 0.1, 4.0, float("nan")) == 4  # no finite loss: unchanged


def _run(schedule, steps, loss_at, lr_at):
    averaged = []
    for step in range(steps):
        if schedule.synchronous(step):
            continue
        if schedule.due(step):
            schedule.averaged(lr_at(step), loss_at(step))
            averaged.append(step)
    return averaged


@pytest.mark.parametrize("steps, warmup, period", [(10, 3, 3), (8, 2, 3), (5, 0, 1), (9, 9, 2)])
def test_a_fixed_period_averages_ceil_of_local_steps_over_period_times(steps, warmup, period):
    schedule = AveragingSchedule(period, warmup)
    averaged = _run(schedule, steps, lambda s: 1.0, lambda s: 0.1)
    assert averaged == list(range(warmup, steps, period))
    assert schedule.averagings == len(averaged) == math.ceil(max(steps - warmup, 0) / period)


def test_an_adaptive_period_on_a_scripted_trace():
    """The loss falls 4 -> 1 -> 0.25 and the learning rate is cut 100x at step 30."""
    loss = {2: 4.0, 6: 1.0, 8: 0.25, 9: 0.25, 10: 0.25}
    lr = lambda s: 0.1 if s < 30 else 0.001
    schedule = AveragingSchedule(4, 2, adaptive=True)
    averaged = _run(schedule, 50, lambda s: loss.get(s, 0.25), lr)
    # at step 2 the first average sets loss0 = 4 (period 4: next at 6); at 6 the loss is
    # 1 (sqrt(1/4) * 4 = 2: next at 8); at 8, 0.25 (sqrt(1/16) * 4 = 1: every step) until
    # the learning rate falls at 30: sqrt(100 / 16) * 4 = 10 (next at 40, then 50)
    assert averaged == [2, 6, *range(8, 31), 40]
    assert schedule.period == 10


@pytest.mark.parametrize("fields, words", [
    ({"dp": 2, "local_sgd": 0}, r"Layout.local_sgd \(the averaging period H, in steps\) must be an integer >= 1"),
    ({"dp": 2, "local_sgd": -3}, "must be an integer >= 1"),
    ({"dp": 2, "local_sgd": 2.5}, "must be an integer >= 1"),
    ({"local_sgd": 2}, "needs dp > 1"),
    ({"dp": 2, "local_sgd": 2, "zero": 1}, "use zero=0"),
    ({"dp": 2, "local_sgd_warmup": 3}, r"^Layout.local_sgd_warmup only with Layout.local_sgd "),
    ({"dp": 2, "local_sgd": 2, "local_sgd_warmup": -1}, "local_sgd_warmup .* must be an integer >= 0"),
    ({"dp": 2, "local_sgd_overlap": 1, "local_sgd_adaptive": True},
     r"^Layout.local_sgd_adaptive and Layout.local_sgd_overlap only with Layout.local_sgd "),
    ({"dp": 2, "local_sgd": 2, "local_sgd_overlap": -1}, "local_sgd_overlap .* integer >= 0"),
    ({"dp": 2, "local_sgd": 2, "local_sgd_overlap": True}, "local_sgd_overlap .* got True"),
])
def test_bad_local_sgd_layouts_name_the_field(fields, words):
    with pytest.raises(LayoutError, match=words):
        autopar.Layout(**fields)


def test_the_steady_state_program_sums_nothing_over_dp():
    names = [p.name for p in default_passes(autopar.Layout(dp=2, local_sgd=4))]
    assert "insert_allreduce" not in names and "global_loss_mean" not in names
    sync = [p.name for p in default_passes(autopar.Layout(dp=2))]
    assert "insert_allreduce" in sync and "global_loss_mean" in sync


def _slow_cluster(bandwidth=125e6):
    """2 nodes x 2 joined by a 1 Gbit/s link (test_hierarchical.cluster)."""
    return cluster(inter_bw=bandwidth, name="slow")


def test_the_cost_amortises_the_average_and_the_plan_uses_local_sgd_only_when_allowed():
    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    cluster = _slow_cluster()
    sync = autopar.estimate(ex.model, cluster, autopar.Layout(dp=4), ex.batch, ex.loss_fn,
                            optimizer="sgd-momentum")
    local = autopar.estimate(ex.model, cluster, autopar.Layout(dp=4, local_sgd=4), ex.batch,
                             ex.loss_fn, optimizer="sgd-momentum")
    assert local.step_time_s < sync.step_time_s
    assert local.breakdown["compute"] == pytest.approx(sync.breakdown["compute"], rel=0.05)
    kw = {"optimizer": "sgd-momentum", "tp": 1, "pp": 1, "amp": "off"}
    plain = autopar.plan(ex.model, cluster, ex.batch, ex.loss_fn, **kw)
    every = [plain.layout, *[lay for lay, _, _ in plain.alternatives],
             *[lay for lay, _ in plain.skipped]]
    assert all(lay.local_sgd is None for lay in every)
    allowed = autopar.plan(ex.model, cluster, ex.batch, ex.loss_fn, allow=["local_sgd"], **kw)
    assert allowed.layout.local_sgd == 4 and allowed.layout.zero == 0, allowed.layout
    assert allowed.predicted.step_time_s < plain.predicted.step_time_s
    from autopar.compiler.planner.report import headline
    assert any("is not modelled" in line for line in headline(allowed))


def test_allow_names_what_it_knows():
    ex = gpt2(layers=1)
    with pytest.raises(PlanArgumentError, match=r"\['local_sgd', 'dgc'\]; got 'powersgd'"):
        autopar.plan(ex.model, autopar.ClusterSpec.local(2), ex.batch, ex.loss_fn,
                     allow=["powersgd"])


@pytest.mark.parametrize("steps, warmup, period", [(8, 2, 3), (9, 2, 3), (2, 5, 2), (12, 0, 4)])
def test_a_resumed_schedule_averages_where_an_uninterrupted_one_would(steps, warmup, period):
    straight = AveragingSchedule(period, warmup)
    first = _run(straight, 20, lambda s: 1.0, lambda s: 0.1)
    resumed = AveragingSchedule(period, warmup)
    resumed.resume(steps)
    later = [s for s in range(steps, 20) if not resumed.synchronous(s) and resumed.due(s)
             and (resumed.averaged(0.1, 1.0) or True)]
    assert later == [s for s in first if s >= steps]
    assert resumed.averagings == len(first)


def test_local_sgd_carries_a_parameter_average_every_period():
    from autopar.compiler.planner.cost_model import AVERAGE_KEY
    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    local = autopar.estimate(ex.model, _slow_cluster(), autopar.Layout(dp=4, local_sgd=4),
                             ex.batch, ex.loss_fn, optimizer="sgd-momentum")
    params = sum(p.numel() * 4 for p in ex.model.parameters())
    assert local.comm_bytes == {AVERAGE_KEY: params // 4}


def test_an_adaptive_schedule_goes_on_from_its_saved_state():
    import json
    loss = {2: 4.0, 6: 1.0, 8: 0.25}
    lr = lambda s: 0.1
    straight = AveragingSchedule(4, 2, adaptive=True)
    first = _run(straight, 30, lambda s: loss.get(s, 0.25), lr)
    saved = AveragingSchedule(4, 2, adaptive=True)
    _run(saved, 9, lambda s: loss.get(s, 0.25), lr)  # stopped after step 8's average
    resumed = AveragingSchedule(4, 2, adaptive=True)
    resumed.restore(json.loads(json.dumps(saved.state())), 9)
    later = [s for s in range(9, 30) if resumed.due(s)
             and (resumed.averaged(lr(s), loss.get(s, 0.25)) or True)]
    assert later == [s for s in first if s >= 9]
    assert resumed.period == straight.period and resumed.averagings == straight.averagings
    other = AveragingSchedule(3, 2)  # another schedule's state: placed by the step count
    other.restore(saved.state(), 9)
    assert other.next_local == 9 and other.period == 3


def test_a_hierarchical_average_is_priced_in_the_gradients_levels():
    """With allreduce="hierarchical" the average every H steps is priced as the runtime
    sums it (costs.dp_sum_time: on gloo a reduce inside each node, an all-reduce among
    the nodes' first ranks, a broadcast), below gloo's flat ring over the slow link."""
    from autopar.costs import collective_time, dp_sum_time

    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    slow = _slow_cluster()
    layouts = [autopar.Layout(dp=4, local_sgd=4, allreduce=form)
               for form in ("flat", "hierarchical")]
    flat, hier = (autopar.estimate(ex.model, slow, lay, ex.batch, ex.loss_fn,
                                   optimizer="sgd-momentum") for lay in layouts)
    held = sum(p.numel() * 4 for p in ex.model.parameters())
    whole = collective_time("all_reduce", held, 4, slow)
    levels = dp_sum_time(held, slow, layouts[1])
    assert levels < whole
    assert flat.step_time_s - hier.step_time_s == pytest.approx((whole - levels) / 4, rel=0.02)


def test_an_overlapped_schedule_counts_an_average_when_it_is_applied():
    """Started averages set the next one's step at once (the period known then); the
    count, and an adaptive period, follow when each is applied."""
    schedule = AveragingSchedule(2, 1, adaptive=True)
    assert schedule.due(1)
    schedule.started()
    assert schedule.averagings == 0 and schedule.due(3) and not schedule.due(2)
    schedule.finished(0.1, 4.0)  # the first sets loss0
    schedule.started()
    schedule.finished(0.1, 1.0)  # sqrt(1/4) * 2 = 1: from the average after the next
    assert schedule.averagings == 2 and schedule.period == 1 and schedule.next_local == 4


def test_an_overlapped_average_is_costed_less_what_runs_under_it():
    """cost_model.overlapped_average: the whole average T less k local steps, never below
    0, amortised over H; k beyond H counts as H (the next average applies it first)."""
    from autopar.compiler.planner.cost_model import averaging_time, overlapped_average

    lay = lambda k: autopar.Layout(dp=4, local_sgd=4, local_sgd_overlap=k)
    assert overlapped_average(0.5, 0.3, lay(0)) == 0.5
    assert overlapped_average(0.5, 0.3, lay(1)) == pytest.approx((2.0 - 0.3) / 4)
    assert overlapped_average(0.5, 0.3, lay(3)) == pytest.approx((2.0 - 0.9) / 4)
    assert overlapped_average(0.5, 0.3, lay(9)) == pytest.approx((2.0 - 1.2) / 4)
    assert overlapped_average(0.5, 0.3, lay(9)) == overlapped_average(0.5, 0.3, lay(4))
    assert overlapped_average(0.5, 0.6, lay(4)) == 0.0
    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    slow = _slow_cluster(12.5e6)  # 100 Mbit/s: the average is several local steps long
    at_once, under = (autopar.estimate(ex.model, slow, lay(k), ex.batch, ex.loss_fn,
                                       optimizer="sgd-momentum") for k in (0, 1))
    from autopar.compiler.planner.estimate import Estimator
    est = Estimator(ex.model, slow, ex.batch, ex.loss_fn, optimizer="sgd-momentum")
    est.predict(lay(0))
    average = averaging_time(est.rewritten_summary(lay(0)), slow, lay(0))
    local = at_once.step_time_s - average  # the step without its average
    assert average * 4 > local  # longer than the one step it runs under
    assert under.step_time_s == pytest.approx(local + (average * 4 - local) / 4, rel=1e-6)


def test_an_overlapped_average_on_the_pipeline_runtime_is_costed_per_rank():
    """Accumulation (the pipeline runtime): the rank's step less its average, then the
    average less the k local steps it runs under (pipeline_cost._exposed_average)."""
    from autopar.costs import dp_sum_time

    ex = gpt2(layers=2, hidden=128, vocab=1024, batch=8, seq=64)
    slow = _slow_cluster(12.5e6)
    lay = lambda k: autopar.Layout(dp=4, microbatches=2, local_sgd=4, local_sgd_overlap=k)
    at_once, under = (autopar.estimate(ex.model, slow, lay(k), ex.batch, ex.loss_fn,
                                       optimizer="sgd-momentum") for k in (0, 2))
    held = sum(p.numel() * 4 for p in ex.model.parameters())
    average = dp_sum_time(held, slow, lay(0)) / 4
    local = at_once.step_time_s - average
    assert 2 * local < average * 4  # not all of it hidden under 2 local steps
    assert under.step_time_s == pytest.approx(local + (average * 4 - 2 * local) / 4, rel=1e-6)
