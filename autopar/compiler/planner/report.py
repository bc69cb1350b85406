"""The planning report of a Plan: one offline HTML page (inline SVG charts, no
scripts or files from elsewhere), Markdown, or JSON (reads back with
`Plan.from_dict`); and the predicted timeline as a Chrome trace (Perfetto's JSON
format: open it at ui.perfetto.dev or chrome://tracing).

Both text forms render the same tables (`tables`): the layout and why, the step
time by part, memory by category against the device, the tensor-parallel placement
of each parameter, the alternatives with why not, the refused layouts, per-layer
costs.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from autopar.cluster import ClusterSpec
from autopar.compiler.passes.tp_rules import show
from autopar.compiler.planner import report_svg as svg

if TYPE_CHECKING:  # result.Plan.save_report calls this module: no import at run time
    from autopar.compiler.planner.result import Plan

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
    if plan.alternatives:
        lay, _, why = plan.alternatives[0]
        lines.append(f"Runner-up: {lay}: {why}.")
    return lines


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
    table = plan.details.get("tp_placements")
    if table:
        out.append(("Tensor-parallel placements (R: replicated, S(d): split on dim d)",
                    ["parameter", "placement"],
                    [[name, show(tuple(pl) if isinstance(pl, list) else pl)]
                     for name, pl in table["params"].items()]))
    alts = plan.alternatives[:MAX_ALTERNATIVES]
    out.append((f"Alternatives ({len(alts)} of {len(plan.alternatives)})",
                ["layout", "step ms", "peak GB", "why not"],
                [[str(lay), _ms(pr.step_time_s), _gb(pr.peak_memory_bytes), why]
                 for lay, pr, why in alts]))
    kinds: Counter[str] = Counter()
    first: dict[str, str] = {}  # each kind's first layout, with its whole reason
    for lay, why in plan.skipped:
        kind = _reason_kind(why)
        kinds[kind] += 1
        first.setdefault(kind, f"{lay}: {why}")
    out.append(("Layouts not costed or refused, by reason", ["layouts", "reason", "first"],
                [[str(n), kind, first[kind]] for kind, n in kinds.most_common()]))
    out.append(("Per-layer cost (one rank's micro-batch, forward + backward)",
                ["layer", "GFLOP", "roofline ms"],
                [[row["name"], f"{row['flops'] / 1e9:.4g}", _ms(row["seconds"])]
                 for row in plan.details.get("layers", [])]))
    return out


def _reason_kind(why: str) -> str:
    """A skipped layout's reason with its figures left out: the reasons of a large
    search (each with its own bound or step time) group into a few rows."""
    return re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "#", why)


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
        "Per-layer cost (one rank's micro-batch, forward + backward)": svg.column_bars(
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
