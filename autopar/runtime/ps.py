"""Parameter-server runtime: servers that hold embedding tables sharded by row id, and
trainers that pull the rows of their batch and push the rows' gradients.

Roles come from the launch: of the job's ranks, the first `Layout.ps.servers` are
servers (server s is rank s), the rest trainers (trainer j is rank servers + j). Every
rank runs the same script; `autopar.compile` returns a `PSServer` on a server rank
(`serve()` until every trainer is done) and a `PSTrainer` on a trainer rank.

Transport: `torch.distributed.rpc` over TensorPipe, behind `Transport` (`call`,
`set_flag` / `has_flag` on the job's store, `shutdown`), so another transport can
replace it in one class.
Every request carries the caller's name, a fresh sequence number and their HMAC-SHA256
under the job's token (AUTOPAR_JOB_TOKEN, as the data-block master uses it); a server
refuses a request whose MAC is wrong or whose number was seen before, before it reads
or writes a row (`TokenError` at the caller).

What a server does with a push (`PSServer._take_window`): it waits until the mode's
number of pushes are in (`_needed`), then
averages them, applies its optimizer to the touched rows only (torch's own SGD,
Adagrad and SparseAdam on a sparse gradient) and releases the waiting trainers. sync
needs every live trainer, async one push (applied as it comes). geo pushes are
parameter changes, added to the rows as they come.

half-async windows must hold the same trainers' pushes on every server: a trainer
waits for its push on each server, and windows filled in arrival order pair different
trainers on different servers, so that two trainers can each wait on a server whose
window needs the other's next push (a deadlock). Server 0 therefore forms the windows
(`on_join`: ceil(fraction * live trainers) trainers that have a gradient), and each
push names its window; a server applies a window once every member's push is in
(`_take_tagged`), or every member's that is still alive.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import rpc

from autopar.compiler.ir import ps_ops
from autopar.compiler.ir.batch import normalizer_means
from autopar.compiler.ir.ps_program import (
    PSProgram,
    TableSpec,
    local_row,
    shard_of,
    shard_rows,
)
from autopar.layout import PSLayout
from autopar.runtime.blocks import TOKEN_ENV

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class PSError(RuntimeError):
    """A parameter-server job that cannot run; the message names what to change."""


class TokenError(PSError):
    """A request without the job's token; the server refused it and changed nothing."""


def server_name(s: int) -> str:
    return f"ps{s}"


def trainer_name(j: int) -> str:
    return f"trainer{j}"


def table_optimizer(factory: OptimizerFactory) -> OptimizerFactory:
    """The optimizer a server updates its table rows with: the user's, applied lazily to
    the rows a push touched. SGD without momentum or weight decay, Adagrad without weight
    decay, and Adam / AdamW without weight decay (as torch.optim.SparseAdam) do that
    exactly; others would move untouched rows (momentum, decay), which a server that sees
    only pushed rows cannot do."""
    probe = factory([torch.nn.Parameter(torch.zeros(1))])
    d = probe.defaults
    name = type(probe).__name__
    if isinstance(probe, torch.optim.SGD):
        if d.get("momentum") or d.get("weight_decay") or d.get("nesterov"):
            raise PSError(f"the servers update table rows lazily (only the rows a batch "
                          f"touched); SGD with momentum={d.get('momentum')} / weight_decay="
                          f"{d.get('weight_decay')} would move every row every step. Use "
                          f"SGD(momentum=0, weight_decay=0), Adagrad or Adam (weight_decay=0)")
        return lambda ps: torch.optim.SGD(ps, lr=d["lr"], foreach=False)
    if isinstance(probe, torch.optim.Adagrad):
        if d.get("weight_decay"):
            raise PSError(f"the servers apply Adagrad lazily to touched rows; weight_decay="
                          f"{d['weight_decay']} would move every row: use weight_decay=0")
        return lambda ps: torch.optim.Adagrad(
            ps, lr=d["lr"], lr_decay=d["lr_decay"], eps=d["eps"],
            initial_accumulator_value=d["initial_accumulator_value"], foreach=False)
    if isinstance(probe, (torch.optim.Adam, torch.optim.SparseAdam)):
        if d.get("weight_decay") or d.get("amsgrad"):
            raise PSError(f"the servers apply Adam lazily to touched rows (as "
                          f"torch.optim.SparseAdam), which has no weight decay or amsgrad; "
                          f"{name} has weight_decay={d.get('weight_decay')}, amsgrad="
                          f"{d.get('amsgrad')}: pass weight_decay=0 (and amsgrad=False)")
        return lambda ps: torch.optim.SparseAdam(ps, lr=d["lr"], betas=d["betas"], eps=d["eps"])
    raise PSError(f"the servers implement SGD, Adagrad and Adam (lazily, on the rows a batch "
                  f"touched); the optimizer factory built {name}")


# --------------------------------------------------------------------------- transport

class Transport:
    """How trainers reach servers, and how the job's processes leave word for each
    other: `call(server, method, *args)` returns a torch.futures.Future of the server's
    answer; `set_flag(key)` / `has_flag(key)` are the job's rendezvous store (a launcher
    marks a dead trainer there; a trainer marks that it left)."""

    def call(self, server: int, method: str, *args) -> torch.futures.Future:
        raise NotImplementedError

    def set_flag(self, key: str) -> None:
        raise NotImplementedError

    def has_flag(self, key: str) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


def dead_flag(trainer: int) -> str:
    """The store key a launcher sets when trainer `trainer`'s process died."""
    return f"autopar/ps/dead/{trainer_name(trainer)}"


def left_flag(trainer: int) -> str:
    return f"autopar/ps/left/{trainer_name(trainer)}"


_SERVER: list = [None]  # the PSServer of this process, which RPC requests reach


def _mac(secret: bytes, caller: str, seq: int, method: str) -> str:
    return hmac.new(secret, f"{caller}|{seq}|{method}".encode(), hashlib.sha256).hexdigest()


def _serve_request(method: str, caller: str, seq: int, mac: str, args: tuple):
    """Check, then run, one request; an error raised here reaches the caller's wait()
    (a future completed with an exception would reach it as a value)."""
    server = _SERVER[0]
    if server is None:
        raise PSError("this process serves no parameter-server tables")
    server.authenticate(caller, seq, method, mac)
    if method not in _METHODS:
        raise PSError(f"a server has no request {method!r}")
    result = getattr(server, "on_" + method)(caller, *args)
    if isinstance(result, torch.futures.Future):
        return result
    fut = torch.futures.Future()
    fut.set_result(result)
    return fut


_METHODS = ("pull", "pull_many", "pull_dense", "push", "join", "done", "state", "save")


class RpcTransport(Transport):
    """torch.distributed.rpc (TensorPipe): this process joins the job's RPC group under
    `name`; the rendezvous is the launcher's (torchrun's MASTER_ADDR / MASTER_PORT)."""

    def __init__(self, name: str, rank: int, world: int, token: str, timeout_s: float = 600):
        self._rpc = rpc
        self.name = name
        self._secret = token.encode()
        self._seq = 0
        self._lock = threading.Lock()
        options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout_s, num_worker_threads=16)
        with warnings.catch_warnings():  # RPC's own start-up uses a deprecated c10d form
            warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
            rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=timedelta(seconds=timeout_s))

    def call(self, server: int, method: str, *args) -> torch.futures.Future:
        with self._lock:
            self._seq += 1
            seq = self._seq
        mac = _mac(self._secret, self.name, seq, method)
        return self._rpc.rpc_async(server_name(server), _rpc_entry, args=(method, self.name, seq,
                                                                       mac, args))

    def set_flag(self, key: str) -> None:
        self._store.set(key, b"1")

    def has_flag(self, key: str) -> bool:
        return self._store.check([key])

    def shutdown(self) -> None:
        # not graceful: a graceful shutdown waits for every process of the job, a dead
        # trainer too; the servers wait for every live trainer's left_flag instead
        self._rpc.shutdown(graceful=False)


@rpc.functions.async_execution
def _rpc_entry(method, caller, seq, mac, args):
    """What a trainer's RPC runs on a server: the request, checked and answered."""
    return _serve_request(method, caller, seq, mac, args)


def job_token() -> str:
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise PSError(f"parameter servers accept only requests signed with the job's token: "
                      f"set {TOKEN_ENV} to the same secret in every process of the job "
                      f"(`autopar train` sets it; with torchrun, export it first)")
    return token


# --------------------------------------------------------------------------- server

@dataclass
class _Pending:
    rows: list  # per table: (local rows, values) pushed
    dense: list  # per held dense param: gradient or None
    future: torch.futures.Future


@dataclass
class ServerStats:
    pushes: int = 0  # pushes received
    applied: int = 0  # optimizer steps (windows applied)
    window_sizes: list = field(default_factory=list)  # pushes averaged in each step
    window_needed: list = field(default_factory=list)  # what each step waited for
    refused: int = 0  # requests refused for a bad token
    dead: list = field(default_factory=list)  # trainers whose process died
    # half-async, server 0: each window formed, as (members, trainers then live)
    windows_formed: list = field(default_factory=list)


class PSServer:
    """One server: a shard of every table (rows with id % servers == s) and the dense
    parameters assigned to it, their optimizers, and the push window."""

    role = "server"

    def __init__(self, server: int, layout: PSLayout, trainers: int,
                 tables: Sequence[TableSpec], table_init: Sequence[torch.Tensor | None],
                 dense: Sequence[tuple[str, torch.Tensor]], factory: OptimizerFactory,
                 token: str):
        self.server, self.layout, self.trainers = server, layout, trainers
        self.tables = tuple(tables)
        S = layout.servers
        self.shards = []
        for spec, full in zip(self.tables, table_init):
            rows = shard_rows(spec.rows, S, server)
            if full is not None:
                data = full.detach()[server::S].clone()
            else:  # nn.Embedding's own init, N(0, 1), from a generator per shard
                seed = zlib.crc32(f"{spec.name}/{server}/{S}".encode())
                gen = torch.Generator().manual_seed(seed)
                data = torch.randn(rows, spec.dim, generator=gen, dtype=spec.dtype)
            self.shards.append(torch.nn.Parameter(data, requires_grad=True))
        self.dense_names = [name for name, _ in dense]
        self.dense = [torch.nn.Parameter(t.detach().clone()) for _, t in dense]
        geo = layout.mode == "geo"
        self.table_opt = None if geo or not self.shards else table_optimizer(factory)(self.shards)
        self.dense_opt = factory(self.dense) if self.dense else None
        self.needed_base = {"sync": trainers, "async": 1, "geo": 1,
                            "half-async": math.ceil((layout.fraction or 1) * trainers)}[layout.mode]
        self.stats = ServerStats()
        self._secret = token.encode()
        self._seen: dict[str, set[int]] = {}
        self._lock = threading.Lock()
        self._window: list[_Pending] = []
        self._joins: list[tuple[str, torch.futures.Future]] = []  # half-async, server 0
        self._tagged: dict[int, tuple[tuple[str, ...], dict[str, _Pending]]] = {}
        self._windows_applied: set[int] = set()
        self._done: set[str] = set()
        self._all_done = threading.Event()

    # ---- requests (run on RPC threads)
    def authenticate(self, caller: str, seq: int, method: str, mac: str) -> None:
        good = hmac.compare_digest(str(mac), _mac(self._secret, str(caller), int(seq), method))
        with self._lock:
            seen = self._seen.setdefault(str(caller), set())
            if not good or seq in seen:
                self.stats.refused += 1
                raise TokenError(f"server {self.server} refused {method!r} from {caller!r}: "
                                 f"the request is not signed with the job's token "
                                 f"({TOKEN_ENV}) or repeats an earlier one; nothing changed")
            seen.add(seq)

    def on_pull(self, caller: str, table: int, rows: torch.Tensor) -> torch.Tensor:
        with self._lock:
            return self.shards[table].detach()[rows].clone()

    def on_pull_many(self, caller: str, request: list) -> list[torch.Tensor]:
        """Rows of several tables in one request: [(table, local rows)] -> [rows]."""
        with self._lock:
            return [self.shards[t].detach()[rows].clone() for t, rows in request]

    def on_pull_dense(self, caller: str) -> list[torch.Tensor]:
        with self._lock:
            return [p.detach().clone() for p in self.dense]

    def on_push(self, caller: str, rows: list, dense: list,
                window: tuple[int, tuple[str, ...]] | None = None) -> torch.futures.Future:
        """A trainer's gradients (geo: changes); `window` (half-async): the window
        server 0 put this push in, and its members."""
        fut = torch.futures.Future()
        with self._lock:
            self.stats.pushes += 1
            if self.layout.mode == "geo":
                self._add(rows, dense)
                fut.set_result(None)
                return fut
            if self.layout.mode == "half-async":
                if window is None:
                    raise PSError(f"a half-async push from {caller!r} names no window "
                                  f"(a trainer joins one on server 0 first)")
                w, members = int(window[0]), tuple(window[1])
                if caller not in members:
                    raise PSError(f"{caller!r} pushed into window {w}, whose members are "
                                  f"{list(members)}")
                if w in self._windows_applied:
                    # a member counted dead (its process gone) whose push still came
                    raise PSError(f"window {w} was applied without {caller!r}'s push")
                entry = self._tagged.setdefault(w, (members, {}))
                entry[1][caller] = _Pending(rows, dense, fut)
                ready = self._take_tagged()
            else:
                self._window.append(_Pending(rows, dense, fut))
                ready = self._take_window()
        self._release(ready)
        return fut

    def on_join(self, caller: str) -> torch.futures.Future:
        """half-async, on server 0: `caller` has a gradient to push; answered with
        (window id, member trainers) once the window has ceil(fraction * live trainers)
        members."""
        if self.server != 0 or self.layout.mode != "half-async":
            raise PSError(f"server {self.server} forms no windows in mode "
                          f"{self.layout.mode!r}: half-async trainers join on server 0")
        fut = torch.futures.Future()
        with self._lock:
            self._joins.append((caller, fut))
            formed = self._form_windows()
        for f, value in formed:
            f.set_result(value)
        return fut

    def on_done(self, caller: str) -> None:
        self._finish(caller)

    def _finish(self, trainer: str) -> None:
        """`trainer` will push no more (it said so, or its process died): a window no
        longer waits for it."""
        with self._lock:
            self._done.add(trainer)
            self._joins = [(t, f) for t, f in self._joins if t != trainer]
            formed = self._form_windows()
            ready = self._take_tagged() if self.layout.mode == "half-async" \
                else self._take_window()
            finished = len(self._done) >= self.trainers
        for f, value in formed:
            f.set_result(value)
        self._release(ready)
        if finished:
            self._all_done.set()

    def on_state(self, caller: str) -> dict:
        with self._lock:
            return {"shards": [s.detach().clone() for s in self.shards],
                    "dense": [p.detach().clone() for p in self.dense],
                    "stats": _stats_dict(self.stats)}

    def on_save(self, caller: str, path: str) -> str:
        """Write this server's shard, its dense parameters and their optimizer state to
        `path`/server{s}-of-{S}.pt (written whole, then renamed into place)."""
        with self._lock:
            state = {
                "servers": self.layout.servers, "server": self.server,
                "tables": [t.name for t in self.tables],
                "shards": [p.detach().clone() for p in self.shards],
                "table_opt": self.table_opt.state_dict() if self.table_opt else None,
                "dense_names": list(self.dense_names),
                "dense": [p.detach().clone() for p in self.dense],
                "dense_opt": self.dense_opt.state_dict() if self.dense_opt else None,
            }
        final = os.path.join(path, f"server{self.server}-of-{self.layout.servers}.pt")
        torch.save(state, final + ".tmp")
        os.replace(final + ".tmp", final)
        return final

    def load(self, path: str) -> None:
        """Take this server's rows, dense parameters and optimizer state from a
        checkpoint saved by any number of servers (`PSTrainer.save`): row r of a table
        comes from old server r % S_old, and goes to this server if r % S == s."""
        old = _load_server_files(path)
        S_old, S = old[0]["servers"], self.layout.servers
        names = [t.name for t in self.tables]
        if old[0]["tables"] != names:
            raise PSError(f"the checkpoint at {path} holds tables {old[0]['tables']}, this "
                          f"model's are {names}")
        with self._lock, torch.no_grad():
            for t, shard in enumerate(self.shards):
                rows = self.server + S * torch.arange(shard.shape[0])
                shard.copy_(_gather_rows([o["shards"][t] for o in old], rows, S_old))
            if self.table_opt is not None:
                self.table_opt.load_state_dict(_reshard_optimizer(
                    self.table_opt.state_dict(), [o["table_opt"] for o in old],
                    [(t, self.server + S * torch.arange(p.shape[0])) for t, p in
                     enumerate(self.shards)], S_old))
            by_name = {}
            for o in old:
                for i, name in enumerate(o["dense_names"]):
                    opt_state = (o["dense_opt"] or {}).get("state", {}).get(i)
                    by_name[name] = (o["dense"][i], opt_state)
            missing = [n for n in self.dense_names if n not in by_name]
            if missing:
                raise PSError(f"the checkpoint at {path} holds no servers' copy of {missing} "
                              f"(it was saved with dense='allreduce'; load those on the "
                              f"trainers, or save with dense='servers')")
            for p, name in zip(self.dense, self.dense_names):
                p.copy_(by_name[name][0])
            if self.dense_opt is not None:
                sd = self.dense_opt.state_dict()
                sd["state"] = {i: by_name[n][1] for i, n in enumerate(self.dense_names)
                               if by_name[n][1] is not None}
                self.dense_opt.load_state_dict(sd)

    # ---- updates (under the lock)
    def _needed(self) -> int:
        live = self.trainers - len(self._done)
        return max(1, min(self.needed_base, live))

    def _take_window(self) -> list[_Pending]:
        """Apply every full window waiting (several, once a trainer finished and the
        windows need fewer pushes); the pushes applied, whose trainers may go on."""
        ready: list[_Pending] = []
        while self._window and len(self._window) >= self._needed():
            needed = self._needed()
            take, self._window = self._window[:needed], self._window[needed:]
            self.stats.window_needed.append(needed)
            self._apply(take)
            ready += take
        return ready

    def _form_windows(self) -> list[tuple[torch.futures.Future, tuple]]:
        """half-async, server 0: windows of the trainers waiting to push, in the order
        they joined; the (future, answer) pairs to complete outside the lock."""
        formed = []
        while self._joins and len(self._joins) >= self._needed():
            needed = self._needed()
            take, self._joins = self._joins[:needed], self._joins[needed:]
            members = tuple(t for t, _ in take)
            w = len(self.stats.windows_formed)  # windows are numbered as formed
            self.stats.windows_formed.append((list(members), self.trainers - len(self._done)))
            formed += [(f, (w, members)) for _, f in take]
        return formed

    def _take_tagged(self) -> list[_Pending]:
        """half-async: apply each window whose members have all pushed here (a member
        that finished or died without pushing is not waited for)."""
        ready: list[_Pending] = []
        for w in sorted(self._tagged):
            members, got = self._tagged[w]
            if all(m in got or m in self._done for m in members):
                del self._tagged[w]
                self._windows_applied.add(w)
                if got:
                    self.stats.window_needed.append(len(members))
                    pending = list(got.values())
                    self._apply(pending)
                    ready += pending
        return ready

    def _release(self, ready: list[_Pending]) -> None:
        for pending in ready:
            pending.future.set_result(None)

    def _apply(self, window: list[_Pending]) -> None:
        n = len(window)
        self.stats.applied += 1
        self.stats.window_sizes.append(n)
        for t, shard in enumerate(self.shards):
            idx = torch.cat([p.rows[t][0] for p in window])
            vals = torch.cat([p.rows[t][1] for p in window])
            # checked: the rows come over the network, and an index past the shard's
            # end must fail here, not corrupt memory
            shard.grad = torch.sparse_coo_tensor(idx.unsqueeze(0), vals / n, shard.shape,
                                                 check_invariants=True).coalesce()
        if self.table_opt is not None:
            self.table_opt.step()
            self.table_opt.zero_grad(set_to_none=True)
        for i, p in enumerate(self.dense):
            grads = [w.dense[i] for w in window]
            p.grad = torch.stack(grads).sum(0) / n
        if self.dense_opt is not None:
            self.dense_opt.step()
            self.dense_opt.zero_grad(set_to_none=True)

    def _add(self, rows: list, dense: list) -> None:
        self.stats.applied += 1
        self.stats.window_sizes.append(1)
        with torch.no_grad():
            for t, shard in enumerate(self.shards):
                idx, delta = rows[t]
                shard.index_add_(0, idx, delta)
            for p, delta in zip(self.dense, dense):
                p.add_(delta)

    # ---- the process
    transport_factory: Callable[[], Transport] | None = None

    def serve(self, poll_s: float = 0.2) -> ServerStats:
        """Answer trainers until every one of them is done or dead, then leave once each
        live one has left (its last answer is then delivered)."""
        _SERVER[0] = self
        # torch's Adagrad / SparseAdam rebuild sparse tensors from the (coalesced, checked)
        # gradient without checks and say so on every step
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly")
        transport = self.transport_factory()
        dead: set[int] = set()
        while not self._all_done.wait(poll_s):
            for j in range(self.trainers):
                if j not in dead and transport.has_flag(dead_flag(j)):
                    dead.add(j)
                    self.stats.dead.append(trainer_name(j))
                    self._finish(trainer_name(j))
        for j in range(self.trainers):
            while j not in dead and not transport.has_flag(left_flag(j)):
                if transport.has_flag(dead_flag(j)):
                    break
                time.sleep(poll_s / 4)
        transport.shutdown()
        _SERVER[0] = None
        return self.stats


def _load_server_files(path: str) -> list[dict]:
    files = sorted(f for f in os.listdir(path) if f.startswith("server") and f.endswith(".pt"))
    if not files:
        raise PSError(f"no parameter-server checkpoint in {path} (server*-of-*.pt)")
    old = [torch.load(os.path.join(path, f), mmap=True, weights_only=True) for f in files]
    S_old = old[0]["servers"]
    old.sort(key=lambda o: o["server"])
    if [o["server"] for o in old] != list(range(S_old)):
        raise PSError(f"the checkpoint at {path} is incomplete: it has servers "
                      f"{[o['server'] for o in old]} of {S_old}")
    return old


def _gather_rows(old_shards: list[torch.Tensor], rows: torch.Tensor, S_old: int) -> torch.Tensor:
    """Rows `rows` (global ids) of a table held round-robin by S_old old shards."""
    out = torch.empty(len(rows), *old_shards[0].shape[1:], dtype=old_shards[0].dtype)
    owner = shard_of(rows, S_old)
    for s, shard in enumerate(old_shards):
        mask = owner == s
        out[mask] = shard[local_row(rows[mask], S_old)]
    return out


def _reshard_optimizer(current: dict, old: list[dict | None], params: list, S_old: int) -> dict:
    """The optimizer state of this server's shards from the old servers': per-row
    tensors (Adagrad's sum, Adam's moments) gathered by row, scalar ones (the step
    count) the largest any old server reached."""
    state = {}
    for t, rows in params:
        olds = [o["state"].get(t) for o in old if o is not None]
        if not olds or any(o is None for o in olds):
            continue
        entry = {}
        for key, value in olds[0].items():
            if torch.is_tensor(value) and value.dim() > 0:
                entry[key] = _gather_rows([o[key] for o in olds], rows, S_old)
            else:
                entry[key] = max(olds, key=lambda o: float(o[key]))[key]
        state[t] = entry
    return {**current, "state": state}


def _stats_dict(stats: ServerStats) -> dict:
    return {"pushes": stats.pushes, "applied": stats.applied,
            "window_sizes": list(stats.window_sizes),
            "window_needed": list(stats.window_needed), "refused": stats.refused,
            "dead": list(stats.dead), "windows_formed": list(stats.windows_formed)}


# --------------------------------------------------------------------------- trainer

@dataclass
class TrainerStats:
    steps: int = 0
    pulled_rows: int = 0
    pushed_rows: int = 0
    pushed_bytes: int = 0  # ids and row values sent to servers (dense gradients aside)
    pulled_bytes: int = 0


class PSTrainer:
    """One trainer: runs the program on its slice of the global batch, pulling rows
    from and pushing row gradients to the servers; dense parameters are all-reduced
    among trainers or live on the servers (Layout.ps.dense)."""

    role = "trainer"

    def __init__(self, program: PSProgram, layout: PSLayout, trainer: int, trainers: int,
                 dense: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 factory: OptimizerFactory, transport: Transport,
                 trainer_group: dist.ProcessGroup | None):
        self.program, self.layout = program, layout
        self.trainer, self.trainers = trainer, trainers
        self.transport = transport
        self.group = trainer_group
        self.params = [torch.nn.Parameter(dense[e.name].detach().clone()) for e in program.dense]
        self.buffers = [buffers[e.name].detach().clone() for e in program.buffers]
        self.on_servers = layout.dense_policy == "servers"
        self.owner = [i % layout.servers for i in range(len(self.params))]
        self.optimizer = None if self.on_servers or not self.params else factory(self.params)
        self.geo_lr = geo_learning_rate(factory) if layout.mode == "geo" else None
        self.stats = TrainerStats()
        self._outstanding: list[torch.futures.Future] = []
        self._geo_rows: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in program.tables]
        self._geo_dense_base: list[torch.Tensor] | None = None

    # ---- rows
    def _prefetch(self, inputs: list) -> None:
        """Fetch every row the step's pulls will read: the ids from the program's
        prefetch graph, then one request per server for all tables' rows."""
        prog = self.program
        flat = prog.prefetch(*self.params, *self.buffers, *inputs)
        wanted: list[list[torch.Tensor]] = [[] for _ in prog.tables]
        for pull, ids in zip(prog.pulls, flat):
            pad = prog.tables[pull.table].padding_idx
            wanted[pull.table].append(ids if pad < 0 else
                                      torch.cat([ids[ids != pad], torch.tensor([pad])]))
        uniq = [torch.cat(w).unique(sorted=True) if w else torch.zeros(0, dtype=torch.int64)
                for w in wanted]
        S = self.layout.servers
        asks = []
        for s in range(S):
            masks = [shard_of(u, S) == s for u in uniq]
            request = [(t, local_row(u[m], S)) for t, (u, m) in enumerate(zip(uniq, masks))
                       if m.any()]
            if request:
                asks.append((s, masks, request, self.transport.call(s, "pull_many", request)))
        self._rows = []
        for t, (u, spec) in enumerate(zip(uniq, prog.tables)):
            self._rows.append((u, torch.empty(len(u), spec.dim, dtype=spec.dtype)))
        for s, masks, request, fut in asks:
            for (t, _), rows in zip(request, fut.wait()):
                self._rows[t][1][masks[t]] = rows
                self.stats.pulled_rows += rows.shape[0]
                self.stats.pulled_bytes += rows.numel() * rows.element_size()

    def _read_prefetched(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        known, rows = self._rows[table]
        return rows[torch.searchsorted(known, ids)]

    def _read(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        S = self.layout.servers
        spec = self.program.tables[table]
        out = torch.empty(ids.numel(), spec.dim, dtype=spec.dtype)
        cache = self._geo_rows[table] if self.layout.mode == "geo" else None
        need = torch.ones(ids.numel(), dtype=torch.bool)
        if cache:
            for i, r in enumerate(ids.tolist()):
                if r in cache:
                    out[i] = cache[r][0]
                    need[i] = False
        owner = shard_of(ids, S)
        futures = []
        for s in range(S):
            mask = need & (owner == s)
            if mask.any():
                futures.append((mask, self.transport.call(s, "pull", table,
                                                          local_row(ids[mask], S))))
        for mask, fut in futures:
            rows = fut.wait()
            out[mask] = rows
            self.stats.pulled_rows += rows.shape[0]
            self.stats.pulled_bytes += rows.numel() * rows.element_size()
        if cache is not None:
            for i in need.nonzero().flatten().tolist():
                r = int(ids[i])
                cache[r] = (out[i].clone(), out[i].clone())  # (current, base)
        return out

    objective = None  # the batch convention (compiler/ir/batch.py), set by compile

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        batch = self.objective.flatten(args, kwargs) if self.objective is not None else args
        prog = self.program
        dims = prog.batch_dims[:len(prog.batch_dims) - len(prog.normalizers)]
        inputs = [_slice(x, d, self.trainer, self.trainers) if d is not None else x
                  for x, d in zip(batch, dims)]
        # sync: each trainer divides by the global batch's count over the trainers
        inputs += normalizer_means(prog.normalizers, batch, dims, self.trainers)
        # geo trains its own copy between pushes, and pulls after each push instead
        if self.on_servers and (self.layout.mode != "geo" or self._geo_dense_base is None):
            self._pull_dense()
        if self.layout.mode == "geo" or prog.prefetch is None:
            reader = self._read  # geo reads its own copies first
        else:
            self._prefetch(inputs)
            reader = self._read_prefetched
        ps_ops.bind_reader(reader)
        try:
            with torch.no_grad():
                outs = prog.gm(*self.params, *self.buffers, *inputs)
        finally:
            ps_ops.bind_reader(None)
        nd = len(self.params)
        loss, grads = outs[0], list(outs[1:1 + nd])
        pulled = outs[1 + nd:1 + nd + 2 * len(prog.pulls)]
        for i, name in enumerate(prog.mutated_buffers):
            self.buffers[[b.name for b in prog.buffers].index(name)].copy_(
                outs[1 + nd + 2 * len(prog.pulls) + i])
        row_grads = [(pulled[2 * k + 1], pulled[2 * k]) for k in range(len(prog.pulls))]
        if self.layout.mode == "geo":
            self._geo_step(row_grads, grads)
        else:
            self._push(row_grads, grads if self.on_servers else None)
            if not self.on_servers:
                self._step_dense(grads)
        self.stats.steps += 1
        return loss.detach()

    def _pull_dense(self) -> None:
        S = self.layout.servers
        futs = {s: self.transport.call(s, "pull_dense") for s in range(S)
                if s in self.owner}
        got = {s: iter(f.wait()) for s, f in futs.items()}
        with torch.no_grad():
            for p, s in zip(self.params, self.owner):
                p.copy_(next(got[s]))

    def _send(self, items, dense: list[torch.Tensor] | None,
              window: tuple | None = None) -> list[torch.futures.Future]:
        """Push (table, ids, values) items, each server the rows it owns (per table,
        possibly none: a sync window counts every trainer's push), and the dense
        gradients or changes of the parameters it holds; counts what is sent."""
        S = self.layout.servers
        specs = self.program.tables
        per = [[([], []) for _ in specs] for _ in range(S)]
        for t, ids, vals in items:
            owner = shard_of(ids, S)
            for s in range(S):
                mask = owner == s
                per[s][t][0].append(local_row(ids[mask], S))
                per[s][t][1].append(vals[mask])
        futures = []
        for s in range(S):
            rows = [(torch.cat(i) if i else torch.zeros(0, dtype=torch.int64),
                     torch.cat(v) if v else torch.zeros(0, specs[t].dim, dtype=specs[t].dtype))
                    for t, (i, v) in enumerate(per[s])]
            for idx, vals in rows:
                self.stats.pushed_rows += idx.numel()
                self.stats.pushed_bytes += idx.numel() * idx.element_size() \
                    + vals.numel() * vals.element_size()
            held = [g for g, o in zip(dense, self.owner) if o == s] if dense else []
            futures.append(self.transport.call(s, "push", rows, held, window))
        return futures

    def _push(self, row_grads, dense_grads) -> None:
        # async: at most one step's pushes in flight (a staleness of one step)
        for fut in self._outstanding:
            fut.wait()
        items = []
        for pull, (ids, grad) in zip(self.program.pulls, row_grads):
            n = int((ids >= 0).sum())  # the pull's unique ids, then -1s
            items.append((pull.table, ids[:n], grad[:n]))
        # half-async: the same window on every server, formed by server 0
        window = self.transport.call(0, "join").wait() \
            if self.layout.mode == "half-async" else None
        self._outstanding = self._send(items, dense_grads, window)
        if self.layout.mode != "async":
            for fut in self._outstanding:
                fut.wait()
            self._outstanding = []

    def _step_dense(self, grads) -> None:
        if not self.params:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.group is not None:
            dist.all_reduce(flat, group=self.group)
        flat /= self.trainers
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _geo_step(self, row_grads, dense_grads) -> None:
        """GEO: SGD on the local copies of the rows (and dense parameters); every
        geo_k steps push each row's change since it was pulled, then drop the copies."""
        lr = self.geo_lr
        for k, (ids, grad) in enumerate(row_grads):
            cache = self._geo_rows[self.program.pulls[k].table]
            n = int((ids >= 0).sum())
            for r, g in zip(ids[:n].tolist(), grad[:n]):
                cache[r][0].sub_(lr * g)
        if self._geo_dense_base is None:
            self._geo_dense_base = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, g in zip(self.params, dense_grads):
                p.sub_(lr * g)
        if (self.stats.steps + 1) % self.layout.geo_k == 0:
            self.geo_sync()

    def geo_sync(self) -> None:
        deltas = []
        for t, cache in enumerate(self._geo_rows):
            ids = torch.tensor(sorted(cache), dtype=torch.int64)
            spec = self.program.tables[t]
            vals = (torch.stack([cache[r][0] - cache[r][1] for r in ids.tolist()])
                    if len(ids) else torch.zeros(0, spec.dim, dtype=spec.dtype))
            deltas.append((ids, vals))
            cache.clear()
        dense = [p.detach() - b for p, b in zip(self.params, self._geo_dense_base or [])]
        self.push_deltas(deltas, dense)
        if self.params:
            self._pull_dense()
        self._geo_dense_base = [p.detach().clone() for p in self.params]

    def push_deltas(self, deltas: list[tuple[torch.Tensor, torch.Tensor]],
                    dense: list[torch.Tensor]) -> None:
        """GEO's push: per table (ids, row changes), and the dense parameters' changes;
        the servers add them as they are."""
        for fut in self._send([(t, ids, vals) for t, (ids, vals) in enumerate(deltas)], dense):
            fut.wait()

    def done(self) -> None:
        """Tell every server this trainer is finished (after its last push) and leave the
        job's RPC group: the trainer's last call."""
        if self.layout.mode == "geo" and any(self._geo_rows):
            self.geo_sync()
        for fut in self._outstanding:
            fut.wait()
        self._outstanding = []
        for fut in [self.transport.call(s, "done") for s in range(self.layout.servers)]:
            fut.wait()
        self.transport.set_flag(left_flag(self.trainer))
        self.transport.shutdown()

    def save(self, path: str) -> None:
        """Checkpoint the job (call it on one trainer, between steps): every server
        writes its shard; this trainer writes the dense parameters it all-reduces and
        their optimizer state; `ps.json` is written last and marks it complete. In sync
        mode the snapshot is one step's; in the other modes each server's is its own
        moment (the modes have no global step)."""
        import json

        os.makedirs(path, exist_ok=True)
        for fut in [self.transport.call(s, "save", path) for s in range(self.layout.servers)]:
            fut.wait()
        if not self.on_servers:
            torch.save({"names": [e.name for e in self.program.dense],
                        "dense": [p.detach().clone() for p in self.params],
                        "opt": self.optimizer.state_dict() if self.optimizer else None},
                       os.path.join(path, "trainer-dense.pt"))
        with open(os.path.join(path, "ps.json"), "w") as f:
            json.dump({"servers": self.layout.servers, "mode": self.layout.mode,
                       "dense": self.layout.dense_policy,
                       "tables": [t.name for t in self.program.tables]}, f)

    def load(self, path: str) -> None:
        """Load this trainer's dense parameters and optimizer state (dense='allreduce');
        the servers load their rows themselves (PSServer.load)."""
        if not os.path.exists(os.path.join(path, "ps.json")):
            raise PSError(f"{path} holds no complete parameter-server checkpoint (no ps.json)")
        if self.on_servers:
            return
        file = os.path.join(path, "trainer-dense.pt")
        if not os.path.exists(file):
            raise PSError(f"the checkpoint at {path} was saved with the dense parameters on "
                          f"the servers; load it with Layout.ps.dense='servers'")
        saved = torch.load(file, weights_only=True)
        if saved["names"] != [e.name for e in self.program.dense]:
            raise PSError(f"the checkpoint's dense parameters {saved['names']} are not this "
                          f"model's")
        with torch.no_grad():
            for p, value in zip(self.params, saved["dense"]):
                p.copy_(value)
        if self.optimizer is not None and saved["opt"] is not None:
            self.optimizer.load_state_dict(saved["opt"])

    def server_state(self, server: int) -> dict:
        """A server's shards, dense parameters and counters (for checks and reports)."""
        return self.transport.call(server, "state").wait()

    def table(self, t: int) -> torch.Tensor:
        """The whole table `t`, gathered from every server (small tables: tests)."""
        spec = self.program.tables[t]
        S = self.layout.servers
        out = torch.empty(spec.rows, spec.dim, dtype=spec.dtype)
        for s in range(S):
            out[s::S] = self.server_state(s)["shards"][t]
        return out


def _slice(x: torch.Tensor, dim: int, part: int, parts: int) -> torch.Tensor:
    size = x.shape[dim]
    if size % parts:
        raise PSError(f"the global batch of {size} does not split evenly over {parts} "
                      f"trainers; use a multiple of {parts}")
    step = size // parts
    return x.narrow(dim, part * step, step)


def geo_learning_rate(factory: OptimizerFactory) -> float:
    probe = factory([torch.nn.Parameter(torch.zeros(1))])
    if not isinstance(probe, torch.optim.SGD) or probe.defaults.get("momentum"):
        raise PSError(f"mode='geo' trains each trainer's rows locally with plain SGD and "
                      f"pushes their change; the optimizer factory built "
                      f"{type(probe).__name__}: use torch.optim.SGD(lr=..., momentum=0)")
    return probe.defaults["lr"]


def new_token() -> str:
    return secrets.token_hex(16)
