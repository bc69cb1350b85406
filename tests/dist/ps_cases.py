"""Parameter-server jobs for tests/dist/test_ps.py.

Every process of a job runs `python -m tests.dist.ps_cases CASE --out F --servers S`
(started by autopar.ps_worker.PSJob: real processes, real TensorPipe RPC, a real gloo
group among the trainers where the dense policy all-reduces). Servers serve; trainer 0
writes the case's measurements to F as JSON, and the test judges them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import autopar
from autopar.examples import ctr
from autopar.layout import Layout, PSLayout
from autopar.runtime import ps as ps_runtime


def _barrier(step, name: str) -> None:
    """Every trainer reached `name` (through the job's store)."""
    step.transport.set_flag(f"case/{name}/{step.trainer}")
    for j in range(step.trainers):
        while not step.transport.has_flag(f"case/{name}/{j}"):
            time.sleep(0.02)


def _example(batch: int = 8):
    # small tables with a skewed id distribution: batches repeat ids and leave rows out
    return ctr(fields=2, rows=64, dim=4, hot=3, batch=batch)


def _compile(ex, factory, ps: PSLayout):
    world = int(os.environ["WORLD_SIZE"])
    return autopar.compile(ex.model, None, ex.batch, ex.loss_fn, factory,
                           Layout(dp=world - ps.servers, ps=ps))


def _reference(ex, initial: dict, factory, batches) -> tuple[dict, list[float]]:
    """Single-process PyTorch on each whole global batch."""
    model = ctr(fields=2, rows=64, dim=4, hot=3, batch=8).model
    model.load_state_dict(initial)
    opt = factory(list(model.parameters()))
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = ex.loss_fn(model(*batch), *batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _server_params(step) -> dict:
    """The job's parameters as the servers (and, for all-reduced dense ones, this
    trainer) hold them."""
    out = {step.program.tables[t].name: step.table(t) for t in range(len(step.program.tables))}
    if step.on_servers:
        held = [step.server_state(s)["dense"] for s in range(step.layout.servers)]
        for i, e in enumerate(step.program.dense):
            s = step.owner[i]
            out[e.name] = held[s][[k for k in range(i + 1) if step.owner[k] == s].index(i)]
    else:
        for p, e in zip(step.params, step.program.dense):
            out[e.name] = p.detach().clone()
    return out


def case_sync(args, optimizer: str, dense: str) -> dict:
    """sync: the servers' tables and the dense parameters equal single-process training
    on the whole global batch; untouched rows are bitwise unchanged; the bytes pushed are
    the unique ids' rows, counted; a request without the job's token changes nothing."""
    ex = _example()
    initial = {k: v.detach().clone() for k, v in ex.model.state_dict().items()}
    factory = {"sgd": lambda p: torch.optim.SGD(p, lr=0.5),
               "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.3)}[optimizer]
    step = _compile(ex, factory, PSLayout(servers=args.servers, mode="sync", dense=dense))
    if step.role == "server":
        step.serve()
        return None
    batches = ex.batches(4)
    expected_push = 0
    for batch in batches:
        step(*batch)
        mine = batch[0].chunk(step.trainers)[step.trainer]
        for f in range(mine.shape[1]):  # each field's bag is its own table and pull
            expected_push += mine[:, f].unique().numel() * (8 + 4 * 4)
    _barrier(step, "trained")
    out: dict = {"pushed_bytes": step.stats.pushed_bytes, "expected_push": expected_push}
    if step.trainer == 0:
        want, ref_losses = _reference(ex, initial, factory, batches)
        got = _server_params(step)
        out["max_diff"] = {k: float((got[k] - want[k]).abs().max()) for k in want}
        touched = [set() for _ in step.program.tables]
        for batch in batches:
            for f in range(batch[0].shape[1]):
                touched[f] |= set(batch[0][:, f].flatten().tolist())
        untouched_equal, untouched = True, 0
        for t, spec in enumerate(step.program.tables):
            rows = [r for r in range(spec.rows) if r not in touched[t]]
            untouched += len(rows)
            untouched_equal &= torch.equal(got[spec.name][rows], initial[spec.name][rows])
        out.update(untouched=untouched, untouched_equal=bool(untouched_equal))
        out["state"] = step.server_state(0)["stats"]
    _barrier(step, "checked")
    if step.trainer == 1:  # the stray requests, after trainer 0 read the tables
        before = step.server_state(0)["shards"][0].clone()
        secret = step.transport._secret
        step.transport._secret = b"not-the-job-token"
        rows = [(torch.tensor([0, 1]), torch.full((2, 4), 1e6))] + [
            (torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4))] * (len(step.program.tables) - 1)
        refused = []
        try:
            step.transport.call(0, "push", rows, []).wait()
        except Exception as exc:  # noqa: BLE001 - the error as RPC hands it back
            refused.append(str(exc))
        step.transport._secret = secret
        mac = ps_runtime._mac(secret, step.transport.name, 1, "push")  # replay of seq 1
        try:
            torch.distributed.rpc.rpc_sync(ps_runtime.server_name(0), ps_runtime._rpc_entry,
                                           args=("push", step.transport.name, 1, mac,
                                                 (rows, [])))
        except Exception as exc:  # noqa: BLE001
            refused.append(str(exc))
        after = step.server_state(0)
        out.update(stray_refused=refused, stray_rows_equal=torch.equal(before,
                                                                        after["shards"][0]),
                   refused_count=after["stats"]["refused"])
    step.done()
    return out


class _Tokens(torch.nn.Module):
    """A token model: a table, then a linear head over 6 classes."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 6)

    def forward(self, ids):
        return self.head(torch.tanh(self.table(ids)))


def _token_loss(logits, labels):
    # as users write it: flattened logits, labels with ignored positions
    return torch.nn.functional.cross_entropy(logits.view(-1, 6), labels.view(-1),
                                             ignore_index=-100)


def case_sync_ignore_index(args) -> dict:
    """sync with a loss that divides by the batch's count of labelled tokens: the first
    trainer's half of the batch is mostly ignored, the second's not; the servers' table
    and the trainers' head equal single-process training on the whole batch."""
    torch.manual_seed(0)
    model = _Tokens()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 64, (8, 5), generator=gen)
        labels = torch.randint(0, 6, (8, 5), generator=gen)
        labels[:4, 1:] = -100  # the first half: 4 labelled tokens; the second: 20
        batches.append((ids, labels))
    factory = lambda p: torch.optim.SGD(p, lr=0.5)  # noqa: E731
    world = int(os.environ["WORLD_SIZE"])
    step = autopar.compile(model, None, batches[0][:1],
                           lambda out, labels: _token_loss(out, labels), factory,
                           Layout(dp=world - args.servers, ps=PSLayout(servers=args.servers)),
                           example_targets=batches[0][1:])
    if step.role == "server":
        step.serve()
        return None
    losses = [float(step(*batch)) for batch in batches]
    _barrier(step, "trained")
    out: dict = {}
    if step.trainer == 0:
        ref = _Tokens()
        ref.load_state_dict(initial)
        opt = factory(list(ref.parameters()))
        ref_losses = []
        for ids, labels in batches:
            opt.zero_grad()
            loss = _token_loss(ref(ids), labels)
            loss.backward()
            opt.step()
            ref_losses.append(float(loss))
        got = _server_params(step)
        out["max_diff"] = {k: float((got[k] - v).abs().max())
                           for k, v in ref.state_dict().items()}
        # each trainer's loss is its share of the whole batch's: the two sum to it
        out["ref_losses"] = ref_losses
    out["losses"] = losses
    step.done()
    return out


def case_async(args) -> dict:
    """async: each server applies every push as it comes (exactly W * N updates), and
    the loss on a fixed batch falls below a threshold set by single-process training."""
    ex = _example(batch=32)
    initial = {k: v.detach().clone() for k, v in ex.model.state_dict().items()}
    factory = lambda p: torch.optim.Adagrad(p, lr=0.05)  # noqa: E731
    step = _compile(ex, factory, PSLayout(servers=args.servers, mode="async"))
    if step.role == "server":
        step.serve()
        return None
    steps = 30
    batches = ex.batches(steps)
    for batch in batches:
        step(*batch)
    _barrier(step, "trained")
    out: dict = {}
    if step.trainer == 0:
        evaluate = ex.data(10_000)  # a batch no step trained on
        model = _example().model

        def loss_of(state) -> float:
            model.load_state_dict(state)
            with torch.no_grad():
                return float(ex.loss_fn(model(*evaluate), *evaluate))

        start = loss_of(initial)
        reference = loss_of(_reference(ex, initial, factory, batches)[0])
        final = loss_of(_server_params(step))
        out.update(start=start, reference=reference, final=final, steps=steps,
                   trainers=step.trainers,
                   servers=[step.server_state(s)["stats"] for s in range(args.servers)])
    step.done()
    return out


def case_half_async(args) -> dict:
    """half-async with fraction 0.6 of 3 trainers: each window waits for 2 trainers, or
    for every trainer still training once others are done. No barrier among the
    trainers: a trainer idle at a barrier, not done, is still awaited (a window needs
    it), so each trainer steps and is done; the servers report what they applied."""
    from autopar.runtime.ps import _stats_dict

    ex = _example(batch=12)
    step = _compile(ex, lambda p: torch.optim.SGD(p, lr=0.1),
                    PSLayout(servers=args.servers, mode="half-async", fraction=0.6))
    if step.role == "server":
        return {"server": _stats_dict(step.serve())}
    if step.trainer == 2:  # late: the others pair with each other, and may be done first
        time.sleep(2)
    for k in range(4):
        step(*ex.data(k))
    step.done()
    return {"needed": math.ceil(0.6 * step.trainers), "trainers": step.trainers, "steps": 4}


def case_geo(args) -> dict:
    """geo: the servers add each pushed change as it is, so with integer-valued changes
    the tables equal their initial values plus the sum of every trainer's changes,
    exactly; and a few GEO training steps push only the rows they changed."""
    ex = _example()
    with torch.no_grad():  # integer tables: every sum of integer changes is exact in fp32
        for table in ex.model.tables:
            table.weight.copy_(torch.randint(-50, 50, table.weight.shape))
    initial = {k: v.detach().clone() for k, v in ex.model.state_dict().items()}
    step = _compile(ex, lambda p: torch.optim.SGD(p, lr=0.1),
                    PSLayout(servers=args.servers, mode="geo", geo_k=2))
    if step.role == "server":
        step.serve()
        return None
    specs = step.program.tables

    def deltas(trainer: int):
        gen = torch.Generator().manual_seed(100 + trainer)
        out = []
        for spec in specs:
            ids = torch.randperm(spec.rows, generator=gen)[:20]
            out.append((ids, torch.randint(-5, 6, (20, spec.dim), generator=gen).float()))
        return out

    for _ in range(3):  # three rounds of pushes, each trainer its own changes
        step.push_deltas(deltas(step.trainer), [])
    _barrier(step, "pushed")
    out: dict = {}
    if step.trainer == 0:
        got = {specs[t].name: step.table(t) for t in range(len(specs))}
        exact = True
        for t, spec in enumerate(specs):
            want = initial[spec.name].clone()
            for j in range(step.trainers):
                ids, vals = deltas(j)[t]
                want.index_add_(0, ids, 3 * vals)
            exact &= torch.equal(got[spec.name], want)
        out["exact"] = bool(exact)
    _barrier(step, "checked")
    pushed = step.stats.pushed_rows
    for k in range(4):  # geo_k=2: two pushes of the rows each trainer changed
        step(*ex.data(k))
    out["geo_rows_pushed"] = step.stats.pushed_rows - pushed
    out["geo_rows_touched"] = sum(
        len(set().union(*[set(ex.data(k)[0].chunk(step.trainers)[step.trainer][:, f]
                              .flatten().tolist()) for k in kk]))
        for f in range(len(specs)) for kk in ((0, 1), (2, 3)))
    step.done()
    return out


def case_reshard(args) -> dict:
    """A checkpoint saved by 2 servers after 3 sync steps, loaded by 3 servers, which
    train 3 more: the tables and dense parameters (Adagrad's state resharded with the
    rows) equal 6 steps of single-process training."""
    ex = _example()
    initial = {k: v.detach().clone() for k, v in ex.model.state_dict().items()}
    factory = lambda p: torch.optim.Adagrad(p, lr=0.3)  # noqa: E731
    step = _compile(ex, factory, PSLayout(servers=args.servers, mode="sync", dense="servers"))
    loading = args.servers == 3
    if step.role == "server":
        if loading:
            step.load(args.ckpt)
        step.serve()
        return None
    batches = ex.batches(6)
    if loading:
        step.load(args.ckpt)
    for batch in batches[3:] if loading else batches[:3]:
        step(*batch)
    out: dict = {}
    if step.trainer == 0:
        if loading:
            want, _ = _reference(ex, initial, factory, batches)
            got = _server_params(step)
            out["max_diff"] = {k: float((got[k] - want[k]).abs().max()) for k in want}
            out["servers"] = step.layout.servers
        else:
            step.save(args.ckpt)
            out["saved"] = sorted(os.listdir(args.ckpt))
    _barrier(step, "end")
    step.done()
    return out


CASES = {
    "sync_sgd_allreduce": lambda a: case_sync(a, "sgd", "allreduce"),
    "sync_adagrad_servers": lambda a: case_sync(a, "adagrad", "servers"),
    "sync_ignore_index": case_sync_ignore_index,
    "async": case_async,
    "half_async": case_half_async,
    "geo": case_geo,
    "reshard": case_reshard,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--servers", type=int, required=True)
    parser.add_argument("--ckpt", default=None, help="a checkpoint directory")
    args = parser.parse_args()
    result = CASES[args.case](args)
    rank = int(os.environ["RANK"])
    if result is not None:  # a trainer's measurements (or a server's, where it gives any)
        path = f"{args.out}.{rank}.json"
        with open(path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
