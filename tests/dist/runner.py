"""Run many multi-process test cases in one torchrun job (one process-group start).

    torchrun --standalone --nproc-per-node 2 -m tests.dist.runner --out results.json [CASE ...]

Each case is a function registered with `@case(world=N)` in a tests/dist/cases_*.py
module (tests/dist/registry.py); it raises AssertionError on failure. Every rank runs every case; rank 0
writes {case: {"ok": bool, "error": str, "seconds": float}} with the errors of all ranks
(and rank 0's time in the case). Rank 0 also appends
each verdict to OUT.partial as it comes (one JSON line per case), so that when the job dies
in a case (a native crash kills the process, not the case), the cases before it keep their
verdicts and the one that crashed is known; a crash prints every thread's Python stack.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from tests.dist.registry import load_cases


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # a case that deadlocks fails after this long instead of stalling the whole suite
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = load_cases()
    names = args.cases or [n for n, (w, _) in cases.items() if w == world]
    results = {}
    partial = open(args.out + ".partial", "w") if rank == 0 else None  # noqa: SIM115
    for name in names:
        if rank == 0:
            print(f"[case] {name}", file=sys.stderr, flush=True)
        error = ""
        start = time.perf_counter()
        try:
            cases[name][1]()
        except Exception:  # noqa: BLE001 - reported to pytest, which fails the case
            error = traceback.format_exc()
        errors = [None] * world
        dist.all_gather_object(errors, error)
        bad = [f"[rank {r}] {e}" for r, e in enumerate(errors) if e]
        results[name] = {"ok": not bad, "error": "\n".join(bad),
                         "seconds": round(time.perf_counter() - start, 2)}
        if partial is not None:
            partial.write(json.dumps({name: results[name]}) + "\n")
            partial.flush()
        dist.barrier()
    if rank == 0:
        partial.close()
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    # NOTE: a rank that tears its gloo group down while a peer is still in it can abort
    # the peer; leave together.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.enable(all_threads=True)
    main()
