"""Shared test settings: one thread per process (the machine has 2 cores), and Triton
kernels in Triton's interpreter (there is no GPU here). The interpreter must be chosen
before triton is first imported (collecting tests/dist imports autopar, which pulls it
in), so it is set here, before any test module is collected."""

import fcntl
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from tests.machine import busy_seconds  # noqa: E402

torch.set_num_threads(1)


def _interpreter_without_overflow_checks() -> None:
    """Triton's interpreter computes an int64 overflow check for every integer add, sub
    and mul of a kernel, then drops it: its `device_assert` asserts only with
    `debug=True`, which the interpreter's options never set. A compiled kernel without
    debug emits no check either. Turning the dead check off changes no result; it takes
    about a quarter off the CPU time of a test that runs the kernels interpreted."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    import dataclasses

    builder = interpreter.interpreter_builder
    assert not builder.options.debug, "the interpreter asserts: its overflow checks matter"
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


_interpreter_without_overflow_checks()


_DIST_CASES = "tests/dist/test_dist.py::"
_HOST: dict[str, float] = {}

# Under pytest-xdist (`-n 2`, the README's command) the controller process starts the
# torchrun jobs of the selected cases once the workers have collected them, and writes
# their verdicts to a folder; each worker's case tests read them from there (jobs.py).
# Without -n, the one pytest process does both, as the controller and the worker.
_RESULTS_KEY = "autopar_dist_results"


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _is_controller(config) -> bool:
    """An xdist controller: it runs no test, its workers do."""
    return not _is_worker(config) and bool(getattr(config.option, "numprocesses", None)) \
        and getattr(config.option, "dist", "no") != "no"


def _python_loop_seconds() -> float:
    """Seconds this host takes for 5 million additions in a Python loop: the suite's
    times follow it (it has varied 3x by the hour on the same machine)."""
    start = time.perf_counter()
    total = 0
    for i in range(5_000_000):
        total += i
    return time.perf_counter() - start


def pytest_configure(config):
    if _is_controller(config):
        config._autopar_results = tempfile.mkdtemp(prefix="autopar-dist-results-")
    elif _is_worker(config) and _RESULTS_KEY in config.workerinput:
        from tests.dist import jobs

        jobs.read_results_from(Path(config.workerinput[_RESULTS_KEY]))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist, on the controller: tell each worker where the jobs' verdicts will be."""
    node.workerinput[_RESULTS_KEY] = node.config._autopar_results


def pytest_sessionstart(session):
    if not _is_worker(session.config):
        _HOST["loop_s"] = _python_loop_seconds()
        _EVENTS.append(("the session starts", time.monotonic(), busy_seconds()))


def _part(item) -> int:
    if item.nodeid.startswith(_DIST_CASES):
        return 1
    return 2 if item.get_closest_marker("processes") else 0


def pytest_collection_modifyitems(items):
    """The single-process tests first, while the multi-process cases' torchrun jobs run in
    the background (tests/dist/jobs.py); then the cases, each waiting for its job; then
    the tests that start multi-process jobs of their own (marked `processes`: fault
    tests that kill a worker at a step, the CLI's train and bisect), one at a time, on a
    machine the background jobs no longer share (pytest_runtest_setup). xdist's
    `--dist load` hands tests out in this order."""
    items.sort(key=_part)  # stable: the files' order within each part


def _dist_names(nodeids) -> list[str]:
    return [nodeid[len(_DIST_CASES) + len("test_case["):-1] for nodeid in nodeids
            if nodeid.startswith(_DIST_CASES + "test_case[")]


def pytest_collection_finish(session):
    """Start the torchrun jobs of the multi-process cases this session selected (without
    xdist; with it, the controller does, below)."""
    config = session.config
    if config.option.collectonly or _is_worker(config) or _is_controller(config):
        return
    names = _dist_names(item.nodeid for item in session.items)
    if names:
        from tests.dist import jobs

        jobs.start(names)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist, on the controller: the first worker's collection names the selected cases
    (every worker collects the same); start their jobs, writing verdicts for the workers."""
    from tests.dist import jobs

    names = _dist_names(ids)
    if names and not jobs.started():
        jobs.start(names, Path(node.config._autopar_results))


_ALONE: list = []  # the lock file a worker holds while it runs a `processes` test


def pytest_runtest_setup(item):
    """A test that starts processes of its own runs once the background jobs are done,
    and under xdist while no other worker runs one (an exclusive lock on a file in the
    jobs' folder, which every worker shares): their fault tests time kills and restarts."""
    if _part(item) != 2:
        return
    if "tests.dist.jobs" in sys.modules:
        sys.modules["tests.dist.jobs"].wait_all()
    workerinput = getattr(item.config, "workerinput", {})
    if _RESULTS_KEY in workerinput:
        lock = open(Path(workerinput[_RESULTS_KEY]) / "processes.lock", "w")  # noqa: SIM115
        fcntl.flock(lock, fcntl.LOCK_EX)
        _ALONE.append(lock)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    while _ALONE:
        _ALONE.pop().close()  # closing the file releases its lock


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and of the children it has waited for,
    less the background torchrun jobs' (reaped by tests/dist/jobs.py's thread whenever a
    job ends, whichever test runs then; counted apart, in jobs.JOB_CPU)."""
    own = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))
    jobs = sys.modules.get("tests.dist.jobs")
    return own - (jobs.reaped_cpu() if jobs is not None else 0.0)


# (what happened, time.monotonic(), busy_seconds()) on the process that prints
# the summary: the session's start, each torchrun job's start and end (jobs.EVENTS)
_EVENTS: list[tuple[str, float, float]] = []
_CPU_START: dict[str, float] = {}  # node id -> _cpu_seconds() when its setup began


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _CPU_START[item.nodeid] = _cpu_seconds()  # returns None: pytest's own protocol runs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU time (setup, call and teardown, the processes it started and
    waited for included; the multi-process cases' torchrun jobs count apart, each under
    its own name), on its teardown report, which reaches the xdist controller. The
    suite's wall time is bound by CPU on this 2-core machine, so this, not --durations,
    says where its time goes."""
    outcome = yield
    if call.when == "teardown" and item.nodeid in _CPU_START:
        report = outcome.get_result()
        report.user_properties = [*report.user_properties,
                                  ("cpu_seconds", _cpu_seconds() - _CPU_START.pop(item.nodeid))]


def pytest_sessionfinish(session):
    if "tests.dist.jobs" in sys.modules:
        sys.modules["tests.dist.jobs"].stop()


def _properties(terminalreporter, key: str, when: str) -> list[tuple[float, str]]:
    out = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", "") != when:
                continue
            for name, value in getattr(report, "user_properties", ()):
                if name == key:
                    out.append((value, report.nodeid))
    return out


def pytest_terminal_summary(terminalreporter):
    """The host's speed when the session started, the session's timeline, the CPU time of
    each file and test, and the slowest multi-process cases by their own time (pytest's
    --durations sees only the first case of each torchrun job, which waits for it)."""
    if "loop_s" in _HOST:
        terminalreporter.write_line(f"host speed: 5 million Python additions took "
                                    f"{_HOST['loop_s']:.2f} s at the session's start")
    _write_timeline(terminalreporter)
    cpu = Counter()
    for seconds, nodeid in _properties(terminalreporter, "cpu_seconds", "teardown"):
        cpu[nodeid] += seconds
    jobs = sys.modules.get("tests.dist.jobs")
    if jobs is not None:
        with jobs._JOB_CPU_LOCK:
            cpu.update({f"{_DIST_CASES}<torchrun job, {label}>": seconds
                        for label, seconds in jobs.JOB_CPU.items()})
    if cpu:
        total = sum(cpu.values())
        per_file = Counter()
        for nodeid, seconds in cpu.items():
            per_file[nodeid.split("::")[0]] += seconds
        terminalreporter.write_sep("=", f"most CPU by file (the tests' processes and those "
                                        f"they waited for; {total:.0f} s in all)")
        for path, seconds in per_file.most_common(25):
            terminalreporter.write_line(f"{seconds:8.1f}s {seconds / total:6.1%} {path}")
        terminalreporter.write_sep("=", "most CPU by test")
        for nodeid, seconds in cpu.most_common(25):
            terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")
    times = _properties(terminalreporter, "dist_seconds", "call")
    if times:
        terminalreporter.write_sep("=", f"slowest multi-process cases (own time; "
                                        f"{len(times)} cases, {sum(t for t, _ in times):.0f} s "
                                        f"in all)")
        for seconds, nodeid in sorted(times, reverse=True)[:25]:
            terminalreporter.write_line(f"{seconds:8.2f}s {nodeid}")


def _write_timeline(terminalreporter) -> None:
    """The session's events (its start, each torchrun job's start and end) in minutes
    from its start, with the cores the machine kept busy from each event to the next."""
    if not _EVENTS:
        return
    jobs = sys.modules.get("tests.dist.jobs")
    events = sorted([*_EVENTS, *(jobs.EVENTS if jobs is not None else ())], key=lambda e: e[1])
    events.append(("the session ends", time.monotonic(), busy_seconds()))
    origin = events[0][1]
    terminalreporter.write_sep("=", f"timeline (minutes from the session's start; cores "
                                    f"busy of {os.cpu_count()} until the next line)")
    for (name, t0, busy0), (_, t1, busy1) in zip(events, events[1:]):
        # /proc/stat counts in ticks: a few seconds' share is noise
        cores = f"{(busy1 - busy0) / (t1 - t0):4.2f}" if t1 - t0 >= 5 else "    "
        terminalreporter.write_line(f"{(t0 - origin) / 60:6.1f}  {cores}  {name}")
    terminalreporter.write_line(f"{(events[-1][1] - origin) / 60:6.1f}        the session ends")
