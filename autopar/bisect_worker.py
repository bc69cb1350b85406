"""The per-rank program behind `autopar bisect` (started by torchrun): bisection.bisect
of the model and layout named, rank 0's report on stdout (its exit status 0 when every
value agrees, 3 when one departs). A module of its own: `python -m` of a module that
`import autopar` already imported (autopar.bisection) warns on every rank."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

from autopar.api import LAYOUT_ERRORS
from autopar.bisection import ROUNDING, BisectReport, bisect
from autopar.layout import Layout

# what each rank writes to stderr before the layout's refusal (api.LAYOUT_ERRORS): the
# CLI ends with the first such line (every rank writes one: the first rank to exit
# makes torchrun stop the others, perhaps before they write theirs)
REFUSED_PREFIX = "autopar bisect: "


def main(argv: list[str] | None = None) -> None:
    from autopar.examples import load_model_spec

    parser = argparse.ArgumentParser(prog="autopar-bisect-worker")
    parser.add_argument("model")
    parser.add_argument("--layout", required=True, help="Layout fields as JSON")
    parser.add_argument("--rounding", type=float, default=ROUNDING)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    example = load_model_spec(args.model)
    layout = Layout.from_dict(json.loads(args.layout))
    try:
        report = bisect(example.model, example.batch, example.loss_fn, layout,
                        rounding=args.rounding)
    except LAYOUT_ERRORS as exc:  # every rank refuses the layout alike, before any collective
        print(f"{REFUSED_PREFIX}{exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    if dist.get_rank() == 0:
        print(json.dumps(_as_dict(report)) if args.json else str(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if report.ok else 3)


def _as_dict(report: BisectReport) -> dict:
    first = report.first
    return {"layout": report.layout.non_default_fields(), "compared": report.compared,
            "nodes": report.nodes, "ok": report.ok,
            "first": None if first is None else {k: getattr(first, k) for k in
                                                 first.__dataclass_fields__}}


if __name__ == "__main__":
    main(sys.argv[1:])
