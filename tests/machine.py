"""What the test machine as a whole is doing, for the suite's timeline (tests/conftest.py,
tests/dist/jobs.py)."""

import os


def busy_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (/proc/stat: all
    but idle and iowait), 0 where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
