"""The data-block master (runtime/blocks.py): timeout requeue, stale-lease refusal,
epoch rollover, max failures, save/restore; a property test over interleavings; and
workers that are real processes over a real TCPStore, one of them SIGKILLed holding a
lease."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.runtime.blocks import (
    BlockMaster,
    BlockQueues,
    BlockSampler,
    JobTokenError,
    Lease,
)

TOKEN = "the-job-token"


def test_a_lease_that_times_out_returns_its_block_and_the_late_report_is_refused():
    q = BlockQueues(blocks=2, timeout=10.0)
    first = q.lease("w0", now=0.0)
    assert first == Lease(0, 1, 0)
    assert q.expire(now=10.0) == [0]  # w0 died holding it
    again = q.lease("w1", now=11.0)
    assert again == Lease(0, 2, 0)  # the same block, a new attempt
    assert not q.finish(first, now=12.0)  # w0's late report names a dead attempt
    assert q.finish(again, now=12.0)
    assert not q.finish(again, now=12.5)  # reported once
    assert q.done == [0]


def test_the_epoch_rolls_over_when_every_block_is_done():
    q = BlockQueues(blocks=3, timeout=5.0)
    leases = [q.lease("w", now=0.0) for _ in range(3)]
    assert q.lease("w", now=0.0) is None  # all pending: wait
    for lease in leases:
        assert q.finish(lease, now=1.0)
    assert q.epoch == 1 and q.todo == [0, 1, 2] and q.done == []
    assert q.lease("w", now=2.0) == Lease(0, 1, 1)
    assert not q.finish(leases[0], now=2.0)  # a lease of the last epoch


def test_a_block_that_keeps_failing_goes_to_failed_and_leaves_the_epoch():
    q = BlockQueues(blocks=2, timeout=1.0, max_failures=2)
    for now in (0.0, 2.0):
        lease = q.lease("w", now=now)
        assert lease.block == 0
        q.expire(now + 1.0)
    assert q.failed == [0] and q.todo == [1]
    assert q.finish(q.lease("w", now=5.0), now=5.0)
    assert q.epoch == 1 and q.todo == [1]  # the failed block is skipped from now on


def test_a_saved_state_restores_with_its_leases_given_back():
    q = BlockQueues(blocks=3, timeout=100.0)
    done = q.lease("w", now=0.0)
    held = q.lease("w", now=0.0)
    q.finish(done, now=1.0)
    saved = q.state_dict()
    restored = BlockQueues.from_state_dict(saved).restored(latest=q.generation)
    assert restored.todo == [1, 2] and restored.done == [0] and not restored.pending
    assert not restored.finish(held, now=51.0)  # the holder of that lease is gone
    assert restored.lease("w", now=51.0) == Lease(1, 2, 0, generation=1)


def test_bad_arguments_say_what_works():
    with pytest.raises(ValueError, match="blocks >= 1, timeout > 0"):
        BlockQueues(blocks=0, timeout=1.0)


# -- any interleaving -------------------------------------------------------------------

_ops = st.lists(st.tuples(st.sampled_from(["lease", "finish", "stall", "late", "expire",
                                           "crash", "restore"]), st.integers(0, 3)),
                min_size=1, max_size=120)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_any_interleaving_trains_each_block_exactly_once_per_epoch(ops):
    """Workers lease and finish; a worker stalls (its lease may expire) and reports late;
    a worker crashes (its leases are never reported); time passes leases' deadlines; the
    job restores its last checkpoint (model and master together, every process
    restarted). In the committed history each epoch trains every block exactly once,
    and a report the master accepts is always for a lease still current."""
    blocks = 4
    q = BlockQueues(blocks=blocks, timeout=3.0, max_failures=1_000)
    now = 0.0
    held: dict[int, list[Lease]] = {w: [] for w in range(4)}
    slow: list[Lease] = []
    committed: list[tuple[int, int]] = []  # (epoch, block) in the committed model
    checkpoint = (q.state_dict(), list(committed))
    for op, worker in ops:
        now += 1.0
        if op == "lease" and (lease := q.lease(f"w{worker}", now)) is not None:
            held[worker].append(lease)
        elif op in ("finish", "late") and (held[worker] if op == "finish" else slow):
            lease = held[worker].pop(0) if op == "finish" else slow.pop(0)
            if q.finish(lease, now):
                committed.append((lease.epoch, lease.block))
        elif op == "stall":
            slow += held[worker]
            held[worker] = []
        elif op == "expire":
            now += 5.0
            q.expire(now)
        elif op == "crash":
            held[worker] = []
        elif op == "restore":  # every process restarts from the checkpoint
            q = BlockQueues.from_state_dict(checkpoint[0]).restored(latest=q.generation)
            committed = list(checkpoint[1])
            held, slow = {w: [] for w in range(4)}, slow + [x for v in held.values() for x in v]
        if op in ("finish", "expire") and worker == 0:  # checkpoint now and then
            checkpoint = (q.state_dict(), list(committed))
    per_epoch = Counter(committed)
    assert all(n == 1 for n in per_epoch.values()), per_epoch
    for epoch in range(q.epoch):  # every finished epoch has every block once
        assert sorted(b for e, b in committed if e == epoch) == list(range(blocks))


# -- real processes over a real TCPStore ----------------------------------------------------

def _worker(port: int, name: str, blocks: int, out, hold: bool) -> None:
    """Train epoch 0's blocks until none is left; `hold`: take one lease and keep it."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    master = BlockMaster(store, blocks, timeout=_LEASE_S, worker=name, token=TOKEN)
    while True:
        lease = master.lease()
        if lease is None:  # the rest are leased to others: one may time out
            time.sleep(0.05)
            continue
        if lease.epoch > 0:  # epoch 0 is done
            master.release(lease)
            return
        if hold:  # the worker to be killed: it keeps its lease until it dies
            out.put(("holding", lease.block, lease.attempt))
            time.sleep(600)
        time.sleep(0.01)  # "trains" the block
        if master.finish(lease):
            out.put(("done", lease.block, lease.attempt))


# the lease timeout of the killed-worker test: the killed worker's lease expires after it,
# and a live worker must finish each block it leases within it, on a loaded 2-core host
# too (a lease that expires there counts its block failed once more)
_LEASE_S = 5.0


def test_workers_over_a_tcpstore_survive_one_killed_holding_a_lease():
    blocks = 12
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    BlockMaster(store, blocks, timeout=_LEASE_S, token=TOKEN)  # the state exists before the workers start
    ctx = mp.get_context("spawn")
    # the killed process gets a queue of its own: it may die holding the queue's lock
    told, out = ctx.Queue(), ctx.Queue()
    doomed = ctx.Process(target=_worker, args=(store.port, "doomed", blocks, told, True))
    doomed.start()
    assert told.get(timeout=120)[:2] == ("holding", 0)
    os.kill(doomed.pid, signal.SIGKILL)  # a real death with a lease held
    doomed.join()
    workers = [ctx.Process(target=_worker, args=(store.port, f"w{i}", blocks, out, False))
               for i in range(2)]
    for w in workers:
        w.start()
    done = [out.get(timeout=120) for _ in range(blocks)]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert out.empty()
    # each block exactly once, the killed worker's too (leased a second time)
    assert sorted(block for _, block, _ in done) == list(range(blocks))
    assert ("done", 0, 2) in done
    state = BlockMaster(store, blocks, timeout=_LEASE_S, token=TOKEN).state()
    assert state.epoch == 1 and state.failures == {0: 1} and not state.pending


def test_a_sampler_reports_only_blocks_whose_samples_were_all_trained():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    master = BlockMaster(store, blocks=3, timeout=60.0, token=TOKEN)
    sampler = BlockSampler(master, block_size=4, samples=10)  # the last block has 2
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=3, sampler=sampler)
    seen, batches = [], iter(loader)
    seen += next(batches).tolist()  # 3 samples trained: no block complete
    assert sampler.commit(trained=3) == [] and master.state().done == []
    seen += next(batches).tolist()  # 6: block 0 complete
    sampler.commit(trained=6)
    assert master.state().done == [0]
    for batch in batches:
        seen += batch.tolist()
    assert sampler.commit(trained=len(seen)) == []
    assert sorted(seen) == list(range(10)) and master.state().epoch == 1


def test_the_master_in_a_store_restores_a_checkpoint_and_refuses_leases_of_before():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    master = BlockMaster(store, blocks=4, timeout=60.0, token=TOKEN)
    assert master.finish(master.lease())
    saved = master.state_dict()  # saved with the model's checkpoint
    after = master.lease()  # taken after the checkpoint; then every process restarts
    assert master.finish(master.lease())
    master.load_state_dict(saved)
    state = master.state()
    assert state.done == [0] and state.todo == [1, 2, 3] and state.generation == 1
    assert not master.finish(after)  # a lease from before the restore
    with pytest.raises(ValueError, match="already holds a block master with blocks=4"):
        BlockMaster(store, blocks=5, timeout=60.0, token=TOKEN)


def test_the_masters_state_is_saved_and_restored_with_the_model_checkpoint(tmp_path):
    """`step.save(path, extra=master.state_dict())` writes the data position with the
    weights, atomically; loading the checkpoint returns it, and the master rolls back
    with the model: the blocks trained after the checkpoint are trained again."""
    import autopar
    from autopar.examples import mlp

    ex = mlp()
    step = autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=autopar.Layout(),
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    master = BlockMaster(store, blocks=4, timeout=60.0, token=TOKEN)
    step(*ex.batch)
    assert master.finish(master.lease())
    step.save(tmp_path / "ckpt", extra={"blocks": master.state_dict()})
    saved_weights = {k: v.clone() for k, v in step.full_state_dict().items()}
    step(*ex.batch)  # trained after the checkpoint, then the job dies
    assert master.finish(master.lease())
    extra = step.load(tmp_path / "ckpt")
    master.load_state_dict(extra["blocks"])
    assert master.state().done == [0] and master.state().todo == [1, 2, 3]
    for name, value in step.full_state_dict().items():
        assert torch.equal(value, saved_weights[name]), name


# -- the job's token ------------------------------------------------------------------------

_STRAY = """
import json, sys
import torch.distributed as dist
from autopar.runtime.blocks import BlockMaster, JobTokenError

port, prefix = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore("127.0.0.1", port, is_master=False)
outcomes = {}
for name, token in (("no token", None), ("wrong token", "guessed")):
    try:
        master = BlockMaster(store, 4, timeout=60.0, prefix=prefix, token=token)
        master.lease()
        outcomes[name] = "leased"
    except JobTokenError as e:
        outcomes[name] = "JobTokenError: " + str(e)
# what a client can do with the store itself: overwrite what it can name
store.set(prefix + "/state", b"{}")
store.set(prefix + "/challenge", json.dumps({"nonce": "x", "mac": "y"}).encode())
print(json.dumps(outcomes))
"""


def test_a_stray_client_without_the_jobs_token_is_refused_and_changes_nothing():
    """A separate process reaching the job's store: without the token, or with another,
    it cannot open the master (so cannot lease, report or reset), and what it writes to
    the store's keys it can name leaves the job's state as it was."""
    import json
    import subprocess
    import sys

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    master = BlockMaster(store, blocks=4, timeout=60.0, prefix="job", token=TOKEN)
    lease = master.lease()
    before = master.state_dict()
    env = {**os.environ, "AUTOPAR_JOB_TOKEN": ""}
    proc = subprocess.run([sys.executable, "-c", _STRAY, str(store.port), "job"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcomes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcomes["no token"].startswith(
        "JobTokenError: the block master at 'job' needs the job's token")
    assert outcomes["wrong token"].startswith(
        "JobTokenError: refused: this process does not hold the token")
    assert master.state_dict() == before  # nothing leased, reported or reset
    assert master.finish(lease)  # the job goes on
    with pytest.raises(JobTokenError, match="does not hold the token"):
        BlockMaster(store, blocks=4, timeout=60.0, prefix="job", token="guessed")
    # the stray overwrote the challenge: a process of the job that starts now (a
    # restarted worker) still opens the master, and sees the job's state
    joined = BlockMaster(store, blocks=4, timeout=60.0, prefix="job", token=TOKEN)
    assert joined.state_dict() == master.state_dict()
    assert joined.lease() is not None
