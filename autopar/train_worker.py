"""The per-rank program behind `autopar train` (started by torchrun).

Rank 0 reports progress as JSON lines prefixed with EVENT_PREFIX on stdout; the
CLI turns them into a progress bar or plain log lines.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from autopar.logs import EVENT_PREFIX, emit  # noqa: F401  (EVENT_PREFIX: the CLI reads it here)


def make_optimizer(name: str, lr: float):
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise SystemExit(f"--optimizer must be adamw or sgd, got {name!r}")


# a rank's exit status when the layout was refused (every rank refuses it alike)
REFUSED = 2


def refuse(exc: Exception) -> None:
    """End this rank for a layout compile refused (api.LAYOUT_ERRORS): it reports the
    message as an event, which the CLI prints as its error, and exits with REFUSED and
    no traceback. compile is the same function of the model and the layout on every
    rank, so every rank refuses, before any collective of the step, with one message;
    every rank reports it, since the first to exit makes torchrun stop the others,
    perhaps before they report."""
    emit("refused", message=str(exc))
    raise SystemExit(REFUSED) from exc


def main(argv: list[str] | None = None) -> None:
    from autopar.api import LAYOUT_ERRORS
    from autopar.api import compile as compile_step
    from autopar.examples import load_model_spec
    from autopar.layout import Layout
    from autopar.runtime.mesh import launched_rank

    parser = argparse.ArgumentParser(prog="autopar-train-worker")
    parser.add_argument("model")
    parser.add_argument("--layout", required=True,
                        help='Layout fields as JSON, or "plan" (compile plans the layout)')
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--parity", action="store_true")
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    example = load_model_spec(args.model)
    layout = None if args.layout == "plan" else Layout.from_dict(json.loads(args.layout))
    optimizer = make_optimizer(args.optimizer, args.lr)
    initial = copy.deepcopy(example.model) if args.parity else None
    start = time.perf_counter()
    try:
        step = compile_step(example.model, None, example.batch, example.loss_fn,
                            optimizer=optimizer, layout=layout)
    except LAYOUT_ERRORS as exc:
        refuse(exc)
    rank0 = launched_rank() == 0
    if step.plan is not None and layout is None:
        layout = step.plan.layout
    if rank0:
        emit("compiled", seconds=time.perf_counter() - start,
             layout=str(layout) + (" (planned)" if step.plan is not None else ""),
             passes=[r.summary() for r in step.pass_results], description=example.description)
    batches = example.batches(args.steps)
    losses = []
    for k, batch in enumerate(batches):
        t0 = time.perf_counter()
        loss = step(*batch).item()
        losses.append(loss)
        if rank0:
            emit("step", step=k + 1, steps=args.steps, loss=loss,
                 seconds=time.perf_counter() - t0, tokens=batch[0].numel())
    if args.save:
        step.save(args.save)
        if rank0:
            emit("saved", path=args.save)
    if args.parity and rank0:
        from autopar.testing import compare, reference_train

        init_state = {k: v.clone() for k, v in initial.state_dict().items()}
        ref_losses, ref_state = reference_train(initial, batches, example.loss_fn, optimizer)
        report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init_state,
                         adam=args.optimizer == "adamw")
        emit("parity", ok=report.ok, loss_rel_err=report.loss_rel_err, summary=str(report),
             reference_losses=ref_losses, losses=losses)
    elif args.parity:
        step.full_state_dict()  # collective in sharded layouts: every rank takes part


if __name__ == "__main__":
    main(sys.argv[1:])
