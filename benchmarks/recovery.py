"""How long a job takes to recover from a lost node, and how much work it redoes: two
torchrun agents on 127.0.0.1 (the `autopar-c10d` rendezvous, `--nnodes 1:2`, one process
each) train a model with `autopar.elastic`, checkpointing every `--every` steps; at step
`--kill-at` one agent and its worker are SIGKILLed. The other re-forms a world of one,
re-plans (dp=2 -> dp=1 with two micro-batches), loads the newest checkpoint and trains
on. Once it has trained `--grow-after` steps alone, a replacement agent is started: the
world grows back to dp=2 from the newest checkpoint.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/recovery.py

Recovery time: from the kill to the first step completed after it (rank 0's history
file, wall clock). It is made of torchrun noticing the failure, the re-rendezvous
(`last_call_timeout=1`), starting Python and torch, compiling the step, and loading the
checkpoint; the worker's own account (compile seconds) is printed beside it. Steps
redone: steps completed before the kill that the restart trains again. Growing back:
from starting the replacement agent (a new Python process) to the first step of the
world of two, and the steps it redoes.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def wait_for_listener(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the first agent listens on the rendezvous port: it then hosts the rendezvous
    store, and the next agent (which would otherwise race it for the port) joins it."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the first agent ended before it listened"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listened on port {port} in {timeout} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_once(model: list[str], every: int, kill_at: int, grow_after: int, blocks: int,
             tmp: Path) -> dict:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "AUTOPAR_JOB_TOKEN": secrets.token_hex(16)}
    history = tmp / "history.jsonl"

    def agent() -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend",
               "autopar-c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
               "--rdzv-conf", "last_call_timeout=1,join_timeout=60",
               "-m", "autopar.elastic", *model, "--layout", '{"dp": 2}',
               "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", str(every),
               "--blocks", str(blocks), "--history", str(history)]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)

    agents = [agent()]
    wait_for_listener(port, agents[0])
    agents.append(agent())
    while not any(h["step"] >= kill_at for h in _history(history)):
        time.sleep(0.01)
    killed = time.time()
    for pid in [agents[1].pid, *children(agents[1].pid)]:
        os.kill(pid, signal.SIGKILL)
    agents[1].communicate()
    while len([h for h in _history(history) if h["time"] > killed]) < grow_after:
        if agents[0].poll() is not None:
            raise RuntimeError("the job ended before the replacement joined:\n"
                               + agents[0].communicate()[0][-3000:])
        time.sleep(0.01)
    grown = time.time()
    agents.append(agent())
    outs = [agents[i].communicate(timeout=1800)[0] for i in (0, 2)]
    records = _history(history)
    # rank 0 writes each step with its agent's restart count: the survivor's first step
    # after the kill is the first of restart 1 (a step can complete between the kill's
    # decision and the signal, so the clock cannot tell)
    first = next(h for h in records if h["restart"] == 1)
    before = records[:records.index(first)]
    events = [json.loads(line.split(" ", 1)[1]) for out in outs for line in out.splitlines()
              if line.startswith("@autopar-event ")]
    resumed = [e for e in events if e["event"] == "resumed"]
    compiled = [e["seconds"] for e in events if e["event"] == "compiled"]
    # the world of two's first step follows the checkpoint it loaded; the world of one
    # may have trained a step of that number too before it was stopped: the last one is
    # the world of two's
    regrown = [h for h in records if h["step"] == resumed[-1]["step"] + 1]
    assert regrown and [e["world"] for e in resumed] == [2, 1, 2], (resumed, outs)
    regrown = regrown[-1]
    at_grow = max(h["step"] for h in records if h["time"] < regrown["time"])
    return {"recovery_s": first["time"] - killed,
            "redone": max(h["step"] for h in before) - (first["step"] - 1),
            "loaded": resumed[1]["step"],
            "compile_s": compiled[1], "grow_s": regrown["time"] - grown,
            "grow_redone": at_grow - (regrown["step"] - 1),
            "ok": ([agents[i].returncode for i in (0, 2)] == [0, 0]
                   and [e["world"] for e in resumed] == [2, 1, 2])}


def _redone(run: dict) -> str:
    return f"{run['redone']} (from step {run['loaded']})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=8)
    p.add_argument("--grow-after", type=int, default=20,
                   help="steps the survivor trains alone before the replacement starts")
    p.add_argument("--blocks", type=int, default=None,
                   help="the data set's blocks, one a step (default: enough steps that the "
                        "replacement joins mid-run: 800 for gpt2-tiny, 200 for llama-small4)")
    p.add_argument("--models", nargs="+", default=["gpt2-tiny", "llama-small4"])
    args = p.parse_args()
    known = {"gpt2-tiny": ("gpt2-tiny, batch 8", 800),
             "llama-small4": ("llama-small4, batch 16", 200)}
    for model in args.models:
        name, blocks = known.get(model, (model, 800))
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run_once([model], args.every, args.kill_at, args.grow_after,
                                     args.blocks or blocks, Path(tmp)))
        assert all(r["ok"] for r in runs), runs
        print(f"| {name} | {statistics.median(r['recovery_s'] for r in runs):.1f} | "
              f"{statistics.median(r['compile_s'] for r in runs):.1f} | "
              f"{', '.join(_redone(r) for r in runs)} | "
              f"{statistics.median(r['grow_s'] for r in runs):.1f} | "
              f"{', '.join(str(r['grow_redone']) for r in runs)} |", flush=True)
    print(f"columns: model | recovery s (median of {args.repeat}) | of which compiling the "
          f"re-planned step s | steps redone per run, and the checkpoint loaded (every "
          f"{args.every} steps, saved in the background; kill after step {args.kill_at}) | "
          f"growing back s (median), from starting the replacement {args.grow_after} steps "
          f"after the kill to the first step of two | "
          f"steps redone by growing back, per run")


if __name__ == "__main__":
    main()
