"""Parameter-server jobs (runtime/ps.py, autopar/ps_worker.py): real processes, real
TensorPipe RPC between trainers and servers, a real SIGKILL for the fault.

Each test starts one job of tests/dist/ps_cases.py (or the CTR example's worker) with
`autopar.ps_worker.PSJob`, the launcher `autopar train --ps-servers` uses, and judges
what trainer 0 measured.
"""

from __future__ import annotations

import json
import math

import pytest

from autopar.ps_worker import PSJob

pytestmark = pytest.mark.slow


def _run(case: str, tmp_path, servers: int = 2, trainers: int = 2, *more: str) -> dict:
    out = tmp_path / case
    job = PSJob([case, "--out", str(out), *more], servers=servers, trainers=trainers,
                module="tests.dist.ps_cases",
                env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[2])})
    job.start()
    for event in job.events():
        assert event["event"] != "failed", event
    codes = [p.returncode for p in job.procs]
    assert codes == [0] * (servers + trainers), codes
    trainer = [json.loads((tmp_path / f"{case}.{servers + j}.json").read_text())
               for j in range(trainers)]
    server = [json.loads(f.read_text()) if f.exists() else None
              for f in (tmp_path / f"{case}.{s}.json" for s in range(servers))]
    # trainer 0's measurements, with what only other trainers measured
    return {**{k: v for t in trainer[1:] for k, v in t.items()}, **trainer[0],
            "trainer": trainer, "server": server}


@pytest.mark.parametrize("case", ["sync_sgd_allreduce", "sync_adagrad_servers"])
def test_sync_mode_equals_single_process_training_on_the_global_batch(case, tmp_path):
    r = _run(case, tmp_path)
    # to float rounding: each trainer sums its half of the batch, the reference the whole
    assert max(r["max_diff"].values()) <= 1e-6, r["max_diff"]
    # rows no batch touched stay bitwise as they were
    assert r["untouched"] > 0 and r["untouched_equal"]
    # the push is the unique ids of each pull and their rows, counted
    for t in r["trainer"]:
        assert t["pushed_bytes"] == t["expected_push"] > 0
    # each server stepped once per step, with both trainers' pushes
    assert r["state"]["window_sizes"] == [2] * 4
    # a request signed with another token, and a replayed one, were refused; no row moved
    assert len(r["stray_refused"]) == 2
    assert "not signed with the job's token" in r["stray_refused"][0]
    assert "repeats an earlier one" in r["stray_refused"][1]
    assert r["stray_rows_equal"] and r["refused_count"] == 2


def test_sync_mode_divides_by_the_global_batchs_count_of_labelled_tokens(tmp_path):
    r = _run("sync_ignore_index", tmp_path, servers=1)
    assert max(r["max_diff"].values()) <= 1e-6, r["max_diff"]
    # each trainer's loss divides its tokens' sum by the batch's mean count per trainer,
    # so the trainers' losses average to the whole batch's
    for k, ref in enumerate(r["ref_losses"]):
        mean = sum(t["losses"][k] for t in r["trainer"]) / len(r["trainer"])
        assert abs(mean - ref) <= 1e-5, (k, mean, ref)


def test_async_mode_applies_every_push_and_learns(tmp_path):
    r = _run("async", tmp_path)
    for server in r["servers"]:
        assert server["pushes"] == server["applied"] == r["trainers"] * r["steps"]
        assert set(server["window_sizes"]) == {1}
    # the threshold: half-way from the start to what single-process training reaches
    threshold = r["reference"] + 0.5 * (r["start"] - r["reference"])
    assert r["reference"] < r["start"] and r["final"] < threshold, r


def test_half_async_waits_for_its_fraction_of_trainers(tmp_path):
    r = _run("half_async", tmp_path, trainers=3)
    assert r["needed"] == math.ceil(0.6 * 3) == 2
    stats = [s["server"] for s in r["server"]]
    # server 0 formed each window of 2 trainers, or of every trainer still training
    formed = stats[0]["windows_formed"]
    assert sum(len(members) for members, _ in formed) == r["trainers"] * r["steps"]
    for members, live in formed:
        assert len(members) == len(set(members)) == min(2, live), formed
    for server in stats:
        assert server["pushes"] == r["trainers"] * r["steps"]
        # every server applied the same windows, each with all its members' pushes
        assert sorted(server["window_sizes"]) == sorted(len(m) for m, _ in formed)
        assert server["window_sizes"] == server["window_needed"]


def test_geo_mode_adds_each_change_exactly(tmp_path):
    r = _run("geo", tmp_path)
    assert r["exact"]
    assert r["geo_rows_pushed"] == r["geo_rows_touched"] > 0


def test_a_checkpoint_of_two_servers_loads_onto_three(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = _run("reshard", tmp_path, 2, 2, "--ckpt", ckpt)
    assert saved["saved"] == ["ps.json", "server0-of-2.pt", "server1-of-2.pt"]
    (tmp_path / "reshard.2.json").rename(tmp_path / "first.json")
    loaded = _run("reshard", tmp_path, 3, 2, "--ckpt", ckpt)
    assert loaded["servers"] == 3
    assert max(loaded["max_diff"].values()) <= 1e-6, loaded["max_diff"]


def _listening(pid: int) -> list[str]:
    """The addresses a process listens on over TCP (its socket inodes matched against
    the kernel's LISTEN table)."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    out.append(cols[1])
    return out


def test_async_survives_a_trainer_killed_mid_run():
    steps = 40
    job = PSJob(["ctr", "--steps", str(steps), "--mode", "async", "--slow", "1",
                 "--model-args", json.dumps({"fields": 2, "rows": 1000, "batch": 16})],
                servers=2, trainers=2, mode="async").start()
    killed_at, last_step, died, servers, listening = None, {}, [], [], []
    for event in job.events():
        if event["event"] == "step" and not listening:  # every process is up
            listening = [_listening(p.pid) for p in job.procs]
        if event["event"] == "step":
            last_step[event["trainer"]] = event["step"]
            if event["trainer"] == 1 and event["step"] == 3 and killed_at is None:
                job.kill(1)
                killed_at = event["step"]
        elif event["event"] == "trainer_died":
            died.append(event)
        elif event["event"] == "server":
            servers.append(event)
        assert event["event"] != "failed", event
    assert killed_at == 3
    assert [d["trainer"] for d in died] == [1] and died[0]["code"] == -9
    assert last_step[0] == steps and last_step[1] < steps
    assert [p.returncode for p in job.procs] == [0, 0, 0, -9]
    assert sorted(s["server"] for s in servers) == [0, 1]
    assert all(s["dead"] == ["trainer1"] for s in servers)
    # the servers listen on the job's own address (loopback: a one-machine job) only
    assert all(listening[:2]), listening
    assert {addr.split(":")[0] for addrs in listening[:2] for addr in addrs} == {"0100007F"}


def test_a_table_of_ten_million_rows_lives_only_on_the_servers():
    """A 10^7 x 64 table (2.4 GiB in fp32), on the meta device in the user's model:
    each of 2 servers makes and holds its 5 * 10^6 rows; a trainer's peak memory stays
    far below one shard (it holds the rows of its batch only)."""
    rows, dim = 10**7, 64
    job = PSJob(["ctr", "--steps", "4", "--mode", "async", "--optimizer", "sgd",
                 "--model-args", json.dumps({"fields": 1, "rows": rows, "dim": dim,
                                             "batch": 64, "tables_on": "meta"})],
                servers=2, trainers=2, mode="async").start()
    servers, trainers = [], []
    for event in job.events():
        assert event["event"] not in ("failed", "trainer_died"), event
        if event["event"] == "server":
            servers.append(event)
        elif event["event"] == "trainer_done":
            trainers.append(event)
    assert sorted(s["shard_rows"] for s in servers) == [[rows // 2], [rows // 2]]
    shard_mib = rows // 2 * dim * 4 / 2**20  # 1,221 MiB
    assert all(s["rss_mib"] > shard_mib for s in servers)
    assert len(trainers) == 2 and all(t["rss_mib"] < shard_mib / 2 for t in trainers), trainers
