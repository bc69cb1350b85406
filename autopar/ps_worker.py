"""A parameter-server job: `PSJob` starts its processes, `main` is one of them.

`autopar train MODEL --ps-servers S --nproc W --mode M` starts S server processes and W
trainer processes on this machine (ranks 0..S-1 serve, S..S+W-1 train: runtime/ps.py).
The launcher is not torchrun: torchrun stops every worker when one fails, and in the
async, half-async and geo modes a trainer that dies must not stop the others. So the
job hosts its own rendezvous store; when a trainer's process dies the launcher marks it
dead there (`runtime.ps.dead_flag`) and the servers stop waiting for it. A server that
dies ends the job (its rows would be lost), and so does a trainer in sync mode.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.logs import EVENT_PREFIX, emit

OPTIMIZERS = ("sgd", "adagrad", "adam")


def optimizer_factory(name: str, lr: float):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    if name == "adagrad":
        return lambda params: torch.optim.Adagrad(params, lr=lr)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def main(argv: list[str] | None = None) -> int:
    from autopar.api import compile as compile_step
    from autopar.examples import load_model_spec
    from autopar.layout import Layout, PSLayout

    parser = argparse.ArgumentParser(prog="autopar.ps_worker")
    parser.add_argument("model")
    parser.add_argument("--servers", type=int, required=True)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--fraction", type=float, default=None)
    parser.add_argument("--geo-k", type=int, default=None)
    parser.add_argument("--dense", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", default="adagrad", choices=OPTIMIZERS)
    parser.add_argument("--model-args", default="{}", help="JSON: the example's arguments")
    parser.add_argument("--slow", type=int, default=None, metavar="J",
                        help="trainer J sleeps as long as its step took, after each step "
                             "(a trainer slowed 2x on purpose)")
    args = parser.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"])
    ex = load_model_spec(args.model, **json.loads(args.model_args))
    ps = PSLayout(servers=args.servers, mode=args.mode, fraction=args.fraction,
                  geo_k=args.geo_k, dense=args.dense)
    layout = Layout(dp=world - args.servers, ps=ps)
    started = time.perf_counter()
    step = compile_step(ex.model, None, ex.batch, ex.loss_fn,
                           optimizer_factory(args.optimizer, args.lr), layout)
    if step.role == "server":
        stats = step.serve()
        emit("server", server=step.server, pushes=stats.pushes, applied=stats.applied,
             dead=stats.dead, refused=stats.refused, rss_mib=_peak_rss_mib(),
             shard_rows=[int(p.shape[0]) for p in step.shards])
        return 0
    j = step.trainer
    emit("compiled", trainer=j, description=ex.description, layout=str(layout),
         seconds=time.perf_counter() - started, passes=["split_for_ps"],
         comparison=str(step.comparison))
    t0 = time.perf_counter()
    for k in range(args.steps):
        tick = time.perf_counter()
        loss = step(*ex.data(k))  # the global batch; the step takes this trainer's slice
        took = time.perf_counter() - tick
        if args.slow == j:
            time.sleep(took)
        emit("step", trainer=j, step=k + 1, steps=args.steps, loss=float(loss),
             seconds=time.perf_counter() - tick, tokens=int(ex.batch[0].shape[0]),
             pushed_bytes=step.stats.pushed_bytes, pulled_bytes=step.stats.pulled_bytes)
    step.done()
    emit("trainer_done", trainer=j, seconds=time.perf_counter() - t0,
         pushed_bytes=step.stats.pushed_bytes, pulled_bytes=step.stats.pulled_bytes,
         pushed_rows=step.stats.pushed_rows, rss_mib=_peak_rss_mib())
    return 0


def _peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class PSJob:
    """S servers and W trainers of `autopar.ps_worker` on this machine; `events()`
    yields each process's progress events (with "rank") and the launcher's own."""

    worker_args: list[str]
    servers: int
    trainers: int
    mode: str = "sync"
    env: dict = field(default_factory=dict)
    module: str = "autopar.ps_worker"  # what each process runs (`python -m MODULE ...`)
    procs: list = field(default_factory=list)

    def start(self) -> PSJob:
        # the job's rendezvous store; the processes join it as clients
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        token = os.environ.get("AUTOPAR_JOB_TOKEN") or secrets.token_hex(16)
        world = self.servers + self.trainers
        self._events: queue.Queue = queue.Queue()
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "AUTOPAR_JOB_TOKEN": token,
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                   # TensorPipe warns of every pipe a process closes when the job ends
                   "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
                   # the job is this machine's: TensorPipe listens on loopback only
                   "TP_SOCKET_IFNAME": "lo",
                   **self.env}
            proc = subprocess.Popen([sys.executable, "-m", self.module,
                                     *self.worker_args, "--servers", str(self.servers)],
                                    stdout=subprocess.PIPE, text=True, env=env)
            self.procs.append(proc)
            threading.Thread(target=self._relay, args=(rank, proc), daemon=True).start()
        return self

    def _relay(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith(EVENT_PREFIX):
                self._events.put({**json.loads(line[len(EVENT_PREFIX):]), "rank": rank})
            else:
                sys.stdout.write(line)

    def kill(self, trainer: int) -> None:
        """SIGKILL a trainer's process (what a test of a fault does)."""
        self.procs[self.servers + trainer].send_signal(signal.SIGKILL)

    def events(self, poll_s: float = 0.2):
        """Progress events until every process exited; a dead trainer yields
        {"event": "trainer_died", ...}, and a failure the job cannot survive ends it
        with {"event": "failed", ...}."""
        from autopar.runtime.ps import dead_flag

        reported: set[int] = set()
        while True:
            try:
                yield self._events.get(timeout=poll_s)
                continue
            except queue.Empty:
                pass
            codes = [p.poll() for p in self.procs]
            for rank, code in enumerate(codes):
                if code in (None, 0) or rank in reported:
                    continue
                reported.add(rank)
                if rank >= self.servers and self.mode != "sync":
                    self.store.set(dead_flag(rank - self.servers), b"1")
                    yield {"event": "trainer_died", "trainer": rank - self.servers,
                           "code": code, "rank": rank}
                    continue
                who = f"server {rank}" if rank < self.servers else \
                    f"trainer {rank - self.servers} (sync mode waits for every trainer)"
                self.terminate()
                yield {"event": "failed", "rank": rank, "code": code,
                       "why": f"{who} exited with code {code}"}
                return
            if all(c is not None for c in codes) and self._events.empty():
                return

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
