"""Shared test settings: one thread per process (the machine has 2 cores), and Triton
kernels in Triton's interpreter (there is no GPU here). The interpreter must be chosen
before triton is first imported (collecting tests/dist imports autopar, which pulls it
in), so it is set here, before any test module is collected."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_terminal_summary(terminalreporter):
    """The slowest multi-process cases by their own time (pytest's --durations sees
    only the first case of each torchrun job, which waits for the whole job)."""
    times = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == "dist_seconds" and getattr(report, "when", "") == "call":
                    times.append((value, report.nodeid))
    if times:
        terminalreporter.write_sep("=", "slowest multi-process cases (own time)")
        for seconds, nodeid in sorted(times, reverse=True)[:25]:
            terminalreporter.write_line(f"{seconds:8.2f}s {nodeid}")
