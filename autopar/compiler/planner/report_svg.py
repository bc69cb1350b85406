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
