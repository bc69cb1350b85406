"""Inline SVG charts for the planning report: plain strings, no scripts, no fonts or
files from elsewhere (the page must work offline)."""

from __future__ import annotations

from html import escape

COLORS = {"compute": "#4e79a7", "exposed_comm": "#f28e2b", "bubble": "#bab0ac",
          "optimizer": "#59a14f", "F": "#4e79a7", "B": "#e15759", "I": "#e15759",
          "W": "#ff9da7", "grad sync": "#f28e2b", "param gather": "#f28e2b",
          "optimizer step": "#59a14f",
          "exposed comm": "#f28e2b", "parameters": "#4e79a7", "gradients": "#e15759",
          "optimizer_states": "#59a14f", "activations": "#edc948", "buffers": "#b07aa1",
          "comm_buffers": "#f28e2b"}
OTHER = "#9c755f"


def color(kind: str) -> str:
    return COLORS.get(kind, OTHER)


def stacked_bar(parts: list[tuple[str, float]], unit: str, width: int = 640,
                limit: tuple[str, float] | None = None) -> str:
    """One horizontal bar of `parts` (label, value) with a legend; `limit` draws a
    labelled vertical line (a memory capacity) and sets the scale if it is larger."""
    total = sum(v for _, v in parts)
    scale_max = max(total, limit[1] if limit else 0.0) or 1.0
    x, rects, legend = 0.0, [], []
    for i, (label, value) in enumerate(parts):
        w = value / scale_max * width
        rects.append(f'<rect class="bar" x="{x:.2f}" y="10" width="{max(w, 0):.2f}" height="28" '
                     f'fill="{color(label)}"><title>{escape(label)}: {value:.4g} {unit}</title></rect>')
        legend.append(f'<rect x="{i * 160}" y="52" width="10" height="10" fill="{color(label)}"/>'
                      f'<text x="{i * 160 + 14}" y="61">{escape(label)} {value:.3g} {unit}</text>')
        x += w
    if limit:
        lx = limit[1] / scale_max * width
        rects.append(f'<line x1="{lx:.2f}" y1="4" x2="{lx:.2f}" y2="44" stroke="#d00" '
                     f'stroke-width="2"/><text x="{min(lx, width - 120):.2f}" y="80" '
                     f'fill="#d00">{escape(limit[0])}</text>')
    height = 88 if limit else 70
    return (f'<svg class="chart" width="{max(width, 160 * len(parts))}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg" font-size="11">{"".join(rects)}'
            f'{"".join(legend)}</svg>')


def gantt(events: list[dict], width: int = 900, row: int = 26) -> str:
    """One row per rank, one rectangle per predicted span (schedule actions, gradient
    sync, optimizer), time in milliseconds on the axis."""
    if not events:
        return "<p>no timeline</p>"
    end = max(e["end"] for e in events) or 1.0
    ranks = sorted({e["rank"] for e in events})
    left = 60
    scale = (width - left - 10) / end
    out = []
    for r in ranks:
        y = 10 + r * row
        out.append(f'<text x="4" y="{y + row / 2 + 4}">rank {r}</text>')
        for e in (e for e in events if e["rank"] == r):
            x, w = left + e["start"] * scale, max((e["end"] - e["start"]) * scale, 0.5)
            label = escape(e["name"])
            text = (f'<text x="{x + 2:.1f}" y="{y + row / 2 + 3}" fill="#fff" font-size="9">'
                    f'{label}</text>') if w > 7 * len(e["name"]) else ""
            out.append(f'<rect class="span" x="{x:.2f}" y="{y}" width="{w:.2f}" '
                       f'height="{row - 4}" fill="{color(e["kind"])}"><title>{label}: '
                       f'{e["start"] * 1e3:.4g}-{e["end"] * 1e3:.4g} ms</title></rect>{text}')
    axis_y = 14 + len(ranks) * row
    ticks = "".join(f'<text x="{left + f * (width - left - 10):.1f}" y="{axis_y + 10}">'
                    f'{f * end * 1e3:.3g} ms</text>' for f in (0, 0.25, 0.5, 0.75, 1.0))
    return (f'<svg class="chart" width="{width + 40}" height="{axis_y + 20}" '
            f'xmlns="http://www.w3.org/2000/svg" font-size="11">{"".join(out)}{ticks}</svg>')


def column_bars(rows: list[tuple[str, float]], unit: str, width: int = 640) -> str:
    """One horizontal bar per row (per-layer costs)."""
    top = max((v for _, v in rows), default=0.0) or 1.0
    out = []
    for i, (label, value) in enumerate(rows):
        y = 4 + i * 18
        out.append(f'<text x="0" y="{y + 11}">{escape(label)}</text>'
                   f'<rect class="bar" x="140" y="{y}" width="{value / top * (width - 220):.2f}" '
                   f'height="14" fill="{COLORS["compute"]}"/><text x="'
                   f'{150 + value / top * (width - 220):.1f}" y="{y + 11}">{value:.3g} {unit}</text>')
    return (f'<svg class="chart" width="{width}" height="{8 + 18 * len(rows)}" '
            f'xmlns="http://www.w3.org/2000/svg" font-size="11">{"".join(out)}</svg>')


def _domain(values: list[float]) -> tuple[float, float]:
    """The range of `values` with a 5% margin either side (not below 0 for values that
    are not), never empty."""
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    return (max(lo - pad, 0.0) if lo >= 0 else lo - pad), hi + pad


def tradeoff(points: list[tuple[str, float, float]], front: list[int], chosen: int,
             limit: tuple[str, float], width: int = 640, height: int = 360) -> str:
    """Step time (y) against peak memory per device (x) of `points` (label, GB, ms): one
    circle each, titled with its label and figures, `chosen` (an index) larger and red,
    those over `limit` (label, GB) hollow; the Pareto front (`front`: indices by
    memory) a line through its points; the memory limit a labelled vertical line."""
    left, right, top, bottom = 60, 20, 24, 64
    (x_lo, x_hi), (y_lo, y_hi) = (_domain([gb for _, gb, _ in points] + [limit[1]]),
                                  _domain([ms for _, _, ms in points]))

    def at(gb: float, ms: float) -> tuple[float, float]:
        return (left + (gb - x_lo) / (x_hi - x_lo) * (width - left - right),
                height - bottom - (ms - y_lo) / (y_hi - y_lo) * (height - top - bottom))

    axes = (f'<path d="M{left} {top}V{height - bottom}H{width - right}" fill="none" '
            f'stroke="#888"/><text x="{(left + width - right) / 2}" y="{height - bottom + 30}" '
            f'text-anchor="middle">peak memory per device (GB)</text>'
            f'<text x="4" y="{top - 10}">step time (ms)</text>')
    out = [axes]
    for f in (0, 0.25, 0.5, 0.75, 1.0):
        gb, ms = x_lo + f * (x_hi - x_lo), y_lo + f * (y_hi - y_lo)
        x, y = at(gb, ms)
        out.append(f'<text x="{x:.1f}" y="{height - bottom + 14}" text-anchor="middle">'
                   f'{gb:.3g}</text><text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{ms:.4g}</text>')
    lx = at(limit[1], y_lo)[0]
    out.append(f'<line class="limit" x1="{lx:.2f}" y1="{top}" x2="{lx:.2f}" '
               f'y2="{height - bottom}" stroke="#d00" stroke-width="1.5" stroke-dasharray="4 3"/>'
               f'<text x="{min(lx + 4, width - 220):.2f}" y="{top + 10}" fill="#d00">'
               f'{escape(limit[0])}</text>')
    line = " ".join("{:.2f},{:.2f}".format(*at(*points[i][1:])) for i in front)
    out.append(f'<polyline class="front" points="{line}" fill="none" stroke="{OTHER}" '
               f'stroke-width="1.5"/>')
    on_front = set(front)
    for i in sorted(range(len(points)), key=lambda i: i == chosen):  # the chosen on top
        label, gb, ms = points[i]
        x, y = at(gb, ms)
        notes = "".join(note for note, yes in ((", chosen", i == chosen),
                                              (", on the Pareto front", i in on_front),
                                              (", over the memory allowed", gb > limit[1]))
                        if yes)
        out.append(f'<circle class="point{" chosen" if i == chosen else ""}" cx="{x:.2f}" '
                   f'cy="{y:.2f}" {_MARKS[_mark(i == chosen, gb > limit[1])]}><title>'
                   f'{escape(label)}: {ms:.4g} ms, {gb:.3g} GB{notes}</title></circle>')
    out.append(_tradeoff_legend(height - 14))
    return (f'<svg class="chart" width="{width}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg" font-size="11">{"".join(out)}</svg>')


# the circle of a layout in `tradeoff`: chosen, fitting in memory, over it
_MARKS = {"chosen": 'r="6" fill="#d00" stroke="#d00"',
          "fits": f'r="3.5" fill="{COLORS["compute"]}" stroke="{COLORS["compute"]}"',
          "over": f'r="3.5" fill="none" stroke="{COLORS["compute"]}"'}


def _mark(chosen: bool, over: bool) -> str:
    return "chosen" if chosen else ("over" if over else "fits")


def _tradeoff_legend(y: float) -> str:
    items = [(f'<circle cx="6" cy="-4" {_MARKS[k]}/>', text) for k, text in
             (("chosen", "chosen"), ("fits", "fits in the memory allowed"),
              ("over", "over the memory allowed"))]
    items.append((f'<line x1="0" y1="-4" x2="12" y2="-4" stroke="{OTHER}" stroke-width="1.5"/>',
                  "Pareto front"))
    out, x = [], 10
    for mark, text in items:
        out.append(f'<g transform="translate({x},{y})">{mark}<text x="16" y="0">'
                   f'{escape(text)}</text></g>')
        x += 36 + 6 * len(text)
    return "".join(out)
