"""The torchrun jobs that run the multi-process cases (tests/dist/runner.py), for
test_dist.py's pytest front.

The jobs of the cases a session selects start in a background thread as soon as
collection ends (tests/conftest.py), one job at a time, and the session runs the
single-process tests meanwhile (conftest orders test_dist.py's cases after them): those
tests run in one thread and leave the second core to the jobs. A case's test then waits
for its world's verdicts (`results`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.dist.registry import load_cases
from tests.machine import busy_seconds

ROOT = Path(__file__).resolve().parents[2]
CASES = load_cases()
# one job of 70 world-2 cases takes about 10 minutes alone, and shares the machine with
# the single-process tests
TIMEOUT_S = 2400

# cases per torchrun job: every case builds its own process groups (a DeviceMesh per
# step), and gloo keeps each group's sockets until the job ends; in one job of all 203
# world-2 cases, creating a group failed with "Broken pipe" in the 199th-202nd case once
# (each of those passed in a job of its own). A job per this many cases starts afresh.
CASES_PER_JOB = 70

# how a rank's native crash shows in torchrun's output
_NATIVE_CRASH = re.compile(r"Fatal Python error|Signal (6|11) \((SIGABRT|SIGSEGV)\)")


def _run_world(world: int, tmp_dir: Path, names: list[str] | None = None) -> dict:
    """{case: verdict} of `names` (default: every case of `world`), in jobs of at most
    CASES_PER_JOB cases."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    names = names or [n for n, (w, _) in CASES.items() if w == world]
    results: dict = {}
    for first in range(0, len(names), CASES_PER_JOB):
        chunk = names[first:first + CASES_PER_JOB]
        results.update(_run_job(world, chunk, tmp_dir / f"results_{world}_{first}.json"))
    return results


def _run_job(world: int, names: list[str], out: Path, retry: bool = True) -> dict:
    """One torchrun job running `names`: {case: verdict}. When the job dies in a case, the
    cases before it keep their verdicts (OUT.partial), the case it died in fails with the
    job's output, and the cases after it run in a new job. A case the job died in of a
    native crash (SIGABRT, SIGSEGV: torch's or gloo's C++, which no case can cause by
    Python alone) runs once more alone (`retry`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "tests.dist.runner", "--out", str(out), *names]
    label = f"world {world}: {names[0]} .. {names[-1]}"
    EVENTS.append((f"torchrun job starts, {label}", time.monotonic(), busy_seconds()))
    with tempfile.TemporaryFile("w+") as stdout_f, tempfile.TemporaryFile("w+") as stderr_f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout_f, stderr=stderr_f,
                                text=True)
        _RUNNING.add(proc)
        try:
            timed_out = _reap(proc, TIMEOUT_S, label)
        finally:
            _RUNNING.discard(proc)
            EVENTS.append((f"torchrun job ends, {label}", time.monotonic(),
                           busy_seconds()))
        stdout_f.seek(0)
        stderr_f.seek(0)
        stdout, stderr = stdout_f.read(), stderr_f.read()
    if timed_out:
        stderr += f"\n[the job ran past {TIMEOUT_S} s and was killed]"
    if out.exists():
        return json.loads(out.read_text())
    partial = Path(str(out) + ".partial")
    done: dict = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            try:
                done.update(json.loads(line))
            except ValueError:  # the line the crash cut short
                break
    crash = f"exit code {proc.returncode}\n" + stdout[-4000:] + stderr[-12000:]
    if len(done) == len(names):  # every case ran: the job died leaving; the last one fails
        done[names[-1]] = {"ok": False, "error": f"the torchrun job died after its last "
                           f"case:\n{crash}"}
        return done
    crashed, rest = names[len(done)], names[len(done) + 1:]
    error = (f"the torchrun job died in this case (after {len(done)} of its {len(names)} "
             f"cases had passed or failed):\n{crash}")
    if proc.returncode != 0 and _NATIVE_CRASH.search(crash) and retry:
        # a native crash (an abort or segfault inside torch or gloo, not a case's
        # assertion): the case runs once more in a job of its own; passing there, it
        # passes with the first crash attached as a warning, so the crash stays visible
        again = _run_job(world, [crashed], out.with_name(out.stem + "_again.json"), retry=False)
        if again[crashed]["ok"]:
            again[crashed]["crashed_once"] = error
            done[crashed] = again[crashed]
        else:
            done[crashed] = {"ok": False, "error": error + "\n\nand when rerun alone:\n"
                             + again[crashed]["error"]}
    else:
        done[crashed] = {"ok": False, "error": error}
    if rest:
        done.update(_run_job(world, rest, out.with_name(out.stem + "_rest.json")))
    return done


# {"world W: first case .. last case": CPU seconds} of each torchrun job reaped so far,
# its workers' included (tests/conftest.py counts it apart from the tests that ran
# meanwhile: a job's CPU joins this process's RUSAGE_CHILDREN when it is reaped)
JOB_CPU: dict[str, float] = {}
# (each job's start and end, time.monotonic(), busy_seconds()): the suite's
# timeline (tests/conftest.py)
EVENTS: list[tuple[str, float, float]] = []
_JOB_CPU_LOCK = threading.Lock()


def reaped_cpu() -> float:
    """CPU seconds of the torchrun jobs reaped so far."""
    with _JOB_CPU_LOCK:
        return sum(JOB_CPU.values())


def _reap(proc: subprocess.Popen, timeout: float, label: str) -> bool:
    """Wait for `proc` (ending it after `timeout` s: SIGTERM, which torchrun passes to its
    workers, then SIGKILL a minute later) and record its CPU time, its reaped workers'
    included, under `label` in JOB_CPU. True when it had to be ended."""
    deadline = time.monotonic() + timeout
    timed_out, signalled = False, None
    while True:
        try:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere (stop() at the session's end)
            proc.wait()
            return timed_out
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            with _JOB_CPU_LOCK:
                JOB_CPU[label] = JOB_CPU.get(label, 0.0) + usage.ru_utime + usage.ru_stime
            return timed_out
        now = time.monotonic()
        if now > deadline and signalled is None:
            timed_out, signalled = True, now
            os.kill(proc.pid, signal.SIGTERM)
        elif signalled is not None and now > signalled + 60:
            os.kill(proc.pid, signal.SIGKILL)
            signalled = float("inf")
        time.sleep(0.2)


class _Background:
    """The selected cases' jobs, world after world in one thread (one job at a time: the
    machine has two cores); `results` waits for a world's verdicts. With `out`, STARTED
    is written there at once, each world's verdicts as WORLD.json, and DONE once every
    world's are: xdist's workers read them (read_results_from)."""

    def __init__(self) -> None:
        self.done: dict[int, threading.Event] = {}
        self.all_done = threading.Event()
        self.results: dict[int, dict] = {}
        self.thread: threading.Thread | None = None

    def start(self, names: list[str], out: Path | None = None) -> None:
        if self.thread is not None or not names:
            return
        by_world: dict[int, list[str]] = {}
        for name in names:
            by_world.setdefault(CASES[name][0], []).append(name)
        self.done = {w: threading.Event() for w in by_world}
        tmp = Path(tempfile.mkdtemp(prefix="autopar-dist-"))
        if out is not None:  # before any test is handed out: a worker's wait_all sees it
            _write(out / "STARTED", "")

        def run() -> None:
            for world in sorted(by_world):
                chosen = by_world[world]
                try:
                    self.results[world] = _run_world(world, tmp / f"dist{world}", chosen)
                except Exception as e:  # noqa: BLE001 - every case of the world fails with it
                    self.results[world] = {n: {"ok": False, "error": f"the jobs failed: {e!r}"}
                                           for n in chosen}
                finally:
                    if out is not None:
                        _write(out / f"{world}.json", json.dumps(self.results.get(world, {})))
                    self.done[world].set()
            if out is not None:
                _write(out / "DONE", "")
            self.all_done.set()

        self.thread = threading.Thread(target=run, name="autopar-dist-jobs", daemon=True)
        self.thread.start()


def _write(path: Path, text: str) -> None:
    """Write `text` to `path` whole: a reader polling for it never sees half of it."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.rename(path)


_BACKGROUND = _Background()
_RUNNING: set[subprocess.Popen] = set()  # the torchrun jobs now running
# where an xdist worker reads the verdicts its controller's jobs write (None: this
# process runs the jobs itself, or none were started)
_RESULTS_FROM: Path | None = None
POLL_S = 1.0


def stop() -> None:
    """End the torchrun jobs still running (a session that ends early leaves none behind:
    torchrun ends its workers on SIGTERM)."""
    for proc in list(_RUNNING):
        proc.terminate()


def start(names: list[str], out: Path | None = None) -> None:
    """Start the jobs of the cases `names` in the background (writing their verdicts to
    the folder `out` too, for xdist's workers)."""
    _BACKGROUND.start(names, out)


def started() -> bool:
    return _BACKGROUND.thread is not None


def read_results_from(folder: Path) -> None:
    """On an xdist worker: the verdicts come from the controller's jobs, in `folder`."""
    global _RESULTS_FROM  # NOTE: one per worker process, set once at its start
    _RESULTS_FROM = folder


def wait_all() -> None:
    """Return once every background job has ended (at once where none were started)."""
    if started():
        _BACKGROUND.all_done.wait()
    elif _RESULTS_FROM is not None and (_RESULTS_FROM / "STARTED").exists():
        while not (_RESULTS_FROM / "DONE").exists():
            time.sleep(POLL_S)


def results(world: int, tmp_dir: Path) -> dict:
    """{case: verdict}: of the cases of `world` the background jobs run, once they are
    done (on an xdist worker, once the controller's jobs have written them); where none
    were started, of every case of `world`, run now."""
    if world in _BACKGROUND.done:
        _BACKGROUND.done[world].wait()
        return _BACKGROUND.results.get(world, {})
    if _RESULTS_FROM is not None:
        path = _RESULTS_FROM / f"{world}.json"
        while not path.exists():
            if (_RESULTS_FROM / "DONE").exists():
                raise RuntimeError(f"the controller's jobs ended without verdicts for world "
                                   f"{world} in {_RESULTS_FROM}")
            time.sleep(POLL_S)
        return json.loads(path.read_text())
    return _run_world(world, tmp_dir)
