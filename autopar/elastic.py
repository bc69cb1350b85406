"""Elastic training: the per-rank program of `autopar train --elastic`, started by torchrun
with `--nnodes MIN:MAX --max-restarts K`.

torchrun restarts every worker when one fails, and its c10d rendezvous re-forms the
group with the nodes still alive (or with replacements). Each start of this program:

1. re-plans the layout for the world size it finds (`replan`): tp and pp stay, dp is
   what the world holds; the global batch stays (the micro-batch size per rank stays
   too: gradient accumulation grows as dp shrinks), or, with `keep="per-rank-batch"`,
   the per-rank batch stays and the global batch follows dp;
2. loads the newest intact checkpoint of `--checkpoint-dir` (a broken or unfinished one
   is skipped with a warning that names it), resharded into the new layout, with the
   data-block master's state saved in it;
3. trains on: each step rank 0 leases the blocks of one global batch from the master
   (runtime/blocks.py, kept in torchrun's own store), every rank reads them, and after
   the optimizer step rank 0 reports them done; every `checkpoint_every` steps the
   weights and the master's state are saved together.

A block trained after the last checkpoint is trained again after a restart, once: the
restored master holds it in TODO, and the leases in flight at the failure go back to
the front of TODO. In the committed model (the last checkpoint and the steps after it)
every block is trained exactly once per epoch.

Data: sample `s` is row `s % G` of the example's global batch `s // G` (`G` its global
batch size), so a data set of `blocks` blocks of `block_size` samples needs nothing but
the example's batch generator. Rank 0 reports progress as events (logs.emit) and, with
`--history`, appends each step's blocks to a JSON-lines file (what the fault tests read).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.layout import Layout

CHECKPOINT_PREFIX = "step-"
KEEP = ("global-batch", "per-rank-batch")


class ElasticError(RuntimeError):
    """The job cannot go on in the world it re-formed with; says what would work."""


# -- the layout for a new world size --------------------------------------------------------

def replan(layout: Layout, world: int, global_batch: int, keep: str = "global-batch"
           ) -> tuple[Layout, int]:
    """The layout for `world` processes from the one the job was started with (`layout`,
    for its global batch `global_batch`), and the global batch it trains."""
    if keep not in KEEP:
        raise ElasticError(f"keep must be one of {', '.join(KEEP)}, got {keep!r}")
    model_parallel = layout.tp * layout.pp
    if world % model_parallel:
        fits = [k * model_parallel for k in range(1, 5)]
        raise ElasticError(
            f"{world} processes cannot hold tp={layout.tp} x pp={layout.pp}: the world size "
            f"must be a multiple of {model_parallel} ({', '.join(map(str, fits))}, ...); "
            f"give --nnodes / --nproc-per-node that make one")
    dp = world // model_parallel
    if keep == "per-rank-batch":
        per_rank = global_batch // (layout.dp * layout.microbatches)
        return dataclasses.replace(layout, dp=dp), per_rank * dp * layout.microbatches
    micro_size = global_batch // (layout.dp * layout.microbatches)  # per rank and micro-batch
    micro = layout.microbatches
    if global_batch % (dp * micro_size) == 0:
        micro = global_batch // (dp * micro_size)
    if global_batch % (dp * micro):
        raise ElasticError(
            f"the global batch of {global_batch} does not split over dp={dp} x "
            f"microbatches={micro} ({world} processes); run on a world size where "
            f"{global_batch} divides by dp, or keep the per-rank batch instead")
    if layout.pp > 1 and micro < layout.pp:
        micro = layout.microbatches
    return dataclasses.replace(layout, dp=dp, microbatches=micro), global_batch


# -- the data set as blocks -----------------------------------------------------------------

class BlockData:
    """The samples of blocks, from an example's batch generator (see the module docstring)."""

    def __init__(self, data, example_batch_size: int, block_size: int):
        self.data, self.g, self.block_size = data, example_batch_size, block_size

    @functools.lru_cache(maxsize=8)  # noqa: B019  (one instance per process)
    def _source(self, k: int) -> tuple[torch.Tensor, ...]:
        return self.data(k)

    def batch(self, blocks: list[int]) -> tuple[torch.Tensor, ...]:
        """The blocks' samples, in order, as one batch (dim 0)."""
        ids = [b * self.block_size + i for b in blocks for i in range(self.block_size)]
        parts = [tuple(x[s % self.g:s % self.g + 1] for x in self._source(s // self.g))
                 for s in ids]
        return tuple(torch.cat(column) for column in zip(*parts))


# -- checkpoints in a directory -------------------------------------------------------------

def _step_of(path: Path) -> int | None:
    tail = path.name[len(CHECKPOINT_PREFIX):]
    return int(tail) if path.name.startswith(CHECKPOINT_PREFIX) and tail.isdigit() else None


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest intact checkpoint under `directory` (rank 0 only). An unfinished save
    and a checkpoint whose files changed are skipped with a warning naming them."""
    from autopar.runtime.checkpoint import CheckpointError, verify_intact

    if not directory.is_dir():
        return None
    for leftover in sorted(directory.glob(CHECKPOINT_PREFIX + "*.tmp-*")):
        warnings.warn(f"ignoring {leftover}: a save that did not finish", stacklevel=2)
    found = sorted((p for p in directory.iterdir() if _step_of(p) is not None),
                   key=_step_of, reverse=True)
    for path in found:
        try:
            verify_intact(path)
            return path
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {path}: {e}; using the one before it",
                          stacklevel=2)
    return None


PROGRESS_FILE = "progress.json"


def _write_progress(directory: Path, progress: dict) -> None:
    """Rank 0, before each step and after it: the steps done and the blocks of the step
    under way (none once it is done), so that a restart can say what it redoes (written
    by rename: never half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (PROGRESS_FILE + ".tmp")
    tmp.write_text(json.dumps(progress))
    os.replace(tmp, directory / PROGRESS_FILE)


def _read_progress(directory: Path) -> dict:
    try:
        return json.loads((directory / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _prune(directory: Path, keep: int) -> None:
    found = sorted((p for p in directory.iterdir() if _step_of(p) is not None), key=_step_of)
    for old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# -- the worker -----------------------------------------------------------------------------

def _store() -> dist.Store:
    """torchrun's store (the agent's TCPStore), which outlives a restart of the workers;
    without torchrun (one process), a store of this process's own."""
    if "MASTER_ADDR" not in os.environ:
        return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(minutes=5))


def _broadcast(obj):
    """Rank 0's `obj` on every rank (a world of one runs without a process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class HangWatch:
    """A step's watch: if `seconds` pass between `arm` and the next `arm` (or `cancel`),
    every thread's Python stack is written to this process's stderr, once, and the
    process goes on. A rank stuck in a collective that its peers left then shows where it
    and each of them waits, in torchrun's output, without attaching a debugger. 0: none.

    A Python thread (threading.Timer) writes the stacks, holding the GIL while it reads
    them (`sys._current_frames`); a thread stuck in a collective has released it.
    faulthandler's watchdog reads them without the GIL, and so can crash the process it
    watches (SIGSEGV in 4 of 10 runs of a 20 ms watch under load): a step that is only
    slow must not end the job."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        self.cancel()
        if self.seconds > 0:
            self._timer = threading.Timer(self.seconds, self._dump)
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _dump(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = [f"autopar.elastic: this step has run for over {self.seconds:g} s "
                 f"(--dump-stacks-after); every thread's stack, most recent call last:\n"]
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue  # this watch's own thread
            parts.append(f"\nThread {names.get(ident, ident)}:\n")
            parts.extend(traceback.format_stack(frame))
        sys.__stderr__.write("".join(parts))
        sys.__stderr__.flush()


def run(args: argparse.Namespace) -> None:
    from autopar.api import LAYOUT_ERRORS
    from autopar.api import compile as compile_step
    from autopar.examples import load_model_spec
    from autopar.logs import emit
    from autopar.runtime.blocks import BlockMaster, BlockQueues
    from autopar.runtime.mesh import init_world, launched_rank, launched_world_size
    from autopar.train_worker import make_optimizer, refuse

    torch.set_num_threads(1)
    world, rank0 = launched_world_size(), launched_rank() == 0
    if world > 1:
        # before compile's own set-up: every group of the job takes this timeout
        init_world(timedelta(seconds=args.collective_timeout))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    overrides = {"batch": args.batch} if args.batch else {}
    example = load_model_spec(args.model, **overrides)
    g = example.batch[0].shape[0]
    start_layout = Layout.from_dict(json.loads(args.layout))
    pass_options = json.loads(args.pass_options) if args.pass_options else None
    layout, global_batch = replan(start_layout, world, g, args.keep)
    block_size = g if args.keep == "global-batch" else g // (start_layout.dp * start_layout.microbatches)
    per_step = global_batch // block_size
    if args.blocks % per_step:
        raise ElasticError(f"--blocks {args.blocks} is not a multiple of the {per_step} blocks "
                           f"each step trains on {world} processes")
    data = BlockData(example.data or (lambda k: example.batch), g, block_size)
    started = time.perf_counter()
    try:
        step = compile_step(example.model, None, data.batch(list(range(per_step))),
                            example.loss_fn, optimizer=make_optimizer(args.optimizer, args.lr),
                            layout=layout, pass_options=pass_options)
    except LAYOUT_ERRORS as exc:
        refuse(exc)
    directory = Path(args.checkpoint_dir)
    found = _broadcast(str(latest_checkpoint(directory)) if rank0 else None)
    found = None if found == "None" else found
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    master = BlockMaster(_store(), args.blocks, args.lease_timeout,
                         prefix=f"autopar/elastic/{run_id}/blocks", worker=f"rank{launched_rank()}")
    extra = step.load(found) if found else {}
    if rank0:
        progress = _read_progress(directory)
        master.load_state_dict(extra.get("blocks", BlockQueues(args.blocks, args.lease_timeout)
                                         .state_dict()))
        emit("compiled", seconds=time.perf_counter() - started, layout=str(layout),
             passes=[r.summary() for r in step.pass_results], description=example.description)
        emit("resumed", restart=restart, world=world, layout=str(layout),
             global_batch=global_batch, checkpoint=found, step=step.steps,
             total_steps=args.blocks * args.epochs // per_step,
             steps_redone=max(0, progress.get("reached", 0) - step.steps),
             requeued_blocks=progress.get("in_flight", []))
    if dist.is_initialized():
        dist.barrier()
    total = args.blocks * args.epochs // per_step
    pending = None  # the background save under way
    watch = HangWatch(args.dump_stacks_after)
    history = Path(args.history) if args.history else None
    while True:
        watch.arm()  # one step: its lease, the step, its save
        leases = None
        if rank0:
            state = master.state()
            if state.epoch < args.epochs:
                leases = [master.lease() for _ in range(per_step)]
                if any(lease is None for lease in leases):
                    raise ElasticError(f"the master had fewer than {per_step} blocks to lease "
                                       f"({state.state_dict()})")
        blocks = _broadcast(None if leases is None else [(l.block, l.epoch) for l in leases])
        if blocks is None:
            break
        if rank0:
            _write_progress(directory, {"reached": step.steps, "in_flight": blocks})
        t0 = time.perf_counter()
        batch = data.batch([b for b, _ in blocks])
        loss = step(*batch).item()
        if rank0:
            refused = [lease for lease in leases if not master.finish(lease)]
            if refused:
                raise ElasticError(f"leases {refused} expired during their step: raise "
                                   f"--lease-timeout above the step time")
            # before the history line: whoever sees the step committed sees it counted
            _write_progress(directory, {"reached": step.steps, "in_flight": []})
            if history is not None:
                with open(history, "a") as f:
                    f.write(json.dumps({"step": step.steps, "restart": restart,
                                        "blocks": blocks, "loss": loss,
                                        "time": time.time()}) + "\n")
            emit("step", step=step.steps, steps=total, loss=loss,
                 seconds=time.perf_counter() - t0, tokens=batch[0].numel())
        if step.steps % args.checkpoint_every == 0:
            pending = _save(step, directory, master, args, rank0, pending)
    watch.arm()  # the last save and the final weights
    if step.steps % args.checkpoint_every:
        pending = _save(step, directory, master, args, rank0, pending)
    _finish_save(pending, directory, args, rank0)
    if args.out:
        weights = step.full_state_dict()
        if rank0:
            torch.save(weights, args.out)
    watch.cancel()
    if rank0:
        emit("finished", step=step.steps, restart=restart)


def _save(step, directory: Path, master, args, rank0: bool, pending):
    """Save the step and the master's state (the previous background save is finished
    first); returns the new background save, or None."""
    from autopar.logs import emit

    _finish_save(pending, directory, args, rank0)
    path = directory / f"{CHECKPOINT_PREFIX}{step.steps:08d}"
    state = _broadcast(master.state_dict() if rank0 else None)
    t0 = time.perf_counter()
    pending = step.save(path, extra={"blocks": state}, background=not args.sync_checkpoints)
    if rank0:
        emit("saving" if pending else "saved", path=str(path),
             seconds=time.perf_counter() - t0)
        if pending is None:
            _prune(directory, args.keep_checkpoints)
    return pending


def _finish_save(pending, directory: Path, args, rank0: bool) -> None:
    from autopar.logs import emit

    if pending is None:
        return
    t0 = time.perf_counter()
    pending.wait()
    if rank0:
        _prune(directory, args.keep_checkpoints)
        emit("saved", path=str(pending.path), seconds=time.perf_counter() - t0)


def check_pass_options(text: str) -> None:
    """Refuse a --pass-options that is not a JSON object of PassOptions fields, naming the
    flag (before any rank traces the model)."""
    from autopar.compiler.passes.base import PassOptions

    try:
        options = json.loads(text)
        if not isinstance(options, dict):
            raise ValueError(f"a JSON object of PassOptions fields is needed, got {text!r}")
        PassOptions.of(options)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"--pass-options: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autopar.elastic")
    parser.add_argument("model")
    parser.add_argument("--layout", required=True, help="the starting Layout's fields as JSON")
    parser.add_argument("--pass-options", default=None,
                        help="PassOptions fields as JSON, e.g. a Plan's pass_options")
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--keep-checkpoints", type=int, default=2)
    parser.add_argument("--sync-checkpoints", action="store_true",
                        help="save on the training thread (default: in the background, "
                             "torch.distributed.checkpoint.async_save)")
    parser.add_argument("--blocks", type=int, default=16, help="data set size in blocks")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--keep", choices=KEEP, default="global-batch")
    parser.add_argument("--batch", type=int, default=None, help="the example's global batch")
    parser.add_argument("--lease-timeout", type=float, default=600.0)
    parser.add_argument("--dump-stacks-after", type=float, default=600.0,
                        help="seconds: write every thread's Python stack to stderr when "
                             "one step (its lease, the step and its save) takes longer, "
                             "to show where each rank waits if a collective hangs (0: never)")
    parser.add_argument("--collective-timeout", type=float, default=900.0,
                        help="seconds a collective waits for its peers before it raises: a "
                             "rank that stopped answering then fails the workers and torchrun "
                             "restarts them from the last checkpoint (torch's default: 1800 "
                             "on gloo)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--history", default=None, help="append each step's blocks here")
    parser.add_argument("--out", default=None, help="save the final weights here (torch.save)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.checkpoint_every < 1 or args.keep_checkpoints < 1 or args.epochs < 1:
        raise SystemExit("--checkpoint-every, --keep-checkpoints and --epochs must be >= 1")
    if args.dump_stacks_after < 0:
        raise SystemExit("--dump-stacks-after must be >= 0 seconds (0: never)")
    if not args.collective_timeout > 0:
        raise SystemExit(f"--collective-timeout must be > 0 seconds, not "
                         f"{args.collective_timeout}")
    if args.pass_options is not None:
        check_pass_options(args.pass_options)
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
