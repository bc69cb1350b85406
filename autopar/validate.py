"""`autopar validate`: the cost model's predicted step time against measured runs.

Each layout is trained for a few steps under torchrun (the `autopar train` worker,
one thread per process); the measured step time is the median over the steps
after `warmup`. The prediction is `autopar.estimate` of the same model (built on
the meta device) on the given cluster spec, best one written by `autopar
calibrate`. Peak memory is not compared: a CPU process's resident memory mixes the
allocator's caches and the interpreter with the step's tensors.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.layout import Layout

# layouts of 2 processes covering dp, tp, pp, accumulation, schedules, buckets, ZeRO and
# recomputation
DEFAULT_LAYOUTS = (Layout(dp=2), Layout(dp=2, bucket_mb=1.0), Layout(tp=2),
                   Layout(pp=2, microbatches=2), Layout(pp=2, microbatches=4, schedule="gpipe"),
                   Layout(pp=2, microbatches=4, schedule="zero-bubble"),
                   Layout(dp=2, microbatches=2), Layout(dp=2, zero=2),
                   Layout(dp=2, recompute="full"))


@dataclass(frozen=True)
class Row:
    layout: Layout
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def measure(model: str, layout: Layout, steps: int, warmup: int) -> float:
    """Median seconds per step after `warmup` steps, from the train worker's events."""
    from autopar.train_worker import EVENT_PREFIX

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={layout.world_size}", "-m", "autopar.train_worker", model,
           "--layout", json.dumps(layout.non_default_fields()), "--steps", str(steps + warmup)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{layout}: training failed (exit {done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    seconds = [json.loads(line[len(EVENT_PREFIX):])["seconds"]
               for line in done.stdout.splitlines()
               if line.startswith(EVENT_PREFIX) and '"event": "step"' in line]
    return statistics.median(seconds[warmup:])


def validate(model: str, cluster: ClusterSpec, layouts: Sequence[Layout] = DEFAULT_LAYOUTS,
             steps: int = 5, warmup: int = 2,
             progress: Callable[[Row], None] | None = None) -> list[Row]:
    import torch

    from autopar.compiler.planner.estimate import estimate
    from autopar.examples import load_model_spec

    with torch.device("meta"):
        example = load_model_spec(model)
    rows = []
    for layout in layouts:
        spec = ClusterSpec.from_dict({**cluster.to_dict(), "nodes": 1,
                                      "devices_per_node": layout.world_size})
        pred = estimate(example.model, spec, layout, example.batch, example.loss_fn)
        rows.append(Row(layout, pred.step_time_s, measure(model, layout, steps, warmup)))
        if progress is not None:
            progress(rows[-1])
    return rows


def median_abs_error(rows: Sequence[Row]) -> float:
    return statistics.median(abs(r.error) for r in rows)
