"""The planning report of a Plan: one offline HTML page (inline SVG charts, no
scripts or files from elsewhere), Markdown, or JSON (reads back with
`Plan.from_dict`); and the predicted timeline as a Chrome trace (Perfetto's JSON
format: open it at ui.perfetto.dev or chrome://tracing).

Both text forms render the same tables (`tables`): the layout and why, the step
time by part, memory by category against the device, the tensor-parallel placement
of each parameter, the Pareto front of step time against memory (the HTML plots every
costed layout above it), the alternatives with why not, the refused layouts grouped
by reason with the range of each figure, per-layer costs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from autopar.cluster import ClusterSpec
from autopar.compiler.passes.tp_rules import show
from autopar.compiler.planner import report_svg as svg

if TYPE_CHECKING:  # result.Plan.save_report calls this module: no import at run time
    from autopar.compiler.planner.result import Plan, Prediction
    from autopar.layout import Layout

MAX_ALTERNATIVES = 40
STEP_PARTS = ("compute", "exposed_comm", "bubble", "optimizer")


def save_report(plan: Plan, path) -> None:
    path = Path(path)
    writers = {".html": to_html, ".md": to_markdown,
               ".json": lambda p: json.dumps(p.to_dict(), indent=1)}
    if path.suffix not in writers:
        raise ValueError(f"report path {str(path)!r}: the suffix picks the form, one of "
                         f"{', '.join(writers)}; got {path.suffix or 'none'!r}")
    path.write_text(writers[path.suffix](plan), encoding="utf-8")


def save_trace(plan: Plan, path) -> None:
    """The chosen layout's predicted timeline as Chrome trace events (microseconds)."""
    events = [{"name": e["name"], "cat": e["kind"], "ph": "X", "pid": 0, "tid": e["rank"],
               "ts": e["start"] * 1e6, "dur": (e["end"] - e["start"]) * 1e6}
              for e in plan.details.get("timeline", [])]
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
              "args": {"name": f"pipeline rank {r}"}} for r in sorted({e["tid"] for e in events})]
    meta = {"name": "process_name", "ph": "M", "pid": 0,
            "args": {"name": f"autopar predicted step: {plan.layout}"}}
    Path(path).write_text(json.dumps({"traceEvents": [meta, *names, *events],
                                      "displayTimeUnit": "ms"}), encoding="utf-8")


# -- the content, once ---------------------------------------------------------------------

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g}"


def headline(plan: Plan) -> list[str]:
    p, cluster = plan.predicted, ClusterSpec.from_dict(plan.cluster)
    fits = sum(1 for _, _, why in plan.alternatives if "does not fit" not in why) + 1
    lines = [f"Cluster: {cluster.describe()}.",
             f"Chosen: {plan.layout}, the fastest of {fits} costed layouts that fit in "
             f"{plan.max_memory_fraction:.0%} of device memory "
             f"({len(plan.alternatives) + 1} costed, {len(plan.skipped)} refused).",
             f"Predicted step {_ms(p.step_time_s)} ms, {p.tflops_per_device:.3g} TFLOP/s per "
             f"device, MFU {p.mfu:.1%}, pipeline bubble {p.bubble_fraction:.1%}, peak memory "
             f"{_gb(p.peak_memory_bytes)} GB per device."]
    if plan.details.get("tracing"):
        lines.append(f"Traced {plan.details['tracing']}.")
    if plan.layout.local_sgd is not None:
        lines.append(f"Local SGD: each rank steps on its own gradients and the parameters are "
                     f"averaged every {plan.layout.local_sgd} steps; the predicted step "
                     f"amortises that average{_overlap_clause(plan.layout)}. What it does to "
                     f"the loss curve is not modelled: compare the loss against a "
                     f"synchronous run.")
    if plan.layout.dgc is not None:
        lines.append(_dgc_line(plan))
    if plan.alternatives:
        lay, _, why = plan.alternatives[0]
        lines.append(f"Runner-up: {lay}: {why}.")
    return lines


def _overlap_clause(layout) -> str:
    """How an overlapped average is costed, for the Local SGD line."""
    k = layout.local_sgd_overlap
    if not k:
        return ""
    return (f", less what runs under the {k} local step{'s' * (k > 1)} it overlaps (each "
            f"average is applied {k} step{'s' * (k > 1)} late)")


def _dgc_line(plan: Plan) -> str:
    """What DGC saves: its bytes against summing every gradient whole, and the step of
    the layout it was derived from, where that was costed."""
    layout, p = plan.layout, plan.predicted
    sent = sum(p.comm_bytes.values())
    line = (f"DGC: each rank sends {1 - layout.dgc:.2%} of each large gradient as values and "
            f"indices, {sent / 1e6:.4g} MB per step against {p.uncompressed_bytes / 1e6:.4g} "
            f"MB summing every gradient whole")
    dense = layout.synchronous()
    for lay, q, _ in plan.alternatives:  # the layout it was derived from (search.py)
        if lay.dgc is None and lay.replace(zero=0, allreduce="flat") == dense:
            line += f" ({lay}: {_ms(q.step_time_s)} ms per step)"
            break
    return (line + ". The prediction is the steady state's (final sparsity, after the dense "
            "warm-up and the ramp-up). What it does to the loss curve is not modelled: "
            "compare the loss against a synchronous run.")


def comm_rows(plan: Plan) -> list[list[str]]:
    """The Communication table's rows: Prediction.comm_bytes, or that there are none."""
    if plan.predicted.comm_bytes:
        rows = [[group, f"{nbytes / 1e6:.4g}"] for group, nbytes in plan.predicted.comm_bytes.items()]
        if plan.predicted.uncompressed_bytes:
            rows.append(["dp, summed whole every step (without DGC or Local SGD)",
                         f"{plan.predicted.uncompressed_bytes / 1e6:.4g}"])
        return rows
    return [["none (one process, or nothing to exchange)", ""]]


def tables(plan: Plan) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table of the report."""
    p = plan.predicted
    capacity = ClusterSpec.from_dict(plan.cluster).device.memory_bytes
    out = [("Step time", ["part", "ms", "of step"],
            [[k.replace("_", " "), _ms(p.breakdown.get(k, 0.0)),
              f"{p.breakdown.get(k, 0.0) / p.step_time_s:.1%}"] for k in STEP_PARTS]
            + [["communication (total, overlapped or not)", _ms(p.breakdown.get("comm", 0.0)), ""]]),
           ("Memory per device (the fullest rank)", ["category", "GB", "of device"],
            [[k.replace("_", " "), _gb(v), f"{v / capacity:.1%}"] for k, v in p.memory.items()])]
    whose = ("the critical pipeline rank's sends and collectives"
             if plan.layout.pp > 1 or plan.layout.microbatches > 1
             else "the bytes of one rank's collectives")
    out.append((f"Communication per step ({whose}, by group)", ["group", "MB"],
                comm_rows(plan)))
    table = plan.details.get("tp_placements")
    if table:
        out.append(("Tensor-parallel placements (R: replicated, S(d): split on dim d, "
                    "S(d)xk: each of its k pieces split on dim d)",
                    ["parameter", "placement"],
                    [[name, show(tuple(pl) if isinstance(pl, list) else pl)]
                     for name, pl in table["params"].items()]))
    out.append((TRADEOFF, ["layout", "step ms", "peak GB", "fits", "chosen"],
                pareto_rows(plan)))
    alts = plan.alternatives[:MAX_ALTERNATIVES]
    out.append((f"Alternatives ({len(alts)} of {len(plan.alternatives)})",
                ["layout", "step ms", "peak GB", "why not"],
                [[str(lay), _ms(pr.step_time_s), _gb(pr.peak_memory_bytes), why]
                 for lay, pr, why in alts]))
    out.append(("Layouts not costed or refused, by reason", ["layouts", "reason", "first"],
                [[str(n), reason, first] for n, reason, first in skip_groups(plan.skipped)]))
    out.append((LAYERS,
                ["layer", "GFLOP", "ms"],
                [[row["name"], f"{row['flops'] / 1e9:.4g}", _ms(row["seconds"])]
                 for row in plan.details.get("layers", [])]))
    return out


# a figure in a reason: a number standing alone, not digits inside a name (fp32, bf16,
# 1f1b) nor part of a longer one
_FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[+-]?\d+)?(?!\w|\.\d)")
_SLOT = "\0"  # where a figure was, in a reason's kind: no reason holds it


def skip_groups(skipped: Sequence[tuple[Layout, str]]) -> list[tuple[int, str, str]]:
    """(count, reason, first) per kind of reason of the skipped layouts, most frequent
    first: a large search skips thousands, each reason with its own figures, so reasons
    that differ only in their figures group into one row. There each figure reads as
    the range it took over the group ("12.3–45.6", one value when all equal); `first`
    is the group's first layout with its whole reason."""
    counts: dict[str, int] = {}  # by the reason with each figure as a _SLOT
    figures: dict[str, list[list[str]]] = {}  # the values of each slot, in order
    first: dict[str, str] = {}
    for lay, why in skipped:
        kind, found = _FIGURE.sub(_SLOT, why), _FIGURE.findall(why)
        if kind not in counts:
            counts[kind], figures[kind], first[kind] = 0, [[] for _ in found], f"{lay}: {why}"
        counts[kind] += 1
        for slot, figure in zip(figures[kind], found):
            slot.append(figure)
    rows = [(n, _filled(kind, [_span(slot) for slot in figures[kind]]), first[kind])
            for kind, n in counts.items()]
    return sorted(rows, key=lambda row: -row[0])  # stable: ties in order of first seen


def _span(figures: list[str]) -> str:
    lo, hi = min(figures, key=float), max(figures, key=float)
    return lo if float(lo) == float(hi) else f"{lo}–{hi}"


def _filled(kind: str, spans: list[str]) -> str:
    """`kind` with its slots replaced by `spans`, in order."""
    parts = kind.split(_SLOT)
    return "".join(p + s for p, s in zip(parts, [*spans, ""]))


# -- time against memory -------------------------------------------------------------------

TRADEOFF = "Step time against peak memory: the Pareto front"
LAYERS = ("Per-layer cost (one rank's micro-batch in the layout's precision, before "
          "fusion and recomputation, forward + backward)")


def costed(plan: Plan) -> list[tuple[Layout, Prediction]]:
    """Every costed layout, the chosen first: Plan.alternatives holds all the others,
    those over memory included."""
    return [(plan.layout, plan.predicted), *((lay, pr) for lay, pr, _ in plan.alternatives)]


def memory_allowed(plan: Plan) -> float:
    """Bytes per device a plan may use: the device's memory times max_memory_fraction."""
    return ClusterSpec.from_dict(plan.cluster).device.memory_bytes * plan.max_memory_fraction


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """The indices of the points (memory, time) that no other point beats: none is at
    most as large in both and differs, by memory then time. Equal points are all on it."""
    front: list[int] = []
    for i in sorted(range(len(points)), key=points.__getitem__):
        # sorted, a point is on the front if faster than every point before it (the
        # front's last is the fastest of those), or equal to the front's last
        if not front or points[i][1] < points[front[-1]][1] or points[i] == points[front[-1]]:
            front.append(i)
    return front


def _front(plan: Plan) -> list[int]:
    return pareto_front([(pr.peak_memory_bytes, pr.step_time_s) for _, pr in costed(plan)])


def pareto_rows(plan: Plan) -> list[list[str]]:
    """The Pareto front's layouts, smallest memory first."""
    points, allowed, rows = costed(plan), memory_allowed(plan), []
    for i in _front(plan):
        lay, pr = points[i]
        rows.append([str(lay), _ms(pr.step_time_s), _gb(pr.peak_memory_bytes),
                     "yes" if pr.peak_memory_bytes <= allowed else "no",
                     "yes" if i == 0 else ""])
    return rows


def tradeoff_svg(plan: Plan) -> str:
    """Every costed layout's step time against its peak memory (report_svg.tradeoff)."""
    capacity = ClusterSpec.from_dict(plan.cluster).device.memory_bytes
    return svg.tradeoff([(str(lay), pr.peak_memory_bytes / 1e9, pr.step_time_s * 1e3)
                         for lay, pr in costed(plan)], _front(plan), chosen=0,
                        limit=(f"allowed: {plan.max_memory_fraction:.0%} of {_gb(capacity)} GB",
                               memory_allowed(plan) / 1e9))


# -- renderings ----------------------------------------------------------------------------

def to_markdown(plan: Plan) -> str:
    out = [f"# autopar plan: {plan.layout}", "", *headline(plan), ""]
    for title, header, rows in tables(plan):
        out += [f"## {title}", "", "| " + " | ".join(header) + " |",
                "|" + "---|" * len(header)]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        out.append("")
    out += ["## Predicted timeline", ""]
    for e in plan.details.get("timeline", []):
        out.append(f"- rank {e['rank']}: {e['name']} {_ms(e['start'])}-{_ms(e['end'])} ms")
    return "\n".join(out) + "\n"


_STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1100px}"
          "table{border-collapse:collapse;margin:.5em 0 1.5em}"
          "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}"
          "th{background:#f4f4f4}svg{display:block;margin:.5em 0 1em}")


def to_html(plan: Plan) -> str:
    p = plan.predicted
    capacity = ClusterSpec.from_dict(plan.cluster).device.memory_bytes
    charts = {
        "Step time": svg.stacked_bar([(k, p.breakdown.get(k, 0.0) * 1e3) for k in STEP_PARTS],
                                     "ms"),
        "Memory per device (the fullest rank)": svg.stacked_bar(
            [(k, v / 1e9) for k, v in p.memory.items()], "GB",
            limit=(f"allowed {plan.max_memory_fraction:.0%} of {_gb(capacity)} GB",
                   capacity * plan.max_memory_fraction / 1e9)),
        TRADEOFF: tradeoff_svg(plan),
        LAYERS: svg.column_bars(
            [(r["name"], r["seconds"] * 1e3) for r in plan.details.get("layers", [])], "ms"),
    }
    body = [f"<h1>autopar plan: {escape(str(plan.layout))}</h1>"]
    body += [f"<p>{escape(line)}</p>" for line in headline(plan)]
    for title, header, rows in tables(plan):
        body.append(f"<h2>{escape(title)}</h2>{charts.get(title, '')}")
        body.append(_html_table(header, rows))
        if title.startswith("Memory"):
            body.append("<h2>Predicted timeline per pipeline rank</h2>"
                        + svg.gantt(plan.details.get("timeline", [])))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>autopar plan</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>")


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    cells = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>"
                    for row in rows)
    return f"<table><tr>{head}</tr>{cells}</table>"
