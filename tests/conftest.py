"""Shared test settings: one thread per process (the machine has 2 cores), and Triton
kernels in Triton's interpreter (there is no GPU here). The interpreter must be chosen
before triton is first imported (collecting tests/dist imports autopar, which pulls it
in), so it is set here, before any test module is collected."""

import os
import resource
import sys
import time
from collections import Counter

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

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


def _python_loop_seconds() -> float:
    """Seconds this host takes for 5 million additions in a Python loop: the suite's
    times follow it (it has varied 3x by the hour on the same machine)."""
    start = time.perf_counter()
    total = 0
    for i in range(5_000_000):
        total += i
    return time.perf_counter() - start


def pytest_sessionstart(session):
    _HOST["loop_s"] = _python_loop_seconds()


def pytest_collection_modifyitems(items):
    """The single-process tests first, while the multi-process cases' torchrun jobs run in
    the background (tests/dist/jobs.py); then the cases, each waiting for its job; then
    the tests that start multi-process jobs of their own (marked `processes`: fault
    tests that kill a worker at a step, the CLI's train and bisect), on a machine
    the background jobs no longer share."""
    items.sort(key=_part)  # stable: the files' order within each part


def pytest_collection_finish(session):
    """Start the torchrun jobs of the multi-process cases this session selected."""
    if session.config.option.collectonly:
        return
    names = [item.callspec.params["name"] for item in session.items
             if item.nodeid.startswith(_DIST_CASES) and hasattr(item, "callspec")]
    if names:
        from tests.dist import jobs

        jobs.start(names)


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and of the children it has waited for,
    less the background torchrun jobs' (reaped by tests/dist/jobs.py's thread whenever a
    job ends, whichever test runs then; counted apart, in jobs.JOB_CPU)."""
    own = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))
    jobs = sys.modules.get("tests.dist.jobs")
    return own - (jobs.reaped_cpu() if jobs is not None else 0.0)


_CPU: dict[str, float] = {}  # node id -> CPU seconds of its setup, call and teardown


def _machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (/proc/stat: all
    but idle and iowait), 0 where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


# the session's parts (pytest_collection_modifyitems' order), each as (name, wall clock
# and machine busy seconds at its start): where the 2 cores sit idle, and for how long
_PART_NAMES = ("single-process tests", "multi-process cases (waiting for their jobs)",
               "tests that start their own processes")
_PARTS: list[tuple[str, float, float]] = []


def _part(item) -> int:
    if item.nodeid.startswith(_DIST_CASES):
        return 1
    return 2 if item.get_closest_marker("processes") else 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Count each test's CPU time, the processes it started and waited for included; the
    multi-process cases' torchrun jobs count apart, each under its own name. The suite's
    wall time is bound by CPU on this 2-core machine, so this, not --durations, says
    where its time goes."""
    name = _PART_NAMES[_part(item)]
    if not _PARTS or _PARTS[-1][0] != name:
        _PARTS.append((name, time.monotonic(), _machine_busy_seconds()))
    start = _cpu_seconds()
    yield
    _CPU[item.nodeid] = _cpu_seconds() - start


def pytest_sessionfinish(session):
    if "tests.dist.jobs" in sys.modules:
        sys.modules["tests.dist.jobs"].stop()


def pytest_terminal_summary(terminalreporter):
    """The slowest multi-process cases by their own time (pytest's --durations sees
    only the first case of each torchrun job, which waits for the whole job), and the
    host's speed when the session started."""
    if "loop_s" in _HOST:
        terminalreporter.write_line(f"host speed: 5 million Python additions took "
                                    f"{_HOST['loop_s']:.2f} s at the session's start")
    _write_timeline(terminalreporter)
    jobs = sys.modules.get("tests.dist.jobs")
    if jobs is not None:
        with jobs._JOB_CPU_LOCK:
            _CPU.update({f"{_DIST_CASES}<torchrun job, {label}>": seconds
                         for label, seconds in jobs.JOB_CPU.items()})
    if _CPU:
        total = sum(_CPU.values())
        per_file = Counter()
        for nodeid, seconds in _CPU.items():
            per_file[nodeid.split("::")[0]] += seconds
        terminalreporter.write_sep("=", f"most CPU by file (this process and those it waited "
                                        f"for; {total:.0f} s in all)")
        for path, seconds in per_file.most_common(25):
            terminalreporter.write_line(f"{seconds:8.1f}s {seconds / total:6.1%} {path}")
        terminalreporter.write_sep("=", "most CPU by test")
        for nodeid, seconds in Counter(_CPU).most_common(25):
            terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")
    times = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == "dist_seconds" and getattr(report, "when", "") == "call":
                    times.append((value, report.nodeid))
    if times:
        terminalreporter.write_sep("=", f"slowest multi-process cases (own time; "
                                        f"{len(times)} cases, {sum(t for t, _ in times):.0f} s "
                                        f"in all)")
        for seconds, nodeid in sorted(times, reverse=True)[:25]:
            terminalreporter.write_line(f"{seconds:8.2f}s {nodeid}")


def _write_timeline(terminalreporter) -> None:
    """Each part of the session and each torchrun job: when it ran (minutes from the
    first test) and how many of the machine's cores were busy meanwhile."""
    if not _PARTS:
        return
    ends = [*_PARTS[1:], ("end", time.monotonic(), _machine_busy_seconds())]
    origin = _PARTS[0][1]
    terminalreporter.write_sep("=", f"timeline (minutes from the first test; cores busy "
                                    f"of {os.cpu_count()})")
    for (name, t0, busy0), (_, t1, busy1) in zip(_PARTS, ends):
        cores = (busy1 - busy0) / (t1 - t0) if t1 > t0 else 0.0
        terminalreporter.write_line(f"{(t0 - origin) / 60:6.1f} - {(t1 - origin) / 60:5.1f}  "
                                    f"{cores:4.2f} busy  {name}")
    jobs = sys.modules.get("tests.dist.jobs")
    for label, (t0, t1) in (jobs.JOB_SPANS.items() if jobs is not None else ()):
        terminalreporter.write_line(f"{(t0 - origin) / 60:6.1f} - {(t1 - origin) / 60:5.1f}"
                                    f"              torchrun job, {label}")
