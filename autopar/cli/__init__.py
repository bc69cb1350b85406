"""The `autopar` command line (also `python -m autopar`).

    autopar trace MODEL             summary of the traced training graph
    autopar train MODEL --dp 2      train under torchrun, with progress (also --tp, --pp, ...)
    autopar estimate MODEL --cluster dgx-h100 --dp 8    predicted step time and memory
    autopar plan MODEL --cluster dgx-h100 --report plan.html   the fastest layout that fits
    autopar calibrate --output local.yaml    measure this machine (matmul, memory, gloo; NCCL on GPUs)
    autopar validate MODEL --cluster local.yaml   predicted vs measured step times
    autopar kernels MODEL --out DIR  the fused Triton kernels of MODEL's training step
    autopar check MODEL --tp 2      every rank's collectives agree (no process launched)
    autopar bisect MODEL --tp 2     the first node where the parallel step departs from the
                                    single-process step (under torchrun)

MODEL is a built-in example (`autopar trace --list`) or `pkg.module:factory`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.table import Table

from autopar.cli.common import bytes_whose, cluster_from_args, console
from autopar.cli.planning import add_planner_commands
from autopar.costs import OPTIMIZER_STATES
from autopar.layout import RECOMPUTE
from autopar.logs import configure_from_env
from autopar.runtime.rendezvous import BACKEND as RENDEZVOUS


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


# -- autopar trace ------------------------------------------------------------------------

def cmd_trace(args: argparse.Namespace) -> int:
    from autopar.api import trace
    from autopar.compiler.ir.printing import graph_text, summary
    from autopar.examples import EXAMPLES, load_model_spec

    if args.list:
        for name in EXAMPLES:
            console.print(f"{name:14s} {load_model_spec(name).description}")
        return 0
    if not args.model:
        raise SystemExit("autopar trace: give a MODEL (or --list)")
    example = load_model_spec(args.model)
    start = time.perf_counter()
    tg = trace(example.model, example.batch, example.loss_fn)
    seconds = time.perf_counter() - start
    info = summary(tg)
    info["trace_seconds"] = round(seconds, 3)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        _print_summary(args.model, example.description, info)
    if args.ir:
        with open(args.ir, "w") as f:
            f.write(graph_text(tg))
        console.print(f"IR written to {args.ir}")
    return 0


def _print_summary(name: str, description: str, info: dict) -> None:
    console.print(f"[bold]{name}[/bold]: {description}")
    console.print(f"traced in {info['trace_seconds']:.2f} s: {info['nodes']} ops, "
                  f"{_fmt_count(info['parameters'])} parameters in {info['parameter_tensors']} "
                  f"tensors, {info['buffers']} buffers, "
                  f"{_fmt_count(info['flops_per_step'])}FLOP per step (fwd+bwd matmuls)")
    roles = Table(title="ops by role")
    roles.add_column("role")
    roles.add_column("ops", justify="right")
    for role, count in info["nodes_by_role"].items():
        roles.add_row(role, str(count))
    console.print(roles)
    acts = Table(title="largest activations")
    for col in ("node", "op", "module", "type", "size"):
        acts.add_column(col)
    for a in info["largest_activations"]:
        acts.add_row(a["node"], a["op"], a["module"] or "-", a["type"], _fmt_bytes(a["bytes"]))
    console.print(acts)


# -- autopar train ------------------------------------------------------------------------

def cmd_train(args: argparse.Namespace) -> int:
    from autopar.examples import check_model_spec
    from autopar.layout import LayoutError
    from autopar.train_worker import EVENT_PREFIX

    check_model_spec(args.model)  # here, not once per rank after the launch
    if args.ps_servers is not None:
        return _train_ps(args)
    args.optimizer = args.optimizer or "adamw"
    args.lr = 1e-3 if args.lr is None else args.lr
    if args.optimizer not in ("adamw", "sgd"):
        raise SystemExit(f"autopar train: --optimizer {args.optimizer} is for --ps-servers; "
                         f"collective layouts train with adamw or sgd")
    try:
        layout = _train_layout(args)
    except LayoutError as exc:
        raise SystemExit(f"autopar train: {exc}") from exc
    if args.parity and (layout.local_sgd is not None or layout.dgc is not None):
        raise SystemExit("autopar train: --parity compares every step with single-process "
                         "training, and --local-sgd / --dgc change the update by design: "
                         "drop --parity (the tests compare them with simulations of their "
                         "own)")
    if layout.dgc is not None and args.optimizer != "sgd":
        raise SystemExit("autopar train: --dgc corrects SGD's momentum; add --optimizer sgd "
                         "(SGD with momentum 0.9)")
    if args.plan:  # compile(layout=None): every rank plans on this machine's processes
        nproc, layout_arg = args.nproc or 2, "plan"
    else:
        nproc, layout_arg = args.nproc or layout.world_size, json.dumps(layout.non_default_fields())
    if args.elastic:
        cmd = _elastic_command(args, nproc, layout_arg)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "autopar.train_worker", args.model,
               "--layout", layout_arg, "--steps", str(args.steps),
               "--lr", str(args.lr), "--optimizer", args.optimizer]
        if args.parity:
            cmd.append("--parity")
        if args.save:
            cmd += ["--save", args.save]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    # torchrun's stderr, passed on as it comes until the layout is refused: then what
    # follows is torchrun's report of its failed workers, and the refusal says why
    quiet = threading.Event()
    errors = threading.Thread(target=_pass_on, args=(proc.stderr, quiet), daemon=True)
    errors.start()
    show = _Progress(args.steps, fancy=sys.stdout.isatty())
    parity_ok, refused = True, None
    for line in proc.stdout:
        if not line.startswith(EVENT_PREFIX):
            sys.stdout.write(line)
            continue
        event = json.loads(line[len(EVENT_PREFIX):])
        parity_ok &= event.get("ok", True)
        if event["event"] == "refused":  # rank 0's compile refused the layout
            refused = event["message"]
            quiet.set()
            continue
        show.handle(event)
    show.close()
    code = proc.wait()
    errors.join(timeout=10)  # a stray grandchild may hold the pipe open
    if refused is not None:
        raise SystemExit(f"autopar train: {refused}")
    if code:
        console.print(f"[red]training failed[/red] (torchrun exit code {code})")
        return code
    return 0 if parity_ok else 3


def _train_ps(args: argparse.Namespace) -> int:
    """`autopar train MODEL --ps-servers S`: S servers and --nproc trainers on this
    machine (autopar/ps_worker.py), with the lead trainer's progress."""
    from autopar.layout import Layout, LayoutError, PSLayout
    from autopar.ps_worker import PSJob

    trainers = args.nproc or 2
    try:
        Layout(dp=trainers, ps=PSLayout(servers=args.ps_servers, mode=args.mode,
                                        fraction=args.fraction, geo_k=args.geo_k,
                                        dense=args.dense))
    except LayoutError as exc:
        raise SystemExit(f"autopar train: {exc}") from exc
    if args.elastic or args.plan or args.parity or args.save:
        raise SystemExit("autopar train: --ps-servers runs its own launcher; --elastic, "
                         "--plan, --parity and --save are for collective layouts")
    worker = [args.model, "--mode", args.mode, "--steps", str(args.steps),
              "--lr", str(0.05 if args.lr is None else args.lr),
              "--optimizer", args.optimizer or "adagrad"]
    for flag, value in (("--fraction", args.fraction), ("--geo-k", args.geo_k),
                        ("--dense", args.dense), ("--slow", args.slow_trainer)):
        if value is not None:
            worker += [flag, str(value)]
    job = PSJob(worker, servers=args.ps_servers, trainers=trainers, mode=args.mode).start()
    show = _Progress(args.steps, fancy=sys.stdout.isatty())
    dead: set[int] = set()
    failed = None
    pushed = {}
    for event in job.events():
        kind = event["event"]
        lead = min(set(range(trainers)) - dead, default=None)
        if kind == "trainer_died":
            dead.add(event["trainer"])
            show._say(f"[yellow]trainer {event['trainer']} died[/yellow] (exit code "
                      f"{event['code']}); mode={args.mode}: the servers stop waiting for it "
                      f"and the other trainers go on")
        elif kind == "failed":
            failed = event["why"]
        elif kind == "server":
            show._say(f"server {event['server']}: {event['pushes']} pushes, "
                      f"{event['applied']} updates")
        elif kind == "trainer_done":
            pushed[event["trainer"]] = event
        elif kind in ("compiled", "step") and event.get("trainer") == lead:
            show.handle(event)
            if kind == "compiled":
                show._say(f"cost model: {event['comparison']}")
    show.close()
    for j, event in sorted(pushed.items()):
        console.print(f"trainer {j}: {event['pushed_bytes'] / 2**20:.2f} MiB of rows pushed, "
                      f"{event['pulled_bytes'] / 2**20:.2f} MiB pulled")
    if failed:
        console.print(f"[red]training failed[/red]: {failed}")
        return 1
    return 0


def _pass_on(stream, quiet: threading.Event, refusal: str | None = None,
             refused: list[str] | None = None) -> None:
    """Copy `stream` to stderr line by line, dropping what comes once `quiet` is set; a
    line that starts with `refusal` is kept in `refused` (not copied) and sets `quiet`."""
    for line in stream:
        if refusal is not None and line.startswith(refusal) and not quiet.is_set():
            refused.append(line)
            quiet.set()
        elif not quiet.is_set():
            sys.stderr.write(line)
            sys.stderr.flush()


def _elastic_command(args: argparse.Namespace, nproc: int, layout_arg: str) -> list[str]:
    """torchrun with elastic membership, running autopar.elastic."""
    wrong = [flag for flag, bad in (("--plan", args.plan), ("--parity", args.parity),
                                    ("--save", args.save)) if bad]
    if wrong:
        raise SystemExit(f"autopar train --elastic: {', '.join(wrong)} cannot be used with "
                         f"--elastic (the layout is re-planned from the one given at each "
                         f"restart; checkpoints go to --checkpoint-dir)")
    if not args.checkpoint_dir:
        raise SystemExit("autopar train --elastic needs --checkpoint-dir DIR, a directory "
                         "every node sees")
    if not args.collective_timeout > 0:
        raise SystemExit(f"autopar train --elastic --collective-timeout must be > 0 seconds, "
                         f"not {args.collective_timeout}")
    multi = args.nnodes != "1" or args.rdzv_endpoint
    if multi and not args.rdzv_endpoint:
        raise SystemExit(f"autopar train --elastic --nnodes {args.nnodes} needs "
                         f"--rdzv-endpoint HOST:PORT (the c10d rendezvous every node joins)")
    if multi and not os.environ.get("AUTOPAR_JOB_TOKEN"):
        raise SystemExit("autopar train --elastic on several nodes needs the job's token: "
                         "set AUTOPAR_JOB_TOKEN to the same secret on every node (for "
                         "example `python -c 'import secrets; print(secrets.token_hex(16))'`)")
    # one node: a fresh token, which only this launch's workers inherit
    os.environ.setdefault("AUTOPAR_JOB_TOKEN", secrets.token_hex(16))
    # autopar-c10d: torch's c10d rendezvous, which also admits a replacement node
    launch = (["--nnodes", args.nnodes, "--rdzv-backend", RENDEZVOUS, "--rdzv-endpoint",
               args.rdzv_endpoint, "--rdzv-id", args.rdzv_id] if multi else ["--standalone"])
    return [sys.executable, "-m", "torch.distributed.run", *launch,
            f"--nproc-per-node={nproc}", "--max-restarts", str(args.max_restarts),
            "-m", "autopar.elastic", args.model, "--layout", layout_arg,
            "--checkpoint-dir", args.checkpoint_dir, "--checkpoint-every",
            str(args.checkpoint_every), "--blocks", str(args.blocks), "--epochs",
            str(args.epochs), "--keep", args.keep, "--lr", str(args.lr),
            "--optimizer", args.optimizer, "--collective-timeout", str(args.collective_timeout)]


# -- autopar k8s ------------------------------------------------------------------------------

def cmd_k8s_job(args: argparse.Namespace) -> int:
    import yaml

    from autopar.cluster import ClusterSpecError
    from autopar.compiler.passes.base import PassOptions
    from autopar.k8s import JobSpec, ManifestError, manifest
    from autopar.layout import Layout, LayoutError

    try:
        cluster = cluster_from_args(args.cluster, args.nodes, None, nproc=None)
        pass_options = {}
        if args.plan:
            saved = json.loads(Path(args.plan).read_text())
            layout = Layout.from_dict(saved["layout"])
            pass_options = saved.get("pass_options", {})  # what the plan costed it with
            try:  # a hand-edited one fails here, not in every pod
                PassOptions.of(pass_options)
            except TypeError as exc:
                raise ValueError(f"{args.plan}: pass_options: {exc}") from None
        else:
            world = cluster.nodes * cluster.devices_per_node
            dp = args.dp or max(1, world // (args.tp * args.pp))
            layout = _layout_from_args(argparse.Namespace(**{**vars(args), "dp": dp}))
        layout.check_world_size(cluster.nodes * cluster.devices_per_node)
        out = manifest(JobSpec(
            name=args.name, image=args.image, model=args.model, layout=layout,
            cluster=cluster, min_nodes=args.min_nodes, max_nodes=args.max_nodes,
            max_restarts=args.max_restarts, checkpoint_claim=args.checkpoint_claim,
            checkpoint_every=args.checkpoint_every, blocks=args.blocks, epochs=args.epochs,
            token_secret=args.token_secret, pass_options=pass_options))
    except (LayoutError, ClusterSpecError, ManifestError, OSError, KeyError, ValueError) as exc:
        raise SystemExit(f"autopar k8s job: {exc}") from exc
    text = yaml.safe_dump(out, sort_keys=False)
    if args.out:
        Path(args.out).write_text(text)
        console.print(f"wrote {args.out}: PyTorchJob {args.name}, {cluster.nodes} node(s) "
                      f"({args.min_nodes}..{args.max_nodes or cluster.nodes}), "
                      f"{cluster.devices_per_node} process(es) each, {layout}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_k8s_validate(args: argparse.Namespace) -> int:
    import yaml

    from autopar.k8s import CRD_SOURCE, validate

    problems = validate(yaml.safe_load(Path(args.manifest).read_text()))
    for problem in problems:
        console.print(f"[red]{args.manifest}[/red]: {problem}")
    if not problems:
        console.print(f"{args.manifest}: valid (the CRD of {CRD_SOURCE}, unknown fields, the "
                      f"operator's webhook rules)")
    return 1 if problems else 0


def cmd_k8s_scale(args: argparse.Namespace) -> int:
    from autopar.k8s import ElasticJob, autoscale

    raw = Path(args.jobs).read_text() if os.path.exists(args.jobs) else args.jobs
    try:
        jobs = [ElasticJob(**j) for j in json.loads(raw)]
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"autopar k8s scale: --jobs: {exc}") from exc
    decision = autoscale(jobs, args.free_gpus, args.load, args.load_threshold)
    for j in jobs:
        change = decision[j.name] - j.replicas
        console.print(f"{j.name}: {j.replicas} -> {decision[j.name]} replicas "
                      f"({'+' if change > 0 else ''}{change}; min {j.min_replicas}, max "
                      f"{j.max_replicas})")
    console.print("dry run: nothing applied")
    return 0


def _train_layout(args: argparse.Namespace):
    """The Layout of `autopar train`'s flags; --dp defaults to 2 when nothing else splits.
    With --plan no layout flag may be given (the planner chooses them)."""
    from autopar.layout import Layout, LayoutError

    if getattr(args, "plan", False):
        defaults = vars(build_parser().parse_args(["train", args.model]))
        given = [f"--{name.replace('_', '-')}" for name in _LAYOUT_FLAGS
                 if getattr(args, name) != defaults[name]]
        if given:
            raise LayoutError(f"--plan chooses the layout; drop {', '.join(given)} (or drop "
                              "--plan to train the layout they give)")
        return Layout()

    dp = args.dp if args.dp is not None else (2 if args.tp == args.pp == 1 else 1)
    return _layout_from_args(args, dp=dp, sequence_parallel=args.sequence_parallel,
                             bucket_mb=args.bucket_mb)


_COMM_FIELDS = ("local_sgd", "local_sgd_warmup", "local_sgd_adaptive", "local_sgd_overlap",
                "dgc", "dgc_warmup", "dgc_rampup", "dgc_clip", "dgc_topk")


def _local_sgd_fields(args: argparse.Namespace) -> dict:
    """The Local SGD and DGC fields of the layout flags."""
    return {name: getattr(args, name) for name in _COMM_FIELDS}


_LAYOUT_FLAGS = ("dp", "tp", "pp", "microbatches", "schedule", "virtual_stages",
                 "sequence_parallel", "amp", "zero", "recompute", "bucket_mb", *_COMM_FIELDS)


def _named_by_flags(exc: Exception) -> Exception:
    """The LayoutError of a layout built from flags, each `Layout.<field>` it names that a
    flag sets named by that flag (`Layout.local_sgd` -> `--local-sgd`): what the user typed."""
    from autopar.layout import LayoutError

    def flag(match: re.Match) -> str:
        name = match[1]
        return f"--{name.replace('_', '-')}" if name in _LAYOUT_FLAGS else match[0]

    return LayoutError(re.sub(r"\bLayout\.([a-z_]+)\b", flag, str(exc)))


class _Progress:
    """Progress on a terminal (rich), plain log lines otherwise."""

    def __init__(self, steps: int, fancy: bool):
        self.steps = steps
        self.fancy = fancy
        self.bar = None
        self.task = None
        self.started = time.perf_counter()
        self.tokens = 0

    def handle(self, event: dict) -> None:
        kind = event["event"]
        if kind == "compiled":
            console.print(f"{event['description']}\ncompiled {event['layout']} in "
                          f"{event['seconds']:.1f} s; passes: {'; '.join(event['passes']) or '-'}")
            self.started = time.perf_counter()
            if self.fancy:
                from rich.progress import (
                    BarColumn,
                    Progress,
                    TextColumn,
                    TimeRemainingColumn,
                )
                self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                    TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                    console=console)
                self.bar.start()
                self.task = self.bar.add_task("train", total=self.steps, status="")
        elif kind == "step":
            self._step(event)
        elif kind == "parity":
            self.close()
            verdict = "[green]equal[/green]" if event["ok"] else "[red]DIFFERENT[/red]"
            console.print(f"parity with single-process PyTorch: {verdict} ({event['summary']})")
        elif kind == "saved":
            self._say(f"checkpoint saved to {event['path']}")
        elif kind == "resumed":
            self._resumed(event)
        elif kind == "finished":
            self.close()
            console.print(f"finished at step {event['step']} after {event['restart']} "
                          f"restart(s)")

    def _say(self, text: str) -> None:
        (self.bar.console if self.bar is not None else console).print(text)

    def _resumed(self, event: dict) -> None:
        """An elastic start: the first, or a restart after a failure."""
        self.steps = event["total_steps"]
        if self.bar is not None:
            self.bar.update(self.task, total=self.steps, completed=event["step"])
        if event["restart"] == 0 and not event["checkpoint"]:
            return
        self._say(f"[yellow]restart {event['restart']}[/yellow]: {event['world']} processes, "
                  f"{event['layout']}, global batch {event['global_batch']}; from "
                  f"{event['checkpoint'] or 'the start (no checkpoint yet)'} at step "
                  f"{event['step']}; redoing {event['steps_redone']} step(s); blocks "
                  f"re-queued: {event['requeued_blocks'] or 'none'}")

    def _step(self, event: dict) -> None:
        self.tokens += event["tokens"]
        elapsed = time.perf_counter() - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        left = elapsed / event["step"] * (event["steps"] - event["step"])
        status = f"loss {event['loss']:.4f}  {rate:,.0f} tokens/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=event["step"], status=status)
        else:
            print(f"step {event['step']}/{event['steps']}  {status}  {left:.1f} s left", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


# -- autopar estimate ---------------------------------------------------------------------

def cmd_estimate(args: argparse.Namespace) -> int:
    import torch

    from autopar.api import LAYOUT_ERRORS
    from autopar.compiler.planner.estimate import estimate
    from autopar.examples import load_model_spec

    try:
        layout = _layout_from_args(args, bucket_mb=args.bucket_mb)
        cluster = cluster_from_args(args.cluster, args.nodes, layout)
        with torch.device("meta"):  # nothing is allocated: weights and batch are shapes only
            example = load_model_spec(args.model)
        pred = estimate(example.model, cluster, layout, example.batch, example.loss_fn,
                                optimizer=args.optimizer)
    except LAYOUT_ERRORS as exc:
        raise SystemExit(f"autopar estimate: {exc}") from exc
    if args.json:
        print(json.dumps({"model": args.model, "cluster": cluster.describe(),
                          "layout": layout.to_dict(), **pred.to_dict()}, indent=1))
    else:
        _print_estimate(args.model, cluster, layout, pred)
    return 0


def _print_estimate(model: str, cluster, layout, pred) -> None:
    console.print(f"[bold]{model}[/bold] on {cluster.describe()}, {layout}")
    console.print(f"{_fmt_count(pred.flops_per_step)}FLOP per step, "
                  f"{pred.tflops_per_device:.1f} TFLOP/s per device, MFU {pred.mfu:.1%}")
    if pred.tracing:
        console.print(f"traced {pred.tracing}")
    times = Table(title=f"step time {pred.step_time_s * 1e3:.2f} ms")
    for col in ("part", "ms", "of step"):
        times.add_column(col, justify="left" if col == "part" else "right")
    labels = {"compute": "compute", "comm": "communication (total)",
              "exposed_comm": "communication not overlapped", "bubble": "pipeline bubble",
              "optimizer": "optimizer step"}
    for key, label in labels.items():
        seconds = pred.breakdown.get(key, 0.0)
        times.add_row(label, f"{seconds * 1e3:.3f}", f"{seconds / pred.step_time_s:.1%}")
    console.print(times)
    if pred.comm_bytes:
        console.print(f"bytes {bytes_whose(layout)} carry per step: " + ", ".join(
            f"{group} {_fmt_bytes(n)}" for group, n in pred.comm_bytes.items())
            + (f" (summed whole every step: dp {_fmt_bytes(pred.uncompressed_bytes)})"
               if pred.uncompressed_bytes else ""))
    memory = Table(title=f"memory per rank {_fmt_bytes(pred.peak_memory_bytes)} of "
                         f"{_fmt_bytes(cluster.device.memory_bytes)}")
    for col in ("category", "size", "of device"):
        memory.add_column(col, justify="left" if col == "category" else "right")
    for key, size in pred.memory.items():
        memory.add_row(key.replace("_", " "), _fmt_bytes(size),
                       f"{size / cluster.device.memory_bytes:.1%}")
    console.print(memory)


# -- autopar check ------------------------------------------------------------------------

def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from autopar.api import LAYOUT_ERRORS, check
    from autopar.compiler.ir.collectives import CollectiveMismatch
    from autopar.examples import load_model_spec

    try:
        layout = _layout_from_args(args, sequence_parallel=args.sequence_parallel)
        with torch.device("meta"):  # the programs are built on shapes; nothing runs
            example = load_model_spec(args.model)
        compared = check(example.model, example.batch, example.loss_fn, layout)
    except LAYOUT_ERRORS as exc:
        raise SystemExit(f"autopar check: {exc}") from exc
    except CollectiveMismatch as exc:
        console.print(f"[red]autopar check: {exc}[/red]")
        return 1
    console.print(f"{args.model}, {layout}: the {layout.world_size} ranks' programs agree "
                  f"({compared} collectives compared within their groups)")
    return 0


# -- autopar bisect -----------------------------------------------------------------------

def cmd_bisect(args: argparse.Namespace) -> int:
    from autopar.bisect_worker import REFUSED_PREFIX
    from autopar.examples import check_model_spec
    from autopar.layout import LayoutError

    check_model_spec(args.model)  # here, not once per rank after the launch

    try:
        layout = _layout_from_args(args, sequence_parallel=args.sequence_parallel)
    except LayoutError as exc:
        raise SystemExit(f"autopar bisect: {exc}") from exc
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={layout.world_size}", "-m", "autopar.bisect_worker", args.model,
           "--layout", json.dumps(layout.non_default_fields()), "--rounding", str(args.rounding)]
    if args.json:
        cmd.append("--json")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    refused: list[str] = []  # rank 0's refusal of the layout, if it refused it
    _pass_on(proc.stderr, threading.Event(), REFUSED_PREFIX, refused)
    code = proc.wait()
    if refused:
        raise SystemExit(refused[0].rstrip("\n"))
    if code not in (0, 3):
        console.print(f"[red]autopar bisect failed[/red] (torchrun exit code {code})")
    return code


# -- autopar kernels ----------------------------------------------------------------------

def cmd_kernels(args: argparse.Namespace) -> int:
    from autopar.api import trace
    from autopar.compiler.codegen.listing import write_kernels
    from autopar.compiler.passes.defaults import run_passes
    from autopar.examples import load_model_spec
    from autopar.layout import Layout

    example = load_model_spec(args.model)
    tg = trace(example.model, example.batch, example.loss_fn)
    tg, results = run_passes(tg, Layout(fusion=True))
    rows = write_kernels(tg, args.out)
    table = Table(title=f"{len(rows)} fused kernels of {args.model} ({results[-1].summary()})")
    for col in ("kernel", "kind", "role", "module", "ops"):
        table.add_column(col)
    for row in rows:
        names = [op.removeprefix("aten.").split(".")[0] for op in row["ops"]]
        ops = f"{len(names)}: " + " ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        table.add_row(row["kernel"], row["kind"], row["role"], row["module"] or "-", ops)
    console.print(table)
    console.print(f"sources and kernels.json written to {args.out}")
    return 0


# -- entry point --------------------------------------------------------------------------

def _layout_from_args(args: argparse.Namespace, **more):
    """The Layout of `_add_layout_args`' flags and --dp, with `more` fields (over them); a
    bad value's LayoutError names the flags (_named_by_flags)."""
    from autopar.layout import Layout, LayoutError

    fields = dict(dp=args.dp, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                  schedule=args.schedule, virtual_stages=args.virtual_stages, amp=args.amp,
                  zero=args.zero, recompute=args.recompute, **_local_sgd_fields(args))
    try:
        return Layout(**{**fields, **more})
    except LayoutError as exc:
        raise _named_by_flags(exc) from exc


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    """The Layout flags `train` and `estimate` share (each adds its own --dp)."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--schedule", default="1f1b",
                        choices=("1f1b", "gpipe", "interleaved", "zero-bubble"))
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="stages per pipeline rank (with --schedule interleaved)")
    parser.add_argument("--amp", default="off", choices=("off", "bf16", "fp16"))
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                        help="ZeRO stage over the data-parallel ranks")
    parser.add_argument("--recompute", default="none", choices=RECOMPUTE,
                        help="recomputation policy, see docs/memory.md ('auto' fits the "
                             "cluster's device memory)")
    parser.add_argument("--local-sgd", type=int, default=None, metavar="H",
                        help="Local SGD: each rank steps on its own gradients, the parameters "
                             "are averaged every H steps (docs/communication.md)")
    parser.add_argument("--local-sgd-warmup", type=int, default=0, metavar="W",
                        help="with --local-sgd: W synchronous steps first (post-local SGD)")
    parser.add_argument("--local-sgd-adaptive", action="store_true",
                        help="with --local-sgd: adapt H to the loss and learning rate (AdaComm)")
    parser.add_argument("--local-sgd-overlap", type=int, default=0, metavar="K",
                        help="with --local-sgd: each average runs under the next K local "
                             "steps and is applied after them (0: at once)")
    parser.add_argument("--dgc", type=float, default=None, metavar="S",
                        help="Deep Gradient Compression with final sparsity S, e.g. 0.999 "
                             "(SGD with momentum; docs/communication.md)")
    parser.add_argument("--dgc-warmup", type=int, default=0, metavar="W",
                        help="with --dgc: W dense steps before the sparsity ramps up")
    parser.add_argument("--dgc-rampup", type=int, default=0, metavar="R",
                        help="with --dgc: R steps of ramp-up through 75%%, 93.75%%, ...")
    parser.add_argument("--dgc-clip", type=float, default=None, metavar="NORM",
                        help="with --dgc: clip each rank's gradient to NORM/sqrt(dp)")
    parser.add_argument("--dgc-topk", default="exact", choices=("exact", "sampled"),
                        help="with --dgc: how the top-k values are found")


def _add_program_args(parser: argparse.ArgumentParser, model_help: str) -> None:
    """MODEL and the whole layout of one program per rank (`check`, `bisect`)."""
    parser.add_argument("model", help=model_help)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    _add_layout_args(parser)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split the sequence between tensor-parallel regions")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    trace = sub.add_parser("trace", help="trace MODEL and summarise its training graph")
    trace.add_argument("model", nargs="?", help="built-in example or pkg.module:factory")
    trace.add_argument("--list", action="store_true", help="list the built-in examples")
    trace.add_argument("--json", action="store_true", help="print the summary as JSON")
    trace.add_argument("--ir", metavar="FILE", help="also write the graph's IR text to FILE")
    trace.set_defaults(func=cmd_trace)

    train = sub.add_parser("train", help="train MODEL under torchrun with a layout")
    train.add_argument("model", help="built-in example or pkg.module:factory")
    train.add_argument("--dp", type=int, default=None,
                       help="data-parallel degree (default 2, or 1 with --tp/--pp)")
    _add_layout_args(train)
    train.add_argument("--sequence-parallel", action="store_true",
                       help="with --tp: split norm/dropout regions along the sequence")
    train.add_argument("--nproc", type=int, default=None,
                       help="processes (default dp*tp*pp; 2 with --plan)")
    train.add_argument("--plan", action="store_true",
                       help="let autopar.plan choose the layout for --nproc processes "
                            "(compile(layout=None))")
    train.add_argument("--bucket-mb", type=float, default=25.0, help="all-reduce bucket size")
    train.add_argument("--steps", type=int, default=10)
    train.add_argument("--lr", type=float, default=None,
                       help="learning rate (default 1e-3; 0.05 with --ps-servers)")
    train.add_argument("--optimizer", choices=("adamw", "sgd", "adagrad", "adam"), default=None,
                       help="default adamw; adagrad with --ps-servers (the servers apply "
                            "sgd, adagrad and adam lazily to the rows a batch touched)")
    train.add_argument("--parity", action="store_true",
                       help="also train single-process PyTorch and compare loss and weights")
    train.add_argument("--save", metavar="DIR", help="save a checkpoint at the end")
    elastic = train.add_argument_group(
        "elastic", "--elastic: survive failures and changes of world size (torchrun restarts "
        "the workers; each start re-plans dp for the world it finds and loads the newest "
        "checkpoint); the data set is --blocks blocks of one global batch, --epochs times "
        "(--steps is not used)")
    elastic.add_argument("--elastic", action="store_true")
    elastic.add_argument("--checkpoint-dir", metavar="DIR")
    elastic.add_argument("--checkpoint-every", type=int, default=10, metavar="N")
    elastic.add_argument("--blocks", type=int, default=64, help="data set size in blocks")
    elastic.add_argument("--epochs", type=int, default=1)
    elastic.add_argument("--keep", choices=("global-batch", "per-rank-batch"),
                         default="global-batch",
                         help="what stays when dp changes (default: the global batch)")
    elastic.add_argument("--nnodes", default="1", help="torchrun's MIN:MAX nodes")
    elastic.add_argument("--max-restarts", type=int, default=3)
    elastic.add_argument("--collective-timeout", type=float, default=900.0, metavar="S",
                         help="seconds a collective waits for a rank that stopped answering "
                              "before the workers fail and restart (default 900)")
    elastic.add_argument("--rdzv-endpoint", default=None,
                         help="host:port of the c10d rendezvous (several nodes)")
    elastic.add_argument("--rdzv-id", default="autopar")
    ps = train.add_argument_group(
        "parameter servers", "--ps-servers S: S processes hold the model's embedding tables, "
        "sharded by row id, and --nproc trainer processes (default 2) pull the rows of "
        "their batch and push the rows' gradients (docs/parameter_server.md)")
    ps.add_argument("--ps-servers", type=int, default=None, metavar="S")
    ps.add_argument("--mode", choices=("sync", "async", "half-async", "geo"), default="sync")
    ps.add_argument("--fraction", type=float, default=None,
                    help="half-async: the fraction of trainers a server waits for")
    ps.add_argument("--geo-k", type=int, default=None, help="geo: push every K steps")
    ps.add_argument("--dense", choices=("allreduce", "servers"), default=None,
                    help="where dense parameters live (default: allreduce in sync mode, "
                         "servers otherwise)")
    ps.add_argument("--slow-trainer", type=int, default=None, metavar="J",
                    help="slow trainer J down 2x on purpose (to see async keep going)")
    train.set_defaults(func=cmd_train)

    k8s = sub.add_parser("k8s", help="Kubernetes: a Kubeflow PyTorchJob for an elastic job, "
                                     "its validation, the auto-scaler's decision")
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True)
    job = k8s_sub.add_parser("job", help="write the PyTorchJob (kubeflow.org/v1) that trains "
                                         "MODEL elastically")
    job.add_argument("model", help="built-in example or pkg.module:factory (in the image)")
    job.add_argument("--image", required=True, help="the container image (autopar installed)")
    job.add_argument("--name", required=True, help="the job's name (a DNS-1035 label)")
    job.add_argument("--cluster", required=True,
                     help="a preset (dgx-a100-80gb, ...) or a ClusterSpec YAML: the nodes, "
                          "and the GPUs each pod asks for")
    job.add_argument("--nodes", type=int, default=None, help="nodes to start with")
    job.add_argument("--min-nodes", type=int, default=1)
    job.add_argument("--max-nodes", type=int, default=None, help="default: --nodes")
    job.add_argument("--plan", metavar="PLAN.json",
                     help="take the layout, and the pass options it was costed with, from "
                          "a plan (autopar plan --report PLAN.json)")
    job.add_argument("--dp", type=int, default=None, help="default: the world's nodes x GPUs")
    _add_layout_args(job)
    job.add_argument("--max-restarts", type=int, default=3)
    job.add_argument("--checkpoint-claim", default="autopar-checkpoints",
                     help="the PersistentVolumeClaim every pod mounts for checkpoints")
    job.add_argument("--checkpoint-every", type=int, default=100)
    job.add_argument("--blocks", type=int, default=1024)
    job.add_argument("--epochs", type=int, default=1)
    job.add_argument("--token-secret", default="autopar-job-token",
                     help="the Secret whose key 'token' is the job's token")
    job.add_argument("-o", "--out", help="write the YAML here (default: stdout)")
    job.set_defaults(func=cmd_k8s_job)
    val = k8s_sub.add_parser("validate", help="check a PyTorchJob manifest offline (the CRD's "
                                              "schema, unknown fields, the webhook's rules)")
    val.add_argument("manifest")
    val.set_defaults(func=cmd_k8s_validate)
    scale = k8s_sub.add_parser("scale", help="the auto-scaler's new replica counts")
    scale.add_argument("--jobs", required=True,
                       help='JSON list of {"name", "min_replicas", "max_replicas", "replicas", '
                            '"gpus_per_replica"}, or a file holding it')
    scale.add_argument("--free-gpus", type=int, required=True)
    scale.add_argument("--load", type=float, required=True, help="the cluster's GPU load, 0..1")
    scale.add_argument("--load-threshold", type=float, default=0.9)
    scale.add_argument("--dry-run", action="store_true",
                       help="print the decision (the only mode: nothing is applied)")
    scale.set_defaults(func=cmd_k8s_scale)

    chk = sub.add_parser("check", help="build every rank's program of MODEL for a layout and "
                                       "check that each group's ranks run the same collectives")
    _add_program_args(chk, "built-in example or pkg.module:factory (built on meta)")
    chk.set_defaults(func=cmd_check)

    bis = sub.add_parser("bisect", help="run MODEL's step for a layout and the single-process "
                                        "step node by node; name the first node that differs")
    _add_program_args(bis, "built-in example or pkg.module:factory (dropout 0)")
    bis.add_argument("--rounding", type=float, default=16.0,
                     help="how many times the fp32 reference's own rounding error a value "
                          "may be off (default 16)")
    bis.add_argument("--json", action="store_true", help="print the report as JSON")
    bis.set_defaults(func=cmd_bisect)

    est = sub.add_parser("estimate", help="predicted step time and memory of MODEL for a layout")
    est.add_argument("model", help="built-in example or pkg.module:factory (built on meta)")
    est.add_argument("--cluster", default="local",
                     help="a preset (dgx-h100, dgx-a100-80gb, dgx-h200), local, or a YAML file")
    est.add_argument("--nodes", type=int, default=None,
                     help="nodes of a preset or YAML cluster (default: 1 / the file's)")
    est.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    _add_layout_args(est)
    est.add_argument("--bucket-mb", type=float, default=25.0, help="all-reduce bucket size")
    est.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES),
                     default="adamw")
    est.add_argument("--json", action="store_true", help="print the prediction as JSON")
    est.set_defaults(func=cmd_estimate)

    add_planner_commands(sub)
    kern = sub.add_parser("kernels", help="write the fused Triton kernels of MODEL's step")
    kern.add_argument("model", help="built-in example or pkg.module:factory")
    kern.add_argument("--out", required=True, metavar="DIR", help="directory for the sources")
    kern.set_defaults(func=cmd_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_from_env()
    args = build_parser().parse_args(argv)  # `--help` and a bad flag end here, before torch
    from autopar.examples import ModelSpecError

    try:
        return args.func(args)
    except ModelSpecError as exc:  # the model argument names no model
        raise SystemExit(f"autopar {args.command}: {exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
