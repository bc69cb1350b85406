"""What every side-by-side benchmark shares: the arguments, and timing rounds that
alternate between the implementations so machine noise hits them alike."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch.distributed as dist


def timed_collective(fn: Callable) -> float:
    """Seconds of `fn` on every rank, between two barriers (the slowest rank's time)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def parser(description: str, steps: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=steps, help="timed steps per round and side")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--model", default="gpt2-small4",
                   help="a built-in example or module:factory (the benchmark folder is on the path)")
    p.add_argument("--layers", type=int, help="override the example's layer count")
    p.add_argument("--hidden", type=int, help="override the example's hidden size")
    p.add_argument("--vocab", type=int, help="override the example's vocabulary")
    p.add_argument("--out", help="also write the result (JSON) to this file")
    return p


def shape_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The example's shape as the command line overrides it (--layers/--hidden/--vocab)."""
    return {name: getattr(args, name) for name in ("layers", "hidden", "vocab")
            if getattr(args, name, None) is not None}


def time_steps(step: Callable, batch: tuple, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        step(*batch)
        times.append(time.perf_counter() - start)
    return times


def alternate(sides: dict[str, Callable], batch: tuple, rounds: int, steps: int,
              warmup: int) -> dict[str, float]:
    """Median step time of each side over `rounds` rounds of `steps` steps each."""
    for step in sides.values():
        time_steps(step, batch, warmup)
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, step in sides.items():
            samples[name] += time_steps(step, batch, steps)
    return {name: statistics.median(v) for name, v in samples.items()}


def rotated(sides: dict, batch: tuple, rounds: int, steps: int, warmup: int) -> dict:
    """`alternate`, with the order of the sides rotated every round: the differences
    measured here are a few percent, the size of the bias of always going first."""
    names = list(sides)
    for step in sides.values():
        time_steps(step, batch, warmup)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name] += time_steps(sides[name], batch, steps)
    return {name: statistics.median(v) for name, v in samples.items()}


def pass_cost(compiled: Callable, pass_name: str, layout, model, optimizer, loss_fn,
              batch: tuple, args: argparse.Namespace) -> tuple[dict, dict]:
    """What one pass costs a step: (median step seconds, first loss) of three sides, in
    rotated rounds: `compiled(passes)` with the default passes of `layout`
    ("with_pass"), the same without `pass_name` ("without_pass"), and DDP on this rank's
    chunk of each batch tensor ("ddp", its first loss averaged over the ranks)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar.compiler.passes.defaults import default_passes

    rank, world = dist.get_rank(), dist.get_world_size()
    with_pass = compiled(None)
    without = compiled([p for p in default_passes(layout) if p.name != pass_name])
    ddp = DDP(copy.deepcopy(model))
    opt = optimizer(list(ddp.parameters()))

    def ddp_step(*tensors):
        loss = loss_fn(ddp(tensors[0].chunk(world)[rank]),
                       *(t.chunk(world)[rank] for t in tensors[1:]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    first = {"with_pass": with_pass(*batch).item(), "without_pass": without(*batch).item()}
    ddp_first = ddp_step(*batch)
    dist.all_reduce(ddp_first)
    first["ddp"] = ddp_first.item() / world
    sides = {"with_pass": with_pass, "without_pass": without, "ddp": ddp_step}
    return rotated(sides, batch, args.rounds, args.steps, args.warmup), first


def eager_step(model, loss_fn, opt, local: Callable = lambda ids: ids) -> Callable:
    """A plain PyTorch training step (the baselines' side): forward on this rank's part
    of the batch (`local`), loss, backward, optimizer step."""
    def step(ids):
        mine = local(ids)
        loss = loss_fn(model(mine), mine)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def held(tensors, nbytes: bool = False) -> int:
    """Elements (or bytes) this rank stores: a DTensor's local shard, a tensor whole."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * (local.element_size() if nbytes else 1)
    return total


def local_tensors(tensors) -> list:
    """The tensors as this rank stores them: a DTensor's local shard, a tensor whole."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def peak_bytes(step: Callable, batch: tuple, held_tensors, extra_bytes: int = 0,
               resizable=()) -> dict:
    """Peak bytes of one step on this rank, counted the same way for every side:

    - held: the distinct storages the side keeps between steps (`held_tensors`: its
      parameters, their gradients if it keeps them, its optimizer state), plus
      `extra_bytes` it holds where no tensor reaches it (DDP's buckets);
    - the step's own: the most storage created inside the step alive at once, counted
      as ops run by autopar's LiveBytes (the counter autopar's memory model is judged
      against), gradients included, and what the storages in `resizable` (made before
      the step, resized in place inside it: FSDP2's unsharded parameters) grew by.

    Call it after the side's own zero_grad(set_to_none=True), so that the old
    gradients are not counted twice."""
    from autopar.compiler.analysis.live_bytes import LiveBytes, held_bytes

    held = held_bytes(local_tensors(held_tensors)) + extra_bytes
    with LiveBytes(resizable) as live:
        step(*batch)
    return {"held": held, "step": live.peak_bytes, "peak": held + live.peak_bytes,
            "peak_op": live.peak_op}


def autopar_peak(step, batch: tuple) -> dict:
    """`peak_bytes` of an autopar step (a DistributedStep or a PipelineStep): it keeps
    its parameters, the blocks its optimizer updates, buffers and optimizer state;
    its gradients live only inside the step."""
    return peak_bytes(step, batch, [*step.held_tensors(), *optimizer_state(step.optimizer)])


def report(args: argparse.Namespace, result: dict) -> None:
    """Print the result (rank 0 calls it) and write it to --out if given."""
    import json

    text = json.dumps(result, indent=1)
    print(text)
    if getattr(args, "out", None):
        with open(args.out, "w") as f:
            f.write(text + "\n")


def optimizer_state(opt) -> list:
    """The optimizer's state tensors (not its 0-dim step counters)."""
    return [t for s in opt.state.values() for t in s.values()
            if hasattr(t, "dim") and t.dim() > 0]


def start(args: argparse.Namespace):
    """One thread per process, the gloo process group, and the example model:
    (rank, world size, example)."""
    import torch

    from autopar.examples import load_model_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), load_model_spec(args.model,
                                                                   **shape_overrides(args))


def compile_timed(example, layout, optimizer):
    """autopar's step for a copy of the example's model, and the seconds compile took."""
    import copy

    import autopar

    begin = time.perf_counter()
    step = autopar.compile(copy.deepcopy(example.model), None, example.batch, example.loss_fn,
                           optimizer=optimizer, layout=layout)
    return step, time.perf_counter() - begin
