"""Start-up time of autopar's entry points: wall seconds of a fresh interpreter that runs
each one, for one or more checkouts of the package, in alternating rounds.

    python benchmarks/import_time.py [--trees . /tmp/old] [--rounds 3]

Each tree is put first on PYTHONPATH; the interpreter is this one (its torch). Prints a
markdown table of the median per entry point and tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENTRY_POINTS = {
    "autopar --help": ["-m", "autopar", "--help"],
    "import autopar.ps_worker": ["-c", "import autopar.ps_worker"],
    "import autopar.elastic": ["-c", "import autopar.elastic"],
    "import autopar; autopar.compile": ["-c", "import autopar; autopar.compile"],
}


def seconds(tree: Path, args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[tuple[str, Path], list[float]] = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            for name, argv in ENTRY_POINTS.items():
                times.setdefault((name, tree), []).append(seconds(tree.resolve(), argv))
    print("| entry point | " + " | ".join(str(t) for t in args.trees) + " |")
    print("|---|" + "---|" * len(args.trees))
    for name in ENTRY_POINTS:
        cells = [f"{statistics.median(times[name, tree]):.2f} s" for tree in args.trees]
        print(f"| `{name}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
