"""Elastic training under torchrun (autopar/elastic.py): re-planning for a world size, and
real faults: a worker SIGKILLed mid-run, a whole agent (a "node") killed and replaced.

The fault tests compare the committed history with the data set: each step's blocks are
appended to a history file by rank 0; a restart redoes the steps after its checkpoint,
so the committed step k is the last line for k. Its samples, over all steps, must be
the data set times the epochs, exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from autopar.elastic import ElasticError, build_parser, latest_checkpoint, replan
from autopar.layout import Layout
from benchmarks.recovery import children, free_port, wait_for_listener

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["tests.elastic_model:slow_gpt2", "--batch", "6"]


# -- re-planning (pure) ---------------------------------------------------------------------

def test_replan_keeps_the_global_batch_by_accumulating_when_dp_shrinks():
    layout, batch = replan(Layout(dp=4, microbatches=1), 2, 8)
    assert (layout.dp, layout.microbatches, batch) == (2, 2, 8)  # micro-batch of 2 per rank
    layout, batch = replan(Layout(dp=2, tp=2), 2, 8)
    assert (layout.dp, layout.tp, batch) == (1, 2, 8)


def test_replan_can_keep_the_per_rank_batch_instead():
    layout, batch = replan(Layout(dp=4), 2, 8, keep="per-rank-batch")
    assert (layout.dp, layout.microbatches, batch) == (2, 1, 4)


def test_replan_names_the_world_sizes_that_would_work():
    with pytest.raises(ElasticError, match=r"3 processes cannot hold tp=2 x pp=1: the world "
                                           r"size must be a multiple of 2 \(2, 4, 6, 8"):
        replan(Layout(dp=2, tp=2), 3, 8)
    with pytest.raises(ElasticError, match=r"global batch of 8 does not split over dp=3"):
        replan(Layout(dp=2), 3, 8)


def test_the_cli_runs_several_nodes_through_autopars_rendezvous(monkeypatch):
    """`autopar train --elastic --nnodes` launches torchrun with the `autopar-c10d`
    rendezvous (torch's c10d cannot admit a replacement node), and torchrun finds that
    handler through its entry point; on one node it stays --standalone."""
    from torch.distributed.elastic.rendezvous.registry import handler_registry

    from autopar.cli import _elastic_command, build_parser
    from autopar.runtime.rendezvous import RepublishingRendezvous

    monkeypatch.setenv("AUTOPAR_JOB_TOKEN", "t")
    parse = build_parser().parse_args
    multi = _elastic_command(parse(["train", "gpt2-tiny", "--elastic", "--nnodes", "1:2",
                                    "--rdzv-endpoint", "h:1", "--checkpoint-dir", "c"]),
                             1, "{}")
    assert multi[multi.index("--rdzv-backend") + 1] == "autopar-c10d"
    one = _elastic_command(parse(["train", "gpt2-tiny", "--elastic", "--checkpoint-dir", "c"]),
                           2, "{}")
    assert "--standalone" in one and "--rdzv-backend" not in one
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    params = RendezvousParameters("autopar-c10d", f"127.0.0.1:{free_port()}", "cli", 1, 1,
                                  is_host=True)
    made = handler_registry.create_handler(params)
    try:
        assert isinstance(made, RepublishingRendezvous)
        assert made.get_backend() == "autopar-c10d" and made.get_run_id() == "cli"
    finally:
        made.shutdown()


def test_the_collective_timeout_reaches_the_worker_and_a_bad_one_is_refused(monkeypatch):
    """`autopar train --elastic --collective-timeout S` hands S to every worker (900 s by
    default); zero or less is refused before anything starts, by the CLI and the worker,
    naming the flag."""
    from autopar.cli import _elastic_command
    from autopar.cli import build_parser as cli_parser
    from autopar.elastic import main

    monkeypatch.setenv("AUTOPAR_JOB_TOKEN", "t")
    base = ["train", "gpt2-tiny", "--elastic", "--checkpoint-dir", "c", "--lr", "0.01",
            "--optimizer", "sgd"]
    for extra, wanted in (([], "900.0"), (["--collective-timeout", "30"], "30.0")):
        cmd = _elastic_command(cli_parser().parse_args(base + extra), 2, "{}")
        assert cmd[cmd.index("--collective-timeout") + 1] == wanted
        assert build_parser().parse_args(cmd[cmd.index("autopar.elastic") + 1:]) \
            .collective_timeout == float(wanted)
    with pytest.raises(SystemExit, match="--collective-timeout must be > 0 seconds, not 0"):
        _elastic_command(cli_parser().parse_args(base + ["--collective-timeout", "0"]), 2, "{}")
    with pytest.raises(SystemExit, match="--collective-timeout must be > 0 seconds, not -1"):
        main(["m", "--layout", "{}", "--checkpoint-dir", "c", "--collective-timeout", "-1"])


def test_a_broken_checkpoint_is_skipped_with_a_warning_that_names_it(tmp_path):
    from autopar.runtime.checkpoint import describe_tensors, save_checkpoint

    t = {"w": torch.ones(3)}
    for step in (2, 4):
        save_checkpoint(tmp_path / f"step-{step:08d}", t, None,
                        {"tensors": describe_tensors(t)})
    (tmp_path / "step-00000006.tmp-abc").mkdir()  # a save killed midway
    victim = next((tmp_path / "step-00000004").rglob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    victim.write_bytes(bytes(data))
    with pytest.warns(UserWarning) as caught:
        assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    said = " ".join(str(w.message) for w in caught)
    assert "step-00000006.tmp-abc: a save that did not finish" in said
    assert "skipping checkpoint" in said and "step-00000004" in said and "has changed" in said


# -- real processes -----------------------------------------------------------------------------

def _worker_args(tmp: Path, tag: str, layout: dict, blocks: int, epochs: int) -> list[str]:
    return ["-m", "autopar.elastic", *MODEL, "--layout", json.dumps(layout),
            "--checkpoint-dir", str(tmp / tag / "ckpt"), "--checkpoint-every", "3",
            "--blocks", str(blocks), "--epochs", str(epochs), "--optimizer", "sgd",
            "--lr", "0.05", "--history", str(tmp / tag / "history.jsonl"),
            "--out", str(tmp / tag / "weights.pt")]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "AUTOPAR_JOB_TOKEN": "elastic-test-token"}


def _committed(history: Path) -> dict[int, list]:
    steps: dict[int, list] = {}
    for line in history.read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["blocks"]  # a redone step replaces the earlier one
    return steps


def _check_exactly_once(history: Path, blocks: int, epochs: int, block_size: int) -> None:
    steps = _committed(history)
    assert sorted(steps) == list(range(1, len(steps) + 1)), sorted(steps)
    samples = Counter(b * block_size + i for blks in steps.values() for b, _ in blks
                      for i in range(block_size))
    assert samples == Counter({s: epochs for s in range(blocks * block_size)})
    per_epoch = Counter(e for blks in steps.values() for _, e in blks)
    assert per_epoch == Counter({e: blocks for e in range(epochs)})


def _rank_of(pid: int) -> int | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e for e in env if e.startswith(b"RANK=")]
    return int(found[0][5:]) if found else None


def _wait_for_step(history: Path, step: int, proc: subprocess.Popen, timeout: float,
                   checkpoints: Path | None = None) -> None:
    """Until `step` is in the history and, given `checkpoints`, a checkpoint there has
    been committed (renamed from its .tmp directory: the saves run in the background, so
    a slow one may still be in flight when the next steps run)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        reached = history.exists() and any(json.loads(line)["step"] >= step
                                           for line in history.read_text().splitlines())
        saved = checkpoints is None or (checkpoints.exists() and any(
            p.name.startswith("step-") and ".tmp" not in p.name for p in checkpoints.iterdir()))
        if reached and saved:
            return
        assert proc.poll() is None, "the job ended before the step to kill at"
        time.sleep(0.05)
    raise AssertionError(f"step {step} and a committed checkpoint not reached in {timeout} s")


@pytest.mark.processes
def test_a_step_slower_than_the_hang_watch_writes_every_threads_stack(tmp_path):
    """--dump-stacks-after: a step (its lease, the step, its save) that takes longer makes
    the worker write every thread's Python stack to stderr, and training goes on to the
    end; by default the watch waits 600 s. One process, no torchrun: the test model reads
    each batch in 50 ms, so a 20 ms watch fires during the first step."""
    assert build_parser().parse_args(["m", "--layout", "{}", "--checkpoint-dir", "c"]) \
        .dump_stacks_after == 600.0
    args = _worker_args(tmp_path, "watched", {"dp": 1}, blocks=2, epochs=1)
    out = subprocess.run([sys.executable, *args, "--dump-stacks-after", "0.02"], env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[:1500], out.stderr[-1500:])
    said = "this step has run for over 0.02 s (--dump-stacks-after)"
    assert said in out.stderr, out.stderr[-3000:]
    assert 'File "' in out.stderr and "elastic.py" in out.stderr and "in run" in out.stderr
    assert len(_committed(tmp_path / "watched" / "history.jsonl")) == 2  # trained to the end
    bad = subprocess.run([sys.executable, *args, "--dump-stacks-after", "-1"], env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--dump-stacks-after must be >= 0" in bad.stderr


@pytest.mark.slow
@pytest.mark.processes
def test_a_worker_killed_or_stopped_mid_run_loses_nothing_and_ends_with_the_same_weights(
        tmp_path):
    """3 workers, max-restarts 1, two faults in two runs, each once step 4 has begun and
    the step-3 checkpoint is committed (or a later one: the saves run in the background):
    - "killed": rank 1 is SIGKILLed;
    - "stopped": rank 1 is SIGSTOPped, as a rank hung in the kernel or on a dead link
      would be; its peers wait in their next collective until --collective-timeout (15 s)
      and raise, which fails the workers. torchrun then SIGTERMs every worker, waits 30 s
      for them (a stopped one never answers) and SIGKILLs the rest: the test SIGKILLs the
      stopped rank itself once both peers have exited, to save those 30 s.
    Either way torchrun restarts the workers, they load the checkpoint (and the master's
    state in it) and finish. Every sample is in the committed history once per epoch,
    and the final weights equal a run without a fault bit for bit."""
    blocks, epochs = 6, 2
    runs = {}
    for tag in ("clean", "killed", "stopped"):
        (tmp_path / tag).mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "3", "--max-restarts", "1",
               *_worker_args(tmp_path, tag, {"dp": 3}, blocks, epochs)]
        if tag == "stopped":
            # short, and yet far above the ranks' skew (a rank's collective waits for the
            # slowest one: the first, in compile, for the slowest trace)
            cmd += ["--collective-timeout", "15"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            if tag != "clean":
                _wait_for_step(tmp_path / tag / "history.jsonl", 4, proc, 240,
                               checkpoints=tmp_path / tag / "ckpt")
                workers = children(proc.pid)
                victim = next(p for p in workers if _rank_of(p) == 1)
                if tag == "killed":
                    os.kill(victim, signal.SIGKILL)
                else:
                    os.kill(victim, signal.SIGSTOP)
                    peers = [p for p in workers if p != victim]
                    deadline = time.time() + 75  # the timeout is 15 s; gloo's default 30 min
                    while any(_state(p) != "Z" for p in peers):
                        assert time.time() < deadline, \
                            "the stopped rank's peers did not time out"
                        time.sleep(0.1)
                    os.kill(victim, signal.SIGKILL)
            out, _ = proc.communicate(timeout=600)
        finally:  # a failed test leaves no job behind (a stopped worker never ends)
            if proc.poll() is None:
                for pid in children(proc.pid):
                    os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, out[-6000:]
        runs[tag] = out
    # gloo's words for a collective past its timeout, on both peers of the stopped rank
    errors = [line for line in runs["stopped"].splitlines() if "Error" in line]
    assert sum("Application timeout caused pair closure" in line for line in errors) == 2, \
        errors
    clean = torch.load(tmp_path / "clean" / "weights.pt")
    for tag in ("killed", "stopped"):
        events = [json.loads(line.split(" ", 1)[1]) for line in runs[tag].splitlines()
                  if line.startswith("@autopar-event ")]
        resumed = [e for e in events if e["event"] == "resumed"]
        assert [e["restart"] for e in resumed] == [0, 1], (tag, resumed)
        # the steps lost are those committed since the checkpoint (and the one under way
        # when the fault fell between its progress record and its history line)
        history = [json.loads(line) for line in
                   (tmp_path / tag / "history.jsonl").read_text().splitlines()]
        lost = max(r["step"] for r in history if r["restart"] == 0) - resumed[1]["step"]
        assert resumed[1]["checkpoint"] and lost <= resumed[1]["steps_redone"] <= lost + 1, \
            (tag, resumed[1], lost)
        _check_exactly_once(tmp_path / tag / "history.jsonl", blocks, epochs, 6)
        after = torch.load(tmp_path / tag / "weights.pt")
        assert clean.keys() == after.keys()
        for name in clean:
            assert torch.equal(clean[name], after[name]), (tag, name)


def _state(pid: int) -> str:
    """The process's state letter in /proc (Z: exited, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"


def _wait_for_record(history: Path, restart: int, step: int, proc: subprocess.Popen,
                    timeout: float) -> None:
    """Until the history holds `step` trained after restart `restart`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if history.exists() and any(
                (r["restart"], r["step"]) == (restart, step)
                for r in map(json.loads, history.read_text().splitlines())):
            return
        assert proc.poll() is None, "the job ended before the step to wait for"
        time.sleep(0.05)
    raise AssertionError(f"step {step} of restart {restart} not reached in {timeout} s")


@pytest.mark.slow
@pytest.mark.processes
def test_an_agent_killed_leaves_the_other_to_finish_and_a_replacement_grows_it_back(tmp_path):
    """Two torchrun agents on 127.0.0.1 (c10d rendezvous through autopar's `autopar-c10d`
    handler, --nnodes 1:2) stand in for two nodes of one process each.
    - Killing one agent with its worker leaves the other to re-form a world of 1: dp=2
      becomes dp=1 with two micro-batches (the global batch is kept) and the dp=2
      checkpoint is resharded into it. It trains on to step 8 and then waits
      (`ELASTIC_TEST_HOLD_AT`, so that the test does not race the replacement's start).
    - A replacement agent joins: the world grows back to dp=2 from the last checkpoint.
    Training finishes with every sample once per epoch in the committed model, and with
    the weights of a run on two processes without the kill (within rounding: the
    re-planned steps sum the batch in another order). torch's own c10d handler cannot
    admit the replacement (autopar/runtime/rendezvous.py says why)."""
    blocks, epochs = 12, 1
    port = free_port()
    (tmp_path / "run").mkdir()
    history = tmp_path / "run" / "history.jsonl"

    def agent() -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend",
               "autopar-c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
               "two-nodes", "--rdzv-conf", "last_call_timeout=1,join_timeout=60",
               *_worker_args(tmp_path, "run", {"dp": 2}, blocks, epochs)]
        return subprocess.Popen(cmd, cwd=ROOT, env={**_env(), "ELASTIC_TEST_HOLD_AT": "8"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    agents = [agent()]
    wait_for_listener(port, agents[0])  # node 0 hosts the rendezvous store
    agents.append(agent())
    _wait_for_step(history, 4, agents[0], 240, checkpoints=tmp_path / "run" / "ckpt")
    for pid in [agents[1].pid, *children(agents[1].pid)]:  # the agent and its worker:
        os.kill(pid, signal.SIGKILL)  # a node gone (torchrun starts workers in new sessions)
    agents[1].communicate()
    _wait_for_record(history, 1, 8, agents[0], 240)
    agents.append(agent())
    outs = [agents[i].communicate(timeout=600)[0] for i in (0, 2)]
    for i, out in zip((0, 2), outs):
        assert agents[i].returncode == 0, out[-6000:]
    events = [json.loads(line.split(" ", 1)[1]) for out in outs for line in out.splitlines()
              if line.startswith("@autopar-event ")]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert [e["world"] for e in resumed] == [2, 1, 2], resumed
    assert [e["layout"] for e in resumed] == ["Layout(dp=2)", "Layout(microbatches=2)",
                                              "Layout(dp=2)"]
    assert resumed[1]["restart"] == 1 and resumed[1]["checkpoint"], resumed[1]
    assert resumed[2]["step"] >= 6 and resumed[2]["checkpoint"], resumed[2]
    _check_exactly_once(tmp_path / "run" / "history.jsonl", blocks, epochs, 6)
    (tmp_path / "clean").mkdir()
    clean = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2",
                            *_worker_args(tmp_path, "clean", {"dp": 2}, blocks, epochs)],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    expected = torch.load(tmp_path / "clean" / "weights.pt")
    got = torch.load(tmp_path / "run" / "weights.pt")
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=1e-4, atol=1e-6), name
