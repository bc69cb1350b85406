"""Local SGD (Layout.local_sgd) on 2 gloo processes: the warm-up is data parallelism
bit for bit, period 1 with SGD and momentum is data parallelism, the parameters agree
bitwise after every averaging and the averagings are counted, and a real model ends
near data parallelism's loss."""

from __future__ import annotations

import copy
import math
import tempfile

import torch
import torch.distributed as dist

import autopar
from autopar.compiler.ir.batch import Objective
from autopar.examples import gpt2
from autopar.runtime import local_sgd
from autopar.testing import compare, make_batches, reference_train
from tests.dist.cases_dp import adamw, sgd
from tests.dist.registry import case


def _compile(example, layout, optimizer=sgd):
    return autopar.compile(copy.deepcopy(example.model), autopar.ClusterSpec.local(2),
                           example.batch, example.loss_fn, optimizer=optimizer, layout=layout)


def _weights(step):
    return {k: v.clone() for k, v in step.full_state_dict().items() if v.is_floating_point()}


def _mean(loss):
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _learnable(example, steps, seed=0):
    """Batches a model can learn (each token the previous plus a per-sequence stride),
    so that the loss falls: random tokens leave only their unigram distribution."""
    ids = example.batch[0] if isinstance(example.batch, tuple) else example.batch
    batch, seq = ids.shape
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, 256, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        out.append(((start + stride * torch.arange(seq)) % 256,))
    return out


def held_out_loss(example, layout, batches, held_out, optimizer):
    """(the loss on `held_out` of `example`'s model trained on `batches` in `layout` on 2
    processes, the step)."""
    step = _compile(example, layout, optimizer)
    for b in batches:
        step(*b)
    model = copy.deepcopy(example.model)
    model.load_state_dict(step.full_state_dict())
    with torch.no_grad():
        return float(example.loss_fn(model(*held_out), *held_out)), step


@case(world=2)
def local_sgd_warmup_is_data_parallel_bit_for_bit():
    example = gpt2()
    dp = _compile(example, autopar.Layout(dp=2))
    local = _compile(example, autopar.Layout(dp=2, local_sgd=2, local_sgd_warmup=3))
    for batch in make_batches(example.batch, 3):
        assert torch.equal(dp(*batch), local(*batch))
    mine, theirs = _weights(local), _weights(dp)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert local.schedule.averagings == 0


@case(world=2)
def local_sgd_period_1_is_data_parallel_sgd_momentum():
    """Averaging after every step: mean(p - lr * m_r) with m_r = mu m_r + g_r is the
    data-parallel step with the mean gradient (momentum is linear), up to rounding."""
    example = gpt2()
    objective, flat = Objective.from_example(example.batch, None, example.loss_fn)
    batches = make_batches(flat, 5)
    init = {k: v.clone() for k, v in example.model.state_dict().items()}
    ref_losses, ref_state = reference_train(example.model, batches, objective, sgd)
    step = _compile(example, autopar.Layout(dp=2, local_sgd=1))
    losses = [_mean(step(*b)) for b in batches]
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)
    assert step.schedule.averagings == 5


@case(world=2)
def local_sgd_averages_bitwise_and_counts_its_all_reduces():
    example = gpt2()
    steps, warmup, period = 8, 2, 3
    step = _compile(example, autopar.Layout(dp=2, local_sgd=period, local_sgd_warmup=warmup))
    calls = []
    all_reduce = local_sgd.dist.all_reduce
    local_sgd.dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), all_reduce(t, *a, **k))[1]
    try:
        differed = 0
        for k, batch in enumerate(_learnable(example, steps)):
            step(*batch)
            mine = torch.cat([p.detach().reshape(-1) for p in step.updated])
            everyone = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(everyone, mine)
            same = torch.equal(everyone[0], everyone[1])
            assert same == step.synchronized, (k, same, step.synchronized)
            if not same and not differed:  # a checkpoint would keep one rank's parameters
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        step.save(tmp)
                    except RuntimeError as exc:
                        assert "the ranks' parameters differ" in str(exc), exc
                    else:
                        raise AssertionError("saved between averagings")
            differed += not same
    finally:
        local_sgd.dist.all_reduce = all_reduce
    assert differed > 0  # the ranks' own steps do move them apart
    expected = math.ceil((steps - warmup) / period)  # after local steps 0, 3: and 6 > 5
    assert step.schedule.averagings == expected == len(calls), (step.schedule, calls)
    assert calls[0] == sum(p.numel() for p in step.updated)  # every parameter, one collective


@case(world=2)
def local_sgd_gpt2_ends_near_data_parallel_loss():
    """GPT-2 tiny, SGD with momentum, 36 steps of learnable sequences; Local SGD with
    period 4 after 8 synchronous steps. The final models are compared on the same
    held-out batch (a training loss would be one rank's own)."""
    example = gpt2()
    steps = 8 + 1 + 4 * 7  # ends on an averaging: the ranks agree
    batches = _learnable(example, steps)
    held_out = _learnable(example, 1, seed=99)[0]
    finals = {name: held_out_loss(example, layout, batches, held_out, sgd)[0]
              for name, layout in (("dp", autopar.Layout(dp=2)),
                                   ("local", autopar.Layout(dp=2, local_sgd=4,
                                                            local_sgd_warmup=8)))}
    with torch.no_grad():
        first = float(example.loss_fn(example.model(*held_out), *held_out))
    assert finals["dp"] < 0.8 * first, (first, finals)  # it learnt something
    assert abs(finals["local"] - finals["dp"]) <= LOSS_GAP * finals["dp"], (first, finals)


# measured first (2026-11-26, this configuration, deterministic on CPU): held-out loss
# 5.546 at the start, data parallelism 3.195 after 37 steps, Local SGD 3.316 (+3.8%):
# it drifts between averagings. 6% bounds that with room for rounding across torch builds
LOSS_GAP = 0.06


def _compile_on(example, layout, world):
    return autopar.compile(copy.deepcopy(example.model), autopar.ClusterSpec.local(world),
                           example.batch, example.loss_fn, optimizer=sgd, layout=layout)


def _pipeline_cases(layout, world):
    """On the pipeline runtime: the warm-up is the synchronous pipelined step bit for bit;
    period 1 with SGD and momentum is data parallelism (momentum is linear), within
    parity tolerance of one process; after every averaging the dp ranks agree bitwise."""
    example = gpt2()
    objective, flat = Objective.from_example(example.batch, None, example.loss_fn)
    batches = make_batches(flat, 4)
    sync = _compile_on(example, layout, world)
    warm = _compile_on(example, layout.replace(local_sgd=2, local_sgd_warmup=2), world)
    for b in batches[:2]:
        assert torch.equal(sync(*b), warm(*b))
    assert all(torch.equal(a, b) for a, b in zip(sync.updated, warm.updated))
    ref_losses, ref_state = reference_train(example.model, batches, objective, sgd)
    init = {k: v.clone() for k, v in example.model.state_dict().items()}
    step = _compile_on(example, layout.replace(local_sgd=1), world)
    losses = [_mean(step(*b)) for b in batches]
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)
    assert step.schedule.averagings == 4 and step.synchronized
    mine = torch.cat([u.detach().reshape(-1) for u in step.updated])
    everyone = [torch.empty_like(mine) for _ in range(2)]  # the dp peers' weights
    dist.all_gather(everyone, mine, group=step.mesh.group("dp"))
    assert torch.equal(everyone[0], everyone[1])


@case(world=4)
def local_sgd_composes_with_pipeline_stages():
    _pipeline_cases(autopar.Layout(dp=2, pp=2, microbatches=2), 4)


@case(world=2)
def local_sgd_composes_with_gradient_accumulation():
    _pipeline_cases(autopar.Layout(dp=2, microbatches=2), 2)


@case(world=4)
def local_sgd_composes_with_tensor_parallelism():
    """tp's collectives stay in the local program; the average runs over dp only."""
    example = gpt2()
    objective, flat = Objective.from_example(example.batch, None, example.loss_fn)
    batches = make_batches(flat, 4)
    ref_losses, ref_state = reference_train(example.model, batches, objective, sgd)
    init = {k: v.clone() for k, v in example.model.state_dict().items()}
    step = _compile_on(example, autopar.Layout(dp=2, tp=2, local_sgd=1), 4)
    losses = [_mean(step(*b)) for b in batches]
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)


def _simulated_local_sgd(example, objective, batches, warmup, period, delay, optimizer=sgd):
    """Local SGD on 2 replicas in one process, plain PyTorch: each steps SGD with momentum
    on its half of the batch (the warm-up on the mean of both halves' gradients, the
    global batch's); averaged after local step 0, period, 2 period, ...; with `delay`
    k > 0, the average of the parameters after step t is applied after step t + k (or
    first thing after the step the next one is due) keeping each replica's own change
    since then (runtime/local_sgd.py). (losses per replica, states per replica)."""
    replicas = [copy.deepcopy(example.model) for _ in range(2)]
    params = [[p for p in m.parameters() if p.requires_grad] for m in replicas]
    opts = [optimizer(ps) for ps in params]
    losses, pending = [[], []], None
    for t, batch in enumerate(batches):
        for r in range(2):
            opts[r].zero_grad(set_to_none=True)
            loss = objective.loss(replicas[r], [x.chunk(2)[r] for x in batch])
            loss.backward()
            losses[r].append(float(loss))
        if t < warmup:
            for pair in zip(*params):
                mean = (pair[0].grad + pair[1].grad) / 2
                for p in pair:
                    p.grad = mean.clone()
        for opt in opts:
            opt.step()
        if t < warmup:
            continue
        due = (t - warmup) % period == 0
        with torch.no_grad():
            if pending is not None and (due or t - pending[0] >= delay):
                _, snaps, avg = pending
                for r in range(2):
                    for p, s, a in zip(params[r], snaps[r], avg):
                        p.sub_(s).add_(a)
                pending = None
            if due:
                snaps = [[p.detach().clone() for p in ps] for ps in params]
                avg = [(a + b) / 2 for a, b in zip(*snaps)]
                if delay:
                    pending = (t, snaps, avg)
                else:
                    for ps in params:
                        for p, a in zip(ps, avg):
                            p.copy_(a)
    return losses, [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in replicas]


@case(world=2)
def local_sgd_overlapped_average_matches_a_one_process_simulation():
    """Layout.local_sgd_overlap = k: each average is applied k local steps late with
    the rank's own change kept (or when the next is due, period 2 and k = 3 below), with
    SGD and momentum and with AdamW.
    Against a one-process simulation of exactly that (parity tolerance); the simulation
    of the average applied at once is outside the tolerance (the test tells the two
    apart). A save right after an averaging step waits for its average: the ranks then
    hold the average, bitwise alike."""
    example = gpt2()
    objective, flat = Objective.from_example(example.batch, None, example.loss_fn)
    init = {k: v.clone() for k, v in example.model.state_dict().items()}
    rank, warmup = dist.get_rank(), 2
    for period, delay, steps, averaged, opt in ((2, 1, 7, 2, sgd), (3, 2, 9, 2, sgd),
                                                (2, 3, 8, 2, sgd), (2, 1, 7, 2, adamw)):
        batches = make_batches(flat, steps)
        step = _compile(example, autopar.Layout(dp=2, local_sgd=period, local_sgd_warmup=warmup,
                                                local_sgd_overlap=delay), opt)
        losses = [float(step(*b)) for b in batches]
        sim_losses, sim = _simulated_local_sgd(example, objective, batches, warmup, period,
                                               delay, opt)
        adam = opt is adamw
        report = compare(losses[warmup:], sim_losses[rank][warmup:], step.full_state_dict(),
                         sim[rank], init, adam=adam)
        assert report.ok, (period, delay, opt.__name__, str(report))
        _, at_once = _simulated_local_sgd(example, objective, batches, warmup, period, 0, opt)
        apart = compare(losses[warmup:], sim_losses[rank][warmup:], at_once[rank], sim[rank],
                        init, adam=adam)
        assert not apart.ok, f"period {period}, overlap {delay} ends as without: no test"
        # the last average is still in flight
        assert not step.synchronized and step.schedule.averagings == averaged, \
            (period, delay, step.schedule)
        if delay == 1:  # the last step started an average: a save waits for it
            with tempfile.TemporaryDirectory() as tmp:
                step.save(tmp)
            assert step.synchronized and step.schedule.averagings == averaged + 1
            mine = torch.cat([u.detach().reshape(-1) for u in step.updated])
            everyone = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(everyone, mine)
            assert torch.equal(everyone[0], everyone[1])
        step.close_averaging()
        assert step.schedule.averagings == math.ceil((steps - warmup) / period)
    # on the pipeline runtime (accumulation of 2 micro-batches): the same rule. Its local
    # step's loss is its share of the global batch's, so only the weights are compared:
    # this rank's own (full_state_dict assembles one dp rank's, right where they agree)
    batches = make_batches(flat, 7)
    step = _compile(example, autopar.Layout(dp=2, microbatches=2, local_sgd=2,
                                            local_sgd_warmup=warmup, local_sgd_overlap=1))
    for b in batches:
        step(*b)
    sim_losses, sim = _simulated_local_sgd(example, objective, batches, warmup, 2, 1)
    own = {k: v.detach().clone() for k, v in step._model.state_dict().items()}
    report = compare(sim_losses[rank], sim_losses[rank], own, sim[rank], init, adam=False)
    assert report.ok, ("pipeline runtime", str(report))
    step.close_averaging()
