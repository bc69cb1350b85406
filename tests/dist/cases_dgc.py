"""Deep Gradient Compression (Layout.dgc) on 2 gloo processes: the dense warm-up is
data parallelism bit for bit; the compressed steps match a single-process simulation
of DGC over the same two shards in plain PyTorch (eager autograd, torch.optim.SGD for
the dense tensors), both top-k methods; the ranks stay identical; a checkpoint resumes
bit for bit in the same layout and reshards the residuals' sum into another; a GPT-2
ends near data parallelism's loss; DGC composes with accumulation, pipelines and tp."""

from __future__ import annotations

import copy
import math
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.compiler.ir.batch import Objective
from autopar.costs import DGC_DENSE_BELOW, dgc_kept
from autopar.examples import gpt2
from autopar.runtime import dgc
from autopar.testing import LOSS_RTOL, make_batches
from tests.dist.cases_local_sgd import _learnable, held_out_loss
from tests.dist.registry import case

LR, MOMENTUM, WD = 0.1, 0.9, 1e-3
LOSS_GAP = 0.05  # GPT-2's held-out loss after 200 steps, DGC against dp (measured 1.7%)
BATCH, FEATURES, CLASSES = 16, 32, 8


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)


def _mlp(seed=0) -> nn.Module:
    """Two weights DGC compresses (2,048 and 4,096 values), three biases and a 512-value
    head it sums dense."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, CLASSES))


def _batches(steps, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, FEATURES, generator=gen),
             torch.randint(0, CLASSES, (BATCH,), generator=gen)) for _ in range(steps)]


def _compile(model, layout, optimizer=_sgd):
    x, y = _batches(1)[0]
    return autopar.compile(copy.deepcopy(model), autopar.ClusterSpec.local(2), (x,),
                           F.cross_entropy, optimizer=optimizer, layout=layout,
                           example_targets=(y,))


def _mlp_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _reference_dgc(model, batches, layout, ranks=2, clip=None, loss_of=_mlp_loss):
    """DGC simulated in one process: each of `ranks` workers' share of the global loss's
    gradient by eager autograd, the paper's momentum correction, masking and exact
    top-k per worker, the sum applied as w -= lr * G; small tensors summed dense and
    stepped by torch.optim.SGD with its momentum. Dense steps: plain SGD on the sum.
    `clip`: each worker's gradient (ranks times its share) clipped to clip / sqrt(ranks).
    `loss_of(model, *shard)`: the mean loss of a shard of the batch."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    opt = _sgd(params)
    compressed = [p.numel() >= DGC_DENSE_BELOW for p in params]
    u = [[None] * len(params) for _ in range(ranks)]
    v = [[None] * len(params) for _ in range(ranks)]
    losses = []
    for t, batch in enumerate(batches):
        shares = []
        total = 0.0
        for r in range(ranks):
            shard = [x.chunk(ranks)[r] for x in batch]
            loss = loss_of(model, *shard) / ranks  # this worker's share
            grads = torch.autograd.grad(loss, params)
            norm = ranks * torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
            if clip is not None and t >= layout.dgc_warmup and norm > clip / math.sqrt(ranks):
                grads = [g * (clip / math.sqrt(ranks) / norm) for g in grads]
            shares.append(grads)
            total += loss.item()
        losses.append(total)
        sparsity = dgc.sparsity_at(t, layout.dgc, layout.dgc_warmup, layout.dgc_rampup)
        with torch.no_grad():
            for i, p in enumerate(params):
                p.grad = sum(s[i] for s in shares)
            if sparsity is not None:
                for i, p in enumerate(params):
                    if not compressed[i]:
                        continue
                    summed = torch.zeros_like(p)
                    for r in range(ranks):
                        if u[r][i] is None:  # from SGD's momentum at the switch
                            buf = opt.state[p].get("momentum_buffer")
                            u[r][i] = buf / ranks if buf is not None else torch.zeros_like(p)
                            v[r][i] = torch.zeros_like(p)
                        g = shares[r][i] + WD / ranks * p
                        u[r][i] = MOMENTUM * u[r][i] + g
                        v[r][i] = v[r][i] + u[r][i]
                        k = dgc_kept(p.numel(), sparsity)
                        idx = v[r][i].abs().flatten().topk(k).indices
                        summed.view(-1)[idx] += v[r][i].view(-1)[idx]
                        u[r][i].view(-1)[idx] = 0
                        v[r][i].view(-1)[idx] = 0
                    p -= LR * summed
                    p.grad = None
                    opt.state[p].pop("momentum_buffer", None)
            opt.step()
    return losses, {k: t.detach().clone() for k, t in model.state_dict().items()}


def _check_close(step, losses, ref_losses, ref_state, what):
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert rel <= LOSS_RTOL, f"{what}: losses {losses} vs reference {ref_losses}"
    got = step.full_state_dict()
    for name, want in ref_state.items():
        if not want.is_floating_point():
            continue
        err = (got[name] - want).abs().max().item()
        assert err <= 1e-5 * max(1.0, want.abs().max().item()), f"{what}: {name} off by {err:.2e}"


@case(world=2)
def dgc_warmup_is_data_parallel_bit_for_bit():
    model = _mlp()
    dp = _compile(model, autopar.Layout(dp=2))
    compressed = _compile(model, autopar.Layout(dp=2, dgc=0.999, dgc_warmup=3, dgc_rampup=4))
    for x, y in _batches(3):
        assert torch.equal(dp(x, y), compressed(x, y))
    mine, theirs = compressed.full_state_dict(), dp.full_state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert compressed.stats["compressed_steps"] == 0


@case(world=2)
def dgc_matches_a_single_process_simulation_with_sgd_momentum():
    """Two dense steps, a ramp-up through 0.75, 0.9375 and 0.984375, then 0.99: the
    loss and every weight against the simulation, for exact and sampled top-k and with
    local clipping; the ranks' weights agree bitwise; each rank sent k values (+ k
    indices) per compressed tensor."""
    model = _mlp()
    batches = _batches(8)
    layout = autopar.Layout(dp=2, dgc=0.99, dgc_warmup=2, dgc_rampup=3)
    ref_losses, ref_state = _reference_dgc(model, batches, layout)
    for method in ("exact", "sampled", "clipped"):
        if method == "clipped":  # a norm the worker gradients exceed from the first step
            ref_losses, ref_state = _reference_dgc(model, batches, layout, clip=0.5)
        step = _compile(model, layout.replace(dgc_topk="exact" if method == "clipped" else method,
                                              dgc_clip=0.5 if method == "clipped" else None))
        losses = [float(step(x, y)) for x, y in batches]
        _check_close(step, losses, ref_losses, ref_state, method)
        for name, w in step.full_state_dict().items():
            theirs = w.clone()
            dist.broadcast(theirs, 0)
            assert torch.equal(w, theirs), f"{method}: {name} differs between ranks"
        sizes = [p.numel() for p in step.updated if p.numel() >= DGC_DENSE_BELOW]
        want = sum(dgc_kept(n, dgc.sparsity_at(t, 0.99, 2, 3)) for t in range(2, 8) for n in sizes)
        assert step.stats["sent_values"] == want and step.stats["compressed_steps"] == 6
        assert step.stats["whole_values"] == 6 * sum(sizes)
        assert step.stats["sent_bytes"] == 8 * want  # fp32 values and int32 indices


@case(world=2)
def dgc_sending_everything_without_masking_is_the_dense_exchange():
    """k = numel (a sparsity under one element) and momentum masking off: DGC's update is
    SGD with momentum and weight decay on the summed gradient, as the dense step's."""
    model = _mlp()
    dense = _compile(model, autopar.Layout(dp=2))
    everything = _compile(model, autopar.Layout(dp=2, dgc=1e-9))
    everything.momentum_masking = False
    for x, y in _batches(5):
        a, b = dense(x, y), everything(x, y)
        assert abs(float(a) - float(b)) <= LOSS_RTOL * abs(float(a)), (a, b)
    assert everything.stats["sent_values"] == everything.stats["whole_values"] > 0
    mine, want = everything.full_state_dict(), dense.full_state_dict()
    for name in want:
        torch.testing.assert_close(mine[name], want[name], rtol=1e-5, atol=1e-6)


@case(world=2)
def dgc_sends_500_times_fewer_bytes_at_99_9_percent():
    step = _compile(_mlp(), autopar.Layout(dp=2, dgc=0.999))
    for x, y in _batches(3):
        step(x, y)
    assert step.stats["sent_bytes"] == 8 * step.stats["sent_values"]
    assert 4 * step.stats["whole_values"] >= 500 * step.stats["sent_bytes"], step.stats


@case(world=2)
def dgc_checkpoint_resumes_bit_for_bit_and_reshards_the_residual_sums():
    model = _mlp()
    batches = _batches(6)
    layout = autopar.Layout(dp=2, dgc=0.9, dgc_warmup=1, dgc_rampup=2)
    straight = _compile(model, layout)
    for x, y in batches:
        straight(x, y)
    with tempfile.TemporaryDirectory() as tmp:
        path = [tmp + "/ckpt"]
        dist.broadcast_object_list(path, 0)
        first = _compile(model, layout)
        for x, y in batches[:3]:
            first(x, y)
        residual = {id(w): first.optimizer.state[w][dgc.RESIDUAL].clone()
                    for w, c in zip(first.updated, first.compressed) if c}
        first.save(path[0])
        again = _compile(model, layout)
        again.load(path[0])
        assert again.steps == 3
        for x, y in batches[3:]:
            again(x, y)
        mine, want = again.full_state_dict(), straight.full_state_dict()
        assert all(torch.equal(mine[k], want[k]) for k in want), "resume is not bit-exact"
        # another layout (a different final sparsity): each rank takes the sum / dp
        other = _compile(model, layout.replace(dgc=0.95))
        other.load(path[0])
        for w, c, w0 in zip(other.updated, other.compressed, first.updated):
            if c:
                total = residual[id(w0)].clone()
                dist.all_reduce(total)
                assert torch.allclose(other.optimizer.state[w][dgc.RESIDUAL] * 2, total,
                                      atol=1e-7)
        dist.barrier()


@case(world=2)
def dgc_gpt2_ends_near_data_parallel_loss():
    """GPT-2 (transformers, a small config), SGD with momentum, 200 steps of learnable
    sequences: DGC at 99% (8 dense steps, a ramp-up of 32) against data parallelism, the
    final models compared on the same held-out batch. Measured first (2026-11-26, this
    configuration, deterministic on CPU): held-out loss 5.55 at the start, data
    parallelism 1.201, DGC 1.221 (+1.7%; at 99.9% 1.759, +46%: docs/communication.md).
    Early on DGC lags (its residuals need time to be sent: 4.72 against 2.93 at step
    40); LOSS_GAP bounds where it ends, with room for rounding across torch builds."""
    example = gpt2()
    batches = _learnable(example, 200)
    held_out = _learnable(example, 1, seed=99)[0]
    finals = {}
    for name, layout in (("dp", autopar.Layout(dp=2)),
                         ("dgc", autopar.Layout(dp=2, dgc=0.99, dgc_warmup=8, dgc_rampup=32))):
        finals[name], step = held_out_loss(
            example, layout, batches, held_out,
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    assert finals["dp"] < 0.5 * 5.5, finals  # it learnt
    assert abs(finals["dgc"] - finals["dp"]) <= LOSS_GAP * finals["dp"], finals
    # 160 steps at 0.99 past the ramp-up (whose stages send more)
    assert step.stats["sent_values"] < 0.05 * step.stats["whole_values"], step.stats


def _pipeline_parity(layout, world):
    """GPT-2 on the pipeline runtime with DGC: against the simulation over dp shards."""
    example = gpt2()
    objective, flat = Objective.from_example(example.batch, None, example.loss_fn)
    batches = make_batches(flat, 7)
    ref_losses, ref_state = _reference_dgc(example.model, batches, layout,
                                           loss_of=lambda m, *b: objective.loss(m, list(b)))
    step = autopar.compile(copy.deepcopy(example.model), autopar.ClusterSpec.local(world),
                           example.batch, example.loss_fn, optimizer=_sgd, layout=layout)
    losses = [float(step(*b)) for b in batches]
    _check_close(step, losses, ref_losses, ref_state, str(layout))
    assert step.stats["compressed_steps"] == 7 - layout.dgc_warmup


@case(world=2)
def dgc_composes_with_gradient_accumulation():
    _pipeline_parity(autopar.Layout(dp=2, microbatches=2, dgc=0.99, dgc_warmup=2,
                                    dgc_rampup=3), 2)


@case(world=4)
def dgc_composes_with_pipeline_stages():
    _pipeline_parity(autopar.Layout(dp=2, pp=2, microbatches=2, dgc=0.99, dgc_warmup=2,
                                    dgc_rampup=3), 4)


@case(world=4)
def dgc_composes_with_tensor_parallelism():
    """Each tp rank compresses its own block of a split weight, so the selection is not
    the whole tensor's: with every value sent and masking off it is the dense dp x tp
    step; its warm-up is that step bit for bit."""
    example = gpt2()
    _, flat = Objective.from_example(example.batch, None, example.loss_fn)
    batches = make_batches(flat, 4)

    def run(layout, masking=True):
        step = autopar.compile(copy.deepcopy(example.model), autopar.ClusterSpec.local(4),
                               example.batch, example.loss_fn, optimizer=_sgd, layout=layout)
        if hasattr(step, "momentum_masking"):  # a DGC step
            step.momentum_masking = masking
        return [step(*b) for b in batches], step

    dense_losses, dense = run(autopar.Layout(dp=2, tp=2))
    warm_losses, warm = run(autopar.Layout(dp=2, tp=2, dgc=0.999, dgc_warmup=4))
    assert all(torch.equal(a, b) for a, b in zip(dense_losses, warm_losses))
    mine, want = warm.full_state_dict(), dense.full_state_dict()
    assert all(torch.equal(mine[k], want[k]) for k in want)
    all_losses, everything = run(autopar.Layout(dp=2, tp=2, dgc=1e-9), masking=False)
    assert everything.stats["sent_values"] == everything.stats["whole_values"] > 0
    for a, b in zip(dense_losses, all_losses):
        assert abs(float(a) - float(b)) <= LOSS_RTOL * abs(float(a)), (a, b)
    mine, want = everything.full_state_dict(), dense.full_state_dict()
    for name in want:
        torch.testing.assert_close(mine[name], want[name], rtol=1e-5, atol=1e-6)
