"""The planner's commands: `autopar plan`, `autopar calibrate`, `autopar validate`
(see docs/planner.md). Registered on the main parser by `autopar.cli`."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from rich.table import Table

from autopar.cli.common import bytes_whose, cluster_from_args, console
from autopar.costs import OPTIMIZER_STATES


_PLAN_CONSTRAINTS = ("dp", "tp", "pp", "microbatches", "schedule", "zero", "amp",
                     "allreduce", "local_sgd", "dgc")


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from autopar.compiler.planner.plan import plan as plan_layout
    from autopar.compiler.ir.batch import BatchError
    from autopar.compiler.ir.trace import TraceError
    from autopar.compiler.planner.search import PlanArgumentError, PlanError
    from autopar.cluster import ClusterSpecError
    from autopar.compiler.planner.report import save_trace
    from autopar.examples import load_model_spec
    from autopar.layout import LayoutError

    # the tensor-parallel rules probe strategies on fake tensors, and torch logs each
    # refused probe as an error: noise next to a progress bar
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    constraints = {k: getattr(args, k) for k in _PLAN_CONSTRAINTS if getattr(args, k) is not None}
    constraints["max_memory_fraction"] = args.max_memory_fraction
    try:
        cluster = cluster_from_args(args.cluster, args.nodes, None, args.nproc)
        with torch.device("meta"):  # nothing is allocated: weights and batch are shapes only
            example = load_model_spec(args.model)
        with _PlanProgress(fancy=sys.stdout.isatty() and not args.json) as show:
            plan = plan_layout(example.model, cluster, example.batch, example.loss_fn,
                                optimizer=args.optimizer, progress=show,
                                trace_blocks=args.trace_blocks, workers=args.workers,
                                allow=args.allow, **constraints)
    except (LayoutError, ClusterSpecError, PlanError, PlanArgumentError, BatchError,
            TraceError) as exc:  # what the user controls; anything else is a bug: a traceback
        raise SystemExit(f"autopar plan: {exc}") from exc
    for path in args.report or ():
        plan.save_report(path)
        console.print(f"report written to {path}")
    if args.trace:
        save_trace(plan, args.trace)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        _print_plan(args.model, cluster, plan)
    return 0


def _print_plan(model: str, cluster, plan) -> None:
    from autopar.compiler.planner.report import headline

    console.print(f"[bold]{model}[/bold]")
    for line in headline(plan):
        console.print(line)
    if plan.predicted.comm_bytes:
        console.print(f"Bytes {bytes_whose(plan.layout)} carry per step: " + ", ".join(
            f"{group} {nbytes / 1e6:.4g} MB" for group, nbytes in plan.predicted.comm_bytes.items())
            + (f" (summed whole every step: dp {plan.predicted.uncompressed_bytes / 1e6:.4g} MB)"
               if plan.predicted.uncompressed_bytes else "") + ".")
    table = Table(title="best alternatives")
    for col in ("layout", "step ms", "why not"):
        table.add_column(col)
    for lay, pred, why in plan.alternatives[:8]:
        table.add_row(str(lay), f"{pred.step_time_s * 1e3:.4g}", why)
    console.print(table)


class _PlanProgress:
    """A progress bar over the candidate layouts on a terminal; silent otherwise."""

    def __init__(self, fancy: bool):
        self.fancy, self.bar, self.task = fancy, None, None

    def __enter__(self):
        if self.fancy:
            from rich.progress import BarColumn, Progress, TextColumn
            self.bar = Progress(TextColumn("costing {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[layout]}"), console=console,
                                transient=True)
            self.bar.start()
        return self

    def __call__(self, done: int, total: int, layout) -> None:
        if self.bar is None:
            return
        if self.task is None:
            self.task = self.bar.add_task("plan", total=total, layout="")
        self.bar.update(self.task, completed=done, layout=str(layout))

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


# -- autopar calibrate / validate -----------------------------------------------------------

def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.calibrate import calibrate, default_device

    device = args.device if args.device != "auto" else default_device()
    if device == "cuda" and args.model:
        raise SystemExit("autopar calibrate: --model fits per-op factors by running the model "
                         "op by op on this CPU; with --device cuda that is not built yet: "
                         "calibrate the GPUs without --model")
    if args.cluster is not None and device != "cuda":
        raise SystemExit("autopar calibrate: --cluster takes a GPU's measurements (--device "
                         "cuda); a CPU calibration describes this machine")
    if args.cluster == "local":
        raise SystemExit("autopar calibrate: --cluster local is this machine's CPU; name the "
                         "GPU cluster this GPU belongs to (a preset such as dgx-h100, or a "
                         "YAML spec)")
    if device == "cuda" and args.nproc == 1 and args.cluster is None:
        raise SystemExit("autopar calibrate: one GPU (--nproc 1) measures no link between "
                         "GPUs: name the cluster it belongs to, e.g. --cluster dgx-h100 "
                         "--nodes 4 (a preset or a YAML spec), whose links the spec keeps")
    base = cluster_from_args(args.cluster, args.nodes, None) if args.cluster else None
    try:
        measured = calibrate(args.nproc, device)
    except RuntimeError as exc:  # too few GPUs, a machine too busy to measure
        raise SystemExit(f"autopar calibrate: {exc}") from exc
    spec = measured.cluster(args.nproc, base=base)
    if args.model:
        spec = _fit_to_model(spec, args.model, args.nproc)
    spec.to_yaml(args.output)
    if measured.gpu is not None:
        peaks = ", ".join(f"{dtype} {flops / 1e12:.1f}" for dtype, flops in measured.gpu_flops)
        link = ("no link measured (one GPU): the links are "
                f"{base.name}'s" if measured.link_bandwidth is None else
                f"NCCL all-reduce {measured.link_bandwidth / 1e9:.1f} GB/s, "
                f"{measured.link_latency_s * 1e6:.1f} us per step (fit over "
                f"{len(measured.all_reduce)} sizes)")
        console.print(f"{measured.gpu}: matmul TFLOP/s {peaks}, memory "
                      f"{measured.memory_bandwidth / 1e9:.0f} GB/s, "
                      f"{measured.launch_overhead_s * 1e6:.1f} us per kernel, causal attention "
                      f"{measured.attention_flops / 1e12:.1f} TFLOP/s in "
                      f"{measured.attention_dtype} (efficiency "
                      f"{spec.device.attention_efficiency:.2f}); {link}")
    else:
        console.print(f"matmul {measured.matmul_flops / 1e9:.1f} GFLOP/s, memory "
                         f"{measured.memory_bandwidth / 1e9:.1f} GB/s (fresh pages "
                         f"{measured.first_touch_bandwidth / 1e9:.1f} GB/s), "
                         f"{measured.launch_overhead_s * 1e6:.1f} us per op per process; gloo "
                         f"all-reduce {measured.link_bandwidth / 1e9:.2f} GB/s, "
                         f"{measured.link_latency_s * 1e6:.0f} us per step (fit over "
                         f"{len(measured.all_reduce)} sizes)")
    console.print(f"cluster spec written to {args.output} (peaks = measured / efficiency)")
    return 0


def _fit_to_model(spec, model: str, nproc: int):
    """`spec` with op_time_factors fitted to one step of `model` on one process's share
    of its batch (as data parallelism over `nproc` processes would run it)."""
    from autopar.calibrate import fit_model
    from autopar.cluster import ClusterSpec
    from autopar.compiler.ir.trace import local_example
    from autopar.examples import load_model_spec
    from autopar.layout import Layout

    example = load_model_spec(model)
    batch = local_example(example.batch, Layout(dp=nproc))
    factors = fit_model(example.model, batch, example.loss_fn, spec)
    shown = ", ".join(f"{k} x{v:.2f}" for k, v in sorted(factors.items(), key=lambda kv: -abs(
        kv[1] - 1))[:6])
    console.print(f"fitted to {model} ({len(factors)} factors; furthest from the roofline: "
                     f"{shown})")
    data = spec.to_dict()
    return ClusterSpec.from_dict({**data, "device": {**data["device"], "op_time_factors": factors}},
                                 source="autopar calibrate --model")


def _layout_json(text: str) -> dict:
    """A --layout's fields: a JSON object, or a LayoutError that quotes it."""
    from autopar.layout import LayoutError

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LayoutError(f"--layout {text!r} is not JSON ({exc}); write its fields as a JSON "
                          f"object, e.g. '{{\"dp\": 2}}'") from None
    if not isinstance(fields, dict):
        raise LayoutError(f"--layout {text!r} is not a JSON object of Layout fields, e.g. "
                          f"'{{\"dp\": 2}}'")
    return fields


def cmd_validate(args: argparse.Namespace) -> int:
    from autopar.cluster import ClusterSpec
    from autopar.layout import Layout
    from autopar.api import LAYOUT_ERRORS
    from autopar.validate import DEFAULT_LAYOUTS, median_abs_error, validate

    def show(row) -> None:
        if not args.json:
            console.print(f"{row.layout}: predicted {row.predicted_s * 1e3:.1f} ms, measured "
                          f"{row.measured_s * 1e3:.1f} ms, error {row.error:+.1%}")

    try:
        cluster = ClusterSpec.from_yaml(args.cluster) if args.cluster else ClusterSpec.local()
        layouts = [Layout.from_dict(_layout_json(text)) for text in args.layout] \
            or DEFAULT_LAYOUTS
        rows = validate(args.model, cluster, layouts, args.steps, args.warmup, progress=show)
    except LAYOUT_ERRORS as exc:  # each layout is estimated before it is measured
        raise SystemExit(f"autopar validate: {exc}") from exc
    if args.json:
        print(json.dumps([{"layout": r.layout.to_dict(), "predicted_s": r.predicted_s,
                           "measured_s": r.measured_s, "error": r.error} for r in rows], indent=1))
    else:
        console.print(f"median |error| over {len(rows)} layouts: {median_abs_error(rows):.1%}")
    return 0


def add_planner_commands(sub) -> None:
    """Add plan, calibrate and validate to the CLI's subparsers."""
    plan = sub.add_parser("plan", help="choose the fastest layout of MODEL that fits memory")
    plan.add_argument("model", help="built-in example or pkg.module:factory (built on meta)")
    plan.add_argument("--cluster", default="local",
                      help="a preset (dgx-h100, dgx-a100-80gb, dgx-h200), local, or a YAML file")
    plan.add_argument("--nodes", type=int, default=None, help="nodes of a preset or YAML cluster")
    plan.add_argument("--nproc", type=int, default=None,
                      help="processes of --cluster local (default: one per core)")
    for name in ("dp", "tp", "pp", "microbatches", "zero"):
        plan.add_argument(f"--{name}", type=int, default=None, help=f"fix Layout.{name}")
    plan.add_argument("--schedule", default=None,
                      choices=("1f1b", "gpipe", "interleaved", "zero-bubble"))
    plan.add_argument("--amp", default=None, choices=("off", "bf16", "fp16"))
    plan.add_argument("--allreduce", default=None, choices=("flat", "hierarchical"),
                      help="fix how gradients are summed (default: the planner chooses)")
    plan.add_argument("--local-sgd", type=int, default=None, metavar="H",
                      help="fix Local SGD with averaging period H")
    plan.add_argument("--dgc", type=float, default=None, metavar="S",
                      help="fix DGC with final sparsity S (with --optimizer sgd-momentum)")
    plan.add_argument("--allow", action="append", default=[], choices=("local_sgd", "dgc"),
                      help="let the plan use a technique that changes convergence (its "
                           "accuracy is not modelled; repeatable)")
    plan.add_argument("--max-memory-fraction", type=float, default=0.9,
                      help="share of device memory a layout may use (default 0.9)")
    plan.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES),
                      default="adamw")
    plan.add_argument("--trace-blocks", type=trace_blocks_arg, default="auto",
                      metavar="auto|exact|K",
                      help="auto (default): trace two of the model's repeated blocks and "
                           "scale their costs when it has more; exact: trace the whole model "
                           "(minutes for billions of parameters); K: K blocks")
    plan.add_argument("--workers", type=int, default=None, metavar="N",
                      help="with per-block tracing: N processes rewrite graphs while the "
                           "search costs (default: one per CPU, up to 2; 0: none)")
    plan.add_argument("--report", action="append", metavar="PATH",
                      help="write the report: .html, .md or .json (repeatable)")
    plan.add_argument("--trace", metavar="PATH",
                      help="write the predicted timeline as a Chrome/Perfetto trace (JSON)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)

    cal = sub.add_parser("calibrate", help="measure this machine, write a ClusterSpec YAML")
    cal.add_argument("--nproc", type=int, default=2,
                     help="processes (CPU) or GPUs (CUDA) for the all-reduce")
    cal.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                     help="measure the CPU (gloo) or the GPUs (NCCL); auto: the GPUs where "
                          "CUDA is available")
    cal.add_argument("--output", default="cluster.yaml", help="where to write the spec")
    cal.add_argument("--cluster", default=None,
                     help="GPUs: the cluster this GPU belongs to (a preset such as dgx-h100 or "
                          "a YAML spec); the spec written is it with the measured device (and "
                          "node link, with --nproc 2 or more). Needed with --nproc 1")
    cal.add_argument("--nodes", type=int, default=None, help="nodes of --cluster")
    cal.add_argument("--model", default=None,
                     help="also fit per-op time factors to one step of this model (a built-in "
                          "example or pkg.module:factory), run on one process")
    cal.set_defaults(func=cmd_calibrate)

    val = sub.add_parser("validate", help="predicted vs measured step time of several layouts")
    val.add_argument("model", help="built-in example or pkg.module:factory")
    val.add_argument("--cluster", default=None, help="a YAML spec (default: ClusterSpec.local)")
    val.add_argument("--layout", action="append", default=[], metavar="JSON",
                     help='a layout to run, e.g. \'{"dp": 2}\' (repeatable; default: 9 layouts)')
    val.add_argument("--steps", type=int, default=5, help="timed steps per layout")
    val.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    val.add_argument("--json", action="store_true")
    val.set_defaults(func=cmd_validate)


def trace_blocks_arg(text: str) -> int | str:
    """--trace-blocks: 'auto', 'exact' or a positive count of blocks."""
    if text in ("auto", "exact"):
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected auto, exact or a positive count of "
                                         f"blocks, got {text!r}")
    return count
