"""How long a job takes to recover from a lost node, and how much work it redoes: two
torchrun agents on 127.0.0.1 (c10d rendezvous, `--nnodes 1:2`, one process each) train
a model with `autopar.elastic`, checkpointing every `--every` steps; at step `--kill-at`
one agent and its worker are SIGKILLed. The other re-forms a world of one, re-plans
(dp=2 -> dp=1 with two micro-batches), loads the newest checkpoint and trains on.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/recovery.py

Recovery time: from the kill to the first step completed after it (rank 0's history
file, wall clock). It is made of torchrun noticing the failure, the re-rendezvous
(`last_call_timeout=1`), starting Python and torch, compiling the step, and loading the
checkpoint; the worker's own account (compile seconds) is printed beside it. Steps
redone: steps completed before the kill that the restart trains again.
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


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_once(model: list[str], every: int, kill_at: int, blocks: int, tmp: Path) -> dict:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "AUTOPAR_JOB_TOKEN": secrets.token_hex(16)}
    history = tmp / "history.jsonl"
    agents = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
               "--rdzv-conf", "last_call_timeout=1,join_timeout=60",
               "-m", "autopar.elastic", *model, "--layout", '{"dp": 2}',
               "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", str(every),
               "--blocks", str(blocks), "--history", str(history)]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True))
        time.sleep(0.5)
    while not any(h["step"] >= kill_at for h in _history(history)):
        time.sleep(0.01)
    killed = time.time()
    for pid in [agents[1].pid, *_children(agents[1].pid)]:
        os.kill(pid, signal.SIGKILL)
    out, _ = agents[0].communicate(timeout=600)
    agents[1].communicate()
    records = _history(history)
    before = [h for h in records if h["time"] <= killed]
    after = [h for h in records if h["time"] > killed]
    events = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines()
              if line.startswith("@autopar-event ")]
    compiled = [e["seconds"] for e in events if e["event"] == "compiled"]
    return {"recovery_s": after[0]["time"] - killed,
            "redone": max(h["step"] for h in before) - (after[0]["step"] - 1),
            "compile_s": compiled[-1], "ok": agents[0].returncode == 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=8)
    p.add_argument("--blocks", type=int, default=16)
    args = p.parse_args()
    models = {"gpt2-tiny, batch 8": ["gpt2-tiny"], "llama-small4, batch 16": ["llama-small4"]}
    for name, model in models.items():
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run_once(model, args.every, args.kill_at, args.blocks, Path(tmp)))
        assert all(r["ok"] for r in runs), runs
        print(f"| {name} | {statistics.median(r['recovery_s'] for r in runs):.1f} | "
              f"{statistics.median(r['compile_s'] for r in runs):.1f} | "
              f"{', '.join(str(r['redone']) for r in runs)} |", flush=True)
    print(f"columns: model | recovery s (median of {args.repeat}) | of which compiling the "
          f"re-planned step s | steps redone per run (checkpoint every {args.every}, kill "
          f"after step {args.kill_at})")


if __name__ == "__main__":
    main()
