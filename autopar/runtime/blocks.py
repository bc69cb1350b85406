"""The data-block master: a data set cut into blocks, leased to workers, each block
trained exactly once per epoch in the committed model.

The design of EDL's master (TODO / PENDING / DONE queues, a timeout that returns a
block whose worker died), with what at-least-once delivery left open closed:

- A lease is (block, attempt). Leasing a block again after its lease expired raises its
  attempt, so the late report of the first worker names an attempt that is no longer
  current and is refused (`finish` returns False): a block is reported done once.
- A block whose leases expire `max_failures` times goes to FAILED instead of TODO; the
  state says which, and later epochs skip it.
- When TODO and PENDING are empty the epoch is over: DONE goes back to TODO (in the
  original order), the epoch count rises.
- The state is a small JSON document (`BlockQueues.state_dict`): a checkpoint saves it
  with the model, and loading both rolls the data position back with the weights, so a
  block done after the checkpoint is done again, once, after a restart.

`BlockQueues` is the state machine, a pure function of its calls and the clock passed
in. `BlockMaster` keeps that state in a c10d Store (the TCPStore torchrun's agent
hosts for rendezvous, or any other): every operation reads the state, applies itself
and writes it back with the store's compare-and-set, retrying when another worker
wrote first. No process holds the state, so the death of any worker loses nothing;
overdue leases are expired by whichever worker calls next. `BlockSampler` is a
`torch.utils.data.Sampler` over leased blocks for a plain DataLoader.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.utils.data import Sampler


@dataclass(frozen=True)
class Lease:
    """Block `block` of epoch `epoch`, leased for the `attempt`-th time (from 1) in the
    master's `generation` (raised by every restore from a checkpoint, so a lease taken
    before a restore never equals one taken after it)."""

    block: int
    attempt: int
    epoch: int
    generation: int = 0


@dataclass
class BlockQueues:
    """TODO, PENDING, DONE and FAILED blocks of one data set (`blocks` blocks), with
    leases that expire `timeout` seconds after they are taken."""

    blocks: int
    timeout: float
    max_failures: int = 3
    epoch: int = 0
    generation: int = 0  # restores so far
    todo: list[int] = field(default_factory=list)
    # block -> [attempt, deadline, worker, generation]
    pending: dict[int, list] = field(default_factory=dict)
    done: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    attempts: dict[int, int] = field(default_factory=dict)  # block -> leases so far this epoch
    failures: dict[int, int] = field(default_factory=dict)  # block -> expired leases, ever

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.timeout <= 0 or self.max_failures < 1:
            raise ValueError(f"a block master needs blocks >= 1, timeout > 0 and "
                             f"max_failures >= 1; got blocks={self.blocks}, "
                             f"timeout={self.timeout}, max_failures={self.max_failures}")
        if not (self.todo or self.pending or self.done or self.failed):
            self.todo = list(range(self.blocks))

    def lease(self, worker: str, now: float) -> Lease | None:
        """The next TODO block for `worker`, or None while every block is pending or
        done (the caller waits, or the epoch rolls over when all are done)."""
        self.expire(now)
        self._roll_over()
        if not self.todo:
            return None
        block = self.todo.pop(0)
        attempt = self.attempts.get(block, 0) + 1
        self.attempts[block] = attempt
        self.pending[block] = [attempt, now + self.timeout, worker, self.generation]
        return Lease(block, attempt, self.epoch, self.generation)

    def finish(self, lease: Lease, now: float) -> bool:
        """Report `lease`'s block trained. False (nothing changes) when the lease is not
        the block's current one: it expired and was leased again, or the epoch moved on."""
        self.expire(now)
        if not self._current(lease):
            return False
        del self.pending[lease.block]
        self.done.append(lease.block)
        self._roll_over()
        return True

    def release(self, lease: Lease, now: float) -> bool:
        """Give a lease back untrained (a worker that stops cleanly): its block returns to
        TODO at once, without counting as a failure. False for a lease not current."""
        self.expire(now)
        if not self._current(lease):
            return False
        del self.pending[lease.block]
        self.todo.insert(0, lease.block)
        return True

    def _current(self, lease: Lease) -> bool:
        held = self.pending.get(lease.block)
        return lease.epoch == self.epoch and held is not None and \
            (held[0], held[3]) == (lease.attempt, lease.generation)

    def expire(self, now: float) -> list[int]:
        """Return the blocks whose leases are past their deadline to the front of TODO
        (they are the oldest work), or to FAILED after `max_failures` expiries; the
        blocks expired."""
        out, again = [], []
        for block, (_, deadline, _, _) in sorted(self.pending.items()):
            if deadline <= now:
                del self.pending[block]
                self.failures[block] = self.failures.get(block, 0) + 1
                if self.failures[block] >= self.max_failures:
                    self.failed.append(block)
                else:
                    again.append(block)
                out.append(block)
        self.todo = again + self.todo
        return out

    def _roll_over(self) -> None:
        if self.todo or self.pending or not self.done:
            return
        self.epoch += 1
        self.todo, self.done, self.attempts = sorted(self.done), [], {}

    def state_dict(self) -> dict:
        """The whole state as JSON-able data (what a checkpoint saves)."""
        return {"blocks": self.blocks, "timeout": self.timeout,
                "max_failures": self.max_failures, "epoch": self.epoch,
                "generation": self.generation, "todo": self.todo,
                "pending": {str(k): v for k, v in self.pending.items()}, "done": self.done,
                "failed": self.failed, "attempts": {str(k): v for k, v in self.attempts.items()},
                "failures": {str(k): v for k, v in self.failures.items()}}

    @classmethod
    def from_state_dict(cls, state: dict) -> BlockQueues:
        fields = dict(state)
        for key in ("pending", "attempts", "failures"):
            fields[key] = {int(k): v for k, v in state[key].items()}
        return cls(**fields)

    def restored(self, latest: int = 0) -> BlockQueues:
        """This state as a restart finds it: the leases held when it was saved belong to
        processes that no longer run, so their blocks go back to TODO first; and the
        generation rises above `latest` (the generation of the state being replaced,
        whose leases may be newer than this checkpoint), so no lease of before the
        restore is ever current again."""
        out = BlockQueues.from_state_dict(self.state_dict())
        out.generation = max(out.generation, latest) + 1
        for block in sorted(out.pending):
            del out.pending[block]
            out.todo.insert(0, block)
        return out


TOKEN_ENV = "AUTOPAR_JOB_TOKEN"


class JobTokenError(PermissionError):
    """A process without the job's token tried to use its block master."""


class BlockMaster:
    """BlockQueues kept in a c10d Store under `prefix`, shared by every worker of a job.

    Create it on every worker with the same store and arguments; the first to arrive
    writes the initial state. Each call is one read and one compare-and-set of the
    state (retried on a conflict).

    The job's token (`token`, default the launcher's environment variable
    AUTOPAR_JOB_TOKEN) keeps other processes out: a c10d TCPStore authenticates no one
    and listens on every interface, so whoever reaches its port can read and write any
    key. Here
    - the state lives under a key derived from the token (HMAC-SHA256), which a process
      without it cannot name;
    - the first worker leaves a challenge (a nonce and its HMAC) under `prefix`; a
      process that finds no state under its token's key and whose token does not
      answer the challenge is refused (JobTokenError) before it can lease, report or
      reset anything. A process that finds a state signed with its token holds the
      job's token, whatever the challenge says: a stray client that overwrites the
      challenge (it can name that key) does not lock the job's own processes out;
    - every state written carries its HMAC, and a state whose HMAC does not verify is
      refused, not used (JobTokenError naming the prefix)."""

    def __init__(self, store: dist.Store, blocks: int, timeout: float, *,
                 max_failures: int = 3, prefix: str = "autopar/blocks", worker: str = "",
                 clock=time.time, token: str | None = None):
        token = token or os.environ.get(TOKEN_ENV)
        if not token:
            raise JobTokenError(
                f"the block master at {prefix!r} needs the job's token: the launcher passes "
                f"it in {TOKEN_ENV} (autopar train --elastic makes one on a single node; give "
                f"every node of a job the same)")
        self._secret = token.encode()
        self.store, self.worker, self.clock = store, worker, clock
        self.key = f"{prefix}/{self._mac(b'state-key:' + prefix.encode())[:32]}/state"
        if not self._holds_state():
            self._check_token(f"{prefix}/challenge", prefix)
        initial = BlockQueues(blocks, timeout, max_failures)
        stored = self._compare_set(b"", self._encode(initial))
        found = self._decode(stored)
        if (found.blocks, found.timeout, found.max_failures) != (blocks, timeout, max_failures):
            raise ValueError(f"the store already holds a block master with blocks="
                             f"{found.blocks}, timeout={found.timeout}, max_failures="
                             f"{found.max_failures}, not blocks={blocks}, timeout={timeout}, "
                             f"max_failures={max_failures}: give every worker the same "
                             f"arguments, or another prefix")

    def lease(self) -> Lease | None:
        return self._apply(lambda q: q.lease(self.worker, self.clock()))

    def finish(self, lease: Lease) -> bool:
        return self._apply(lambda q: q.finish(lease, self.clock()))

    def release(self, lease: Lease) -> bool:
        return self._apply(lambda q: q.release(lease, self.clock()))

    def state(self) -> BlockQueues:
        return self._decode(self.store.get(self.key))

    def state_dict(self) -> dict:
        """What a checkpoint saves with the model (`load_state_dict` restores it)."""
        return self.state().state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Replace the state with a checkpoint's (leases held then are given back)."""
        checkpoint = BlockQueues.from_state_dict(state)
        self._apply(lambda q: checkpoint.restored(latest=q.generation), replace=True)

    def _apply(self, op, replace: bool = False):
        while True:
            old = self.store.get(self.key)
            queues = self._decode(old)
            result = op(queues)
            new = self._encode(result if replace else queues)
            if new == old or self._compare_set(old, new) == new:
                return None if replace else result

    def _compare_set(self, expected: bytes, desired: bytes) -> bytes:
        return self.store.compare_set(self.key, expected, desired)

    def _mac(self, data: bytes) -> str:
        return hmac.new(self._secret, data, hashlib.sha256).hexdigest()

    def _holds_state(self) -> bool:
        """Whether the store holds a state under this token's key, signed with it (then
        this process holds the job's token; only a holder can name or sign that key)."""
        if not self.store.check([self.key]):
            return False
        self._decode(self.store.get(self.key))  # a state not signed so is refused
        return True

    def _check_token(self, key: str, prefix: str) -> None:
        nonce = secrets.token_hex(16)
        challenge = json.dumps({"nonce": nonce, "mac": self._mac(nonce.encode())}).encode()
        found = json.loads(self.store.compare_set(key, b"", challenge))
        if not hmac.compare_digest(found.get("mac", ""), self._mac(found.get("nonce", "").encode())):
            raise JobTokenError(f"refused: this process does not hold the token of the job "
                                f"whose block master is at {prefix!r} in this store")

    def _encode(self, queues: BlockQueues) -> bytes:
        state = json.dumps(queues.state_dict(), sort_keys=True)
        return json.dumps({"state": state, "mac": self._mac(state.encode())}).encode()

    def _decode(self, raw: bytes) -> BlockQueues:
        try:
            signed = json.loads(raw)
            good = hmac.compare_digest(signed["mac"], self._mac(signed["state"].encode()))
        except (ValueError, KeyError, TypeError, AttributeError):
            good = False
        if not good:
            raise JobTokenError(f"the block master's state under {self.key!r} was not written "
                                f"with the job's token; not using it (the last checkpoint "
                                f"holds the data position)")
        return BlockQueues.from_state_dict(json.loads(signed["state"]))


class BlockSampler(Sampler[int]):
    """Sample indices of leased blocks, for a plain `DataLoader(dataset,
    sampler=BlockSampler(master, block_size, len(dataset)))`.

    It leases a block when it needs one and yields its indices in order. A DataLoader
    takes indices ahead of training (its prefetching), so the sampler cannot tell what
    was trained: the loop says it, `commit(trained)` with the number of this sampler's
    samples that are now part of the committed model (after the optimizer step, or the
    checkpoint that holds it), and every block whose samples all lie within them is
    reported done. Iteration ends when the master has no block left for this epoch (the
    rest are pending elsewhere or done)."""

    def __init__(self, master: BlockMaster, block_size: int, samples: int):
        if block_size < 1 or samples < 1:
            raise ValueError(f"BlockSampler needs block_size >= 1 and samples >= 1, got "
                             f"{block_size} and {samples}")
        self.master, self.block_size, self.samples = master, block_size, samples
        self.taken = 0  # samples yielded so far
        self.open: list[tuple[Lease, int]] = []  # leases not reported, with their end count

    def __iter__(self) -> Iterator[int]:
        while (lease := self.master.lease()) is not None:
            start = lease.block * self.block_size
            indices = range(start, min(start + self.block_size, self.samples))
            self.open.append((lease, self.taken + len(indices)))
            for index in indices:
                self.taken += 1
                yield index

    def commit(self, trained: int) -> list[Lease]:
        """Report done every block whose samples are all among the first `trained`
        samples this sampler yielded; returns the leases the master refused (they had
        expired: another worker trains those blocks)."""
        ready = [lease for lease, end in self.open if end <= trained]
        self.open = [(lease, end) for lease, end in self.open if end > trained]
        return [lease for lease in ready if not self.master.finish(lease)]
