"""The planning report: JSON round trip, Markdown and HTML content, the Pareto front and
its plot, skip reasons grouped with their figures' ranges (on a hand-made Plan), the
Chrome trace, the CLI, and the HTML rendered by a real headless Chromium (skipped
without one)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess

import pytest

import autopar
from autopar.compiler.planner.report import (
    pareto_front,
    pareto_rows,
    save_trace,
    skip_groups,
    to_html,
    to_markdown,
    tradeoff_svg,
)
from autopar.compiler.planner.result import Plan, Prediction
from autopar.examples import gpt2
from autopar.layout import Layout

logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


@pytest.fixture(scope="module")
def plan():
    ex = gpt2(layers=4, hidden=64, heads=4, vocab=256, batch=8, seq=32)
    return autopar.plan(ex.model, autopar.ClusterSpec.local(nprocs=4), ex.batch, ex.loss_fn,
                        tp=2, pp=2)


def test_json_report_round_trips(plan, tmp_path):
    plan.save_report(tmp_path / "plan.json")
    again = autopar.Plan.from_dict(json.loads((tmp_path / "plan.json").read_text()))
    assert again.to_dict() == plan.to_dict()
    assert again.layout == plan.layout and again.predicted == plan.predicted
    with pytest.raises(ValueError, match=r"suffix picks the form, one of .html, .md, .json"):
        plan.save_report(tmp_path / "plan.txt")


def test_markdown_has_every_section(plan, tmp_path):
    plan.save_report(tmp_path / "plan.md")
    text = (tmp_path / "plan.md").read_text()
    for title in ("Step time", "Memory per device", "Tensor-parallel placements",
                  "Step time against peak memory: the Pareto front", "Alternatives",
                  "Layouts not costed or refused, by reason", "Per-layer cost",
                  "Predicted timeline"):
        assert f"## {title}" in text
    # skipped layouts group by their reason's words, and every one is counted
    section = text.split("## Layouts not costed or refused, by reason")[1].split("\n## ")[0]
    counts = [int(line.split("|")[1]) for line in section.splitlines()
              if re.match(r"\| \d+ \|", line)]
    assert sum(counts) == len(plan.skipped) and 0 < len(counts) < len(plan.skipped)
    assert str(plan.layout) in text and "transformer.h.0.attn.c_attn.weight | S(" in text
    section = text.split("## Alternatives")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| Layout(")]
    assert len(rows) == len(plan.alternatives)
    assert text.count("\n- rank ") == len(plan.details["timeline"])


def test_html_is_one_offline_page(plan, tmp_path):
    plan.save_report(tmp_path / "plan.html")
    html = (tmp_path / "plan.html").read_text()
    assert "<script" not in html and "<link" not in html
    assert re.findall(r"(?:src|href)=", html) == []  # nothing loaded from elsewhere
    assert html.count('class="span"') == len(plan.details["timeline"])
    assert html.count("<svg") == 5  # step time, memory, timeline, time against memory, per-layer
    assert html.count('<circle class="point') == len(plan.alternatives) + 1



# -- on a hand-made Plan --------------------------------------------------------------------

def _pred(ms: float, gb: float) -> Prediction:
    return Prediction(step_time_s=ms / 1e3, flops_per_step=1e15, tflops_per_device=100.0,
                      mfu=0.4, peak_memory_bytes=int(gb * 1e9))


@pytest.fixture
def made():
    """A dgx-h100 plan (80 GB devices, 90% allowed: 72 GB): the chosen layout, two that
    use less memory and are slower, one dominated by another, one dominated by the
    chosen, one faster but over memory."""
    alts = [(Layout(dp=8, zero=3), _pred(120, 40), "slower"),
            (Layout(dp=8, zero=1), _pred(130, 50), "slower"),  # zero=3 beats it on both
            (Layout(dp=2, tp=4), _pred(110, 70), "slower"),  # the chosen beats it on both
            (Layout(tp=8), _pred(150, 30), "slower"),
            (Layout(dp=8), _pred(90, 75), "does not fit")]
    bound = ("not costed: it cannot take less than {} ms (plan.compute_bound), slower than "
             "the fastest fitting layout costed (11.7 ms)")
    needs = "the 1f1b schedule needs {} micro-batches in bf16"
    static = ("does not fit: parameters, gradients and adamw state alone take at least 90.5 GB "
              "per device, over the 72 GB allowed (not traced)")
    skipped = [(Layout(dp=2, pp=4, microbatches=4), bound.format(12.3)),
               (Layout(dp=1, pp=8, microbatches=8), needs.format(4)),
               (Layout(dp=4, pp=2, microbatches=2), bound.format(45.6)),
               (Layout(dp=1, pp=8, microbatches=16), needs.format(8)),
               (Layout(dp=8, pp=1), static),
               (Layout(dp=1, pp=8, microbatches=4), bound.format(9.5))]
    return Plan(layout=Layout(dp=4, tp=2), predicted=_pred(100, 60), alternatives=alts,
                skipped=skipped, cluster=autopar.ClusterSpec.preset("dgx-h100").to_dict())


def test_pareto_front_by_hand():
    points = [(10, 5), (8, 7), (12, 4), (8, 9), (11, 6), (15, 4), (8, 7), (20, 3)]
    # (8, 9): (8, 7) has as much memory and is faster; (11, 6): (10, 5) beats it on both;
    # (15, 4): (12, 4) is as fast with less memory; the two (8, 7) are equal, neither
    # beats the other. The rest, by memory: (8, 7) twice, (10, 5), (12, 4), (20, 3)
    assert pareto_front(points) == [1, 6, 0, 2, 7]
    assert pareto_front([]) == [] and pareto_front([(1.0, 1.0)]) == [0]


def test_pareto_rows_list_the_front_smallest_memory_first(made):
    # front: tp=8 (30 GB), dp=8 zero=3 (40 GB), the chosen (60 GB), dp=8 (75 GB, faster
    # than all, over the 72 GB allowed)
    assert pareto_rows(made) == [["Layout(tp=8)", "150", "30", "yes", ""],
                                 ["Layout(dp=8, zero=3)", "120", "40", "yes", ""],
                                 ["Layout(dp=4, tp=2)", "100", "60", "yes", "yes"],
                                 ["Layout(dp=8)", "90", "75", "no", ""]]


def test_tradeoff_svg_has_a_point_per_costed_layout(made):
    svg = tradeoff_svg(made)
    points = re.findall(r'<circle class="point( chosen)?"[^>]*><title>([^<]*)</title>', svg)
    assert len(points) == len(made.alternatives) + 1
    titles = [title.replace("&#x27;", "'") for _, title in points]
    for lay, pred in [(made.layout, made.predicted), *((a, p) for a, p, _ in made.alternatives)]:
        assert sum(t.startswith(f"{lay}: {pred.step_time_s * 1e3:.4g} ms") for t in titles) == 1
    chosen = [title for mark, title in points if mark]
    assert chosen == ["Layout(dp=4, tp=2): 100 ms, 60 GB, chosen, on the Pareto front"]
    assert sum("over the memory allowed" in t for t in titles) == 1  # dp=8 at 75 GB
    front = re.search(r'<polyline class="front" points="([^"]*)"', svg).group(1).split()
    assert len(front) == 4
    xs = [float(p.split(",")[0]) for p in front]
    assert xs == sorted(xs)  # by memory
    limit = float(re.search(r'<line class="limit" x1="([\d.]+)"', svg).group(1))
    assert xs[2] < limit < xs[3]  # 72 GB: between the chosen's 60 and dp=8's 75
    assert "allowed: 90% of 80 GB" in svg


def test_skip_reasons_group_with_the_range_of_each_figure(made):
    assert skip_groups(made.skipped) == [
        (3, ("not costed: it cannot take less than 9.5–45.6 ms (plan.compute_bound), slower "
             "than the fastest fitting layout costed (11.7 ms)"),
         f"{made.skipped[0][0]}: {made.skipped[0][1]}"),
        (2, "the 1f1b schedule needs 4–8 micro-batches in bf16",  # names keep their digits
         f"{made.skipped[1][0]}: {made.skipped[1][1]}"),
        (1, made.skipped[4][1], f"{made.skipped[4][0]}: {made.skipped[4][1]}")]
    assert skip_groups([]) == []


def test_hand_made_plan_renders(made):
    text = to_markdown(made)
    assert "| Layout(dp=8) | 90 | 75 | no |  |" in text
    assert "| 3 | not costed: it cannot take less than 9.5–45.6 ms" in text
    html = to_html(made)
    assert html.count('<circle class="point') == 6 and html.count('class="point chosen"') == 1

def test_chrome_trace_holds_the_predicted_spans(plan, tmp_path):
    save_trace(plan, tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(plan.details["timeline"])
    assert {e["tid"] for e in spans} == set(range(plan.layout.pp))
    assert all(e["dur"] >= 0 for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans) / 1e6
    assert end == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


def test_cli_plan_writes_reports(tmp_path, capsys):
    from autopar import cli

    html, trace = tmp_path / "plan.html", tmp_path / "trace.json"
    assert cli.main(["plan", "gpt2-tiny", "--cluster", "local", "--nproc", "2", "--pp", "1",
                     "--report", str(html), "--trace", str(trace), "--json"]) == 0
    out = capsys.readouterr().out
    info = json.loads(out[out.index("{"):])
    assert info["layout"]["pp"] == 1 and html.exists() and trace.exists()
    assert info["details"]["search"]["traces"] >= 1
    assert cli.main(["plan", "gpt2-tiny", "--cluster", "local", "--nproc", "2", "--pp", "2",
                     "--trace-blocks", "1", "--microbatches", "2", "--schedule", "1f1b"]) == 0
    assert "Chosen: Layout(pp=2, microbatches=2)" in capsys.readouterr().out.replace("\n", " ")
    with pytest.raises(SystemExit, match="unknown plan constraint|Layout.tp must be"):
        cli.main(["plan", "gpt2-tiny", "--cluster", "local", "--nproc", "2", "--tp", "0"])


# -- rendered by a real browser ------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# appended to a copy of the page (the report itself has no script): what the browser
# laid out, and any script error, written into the DOM that --dump-dom prints
PROBE = """<script>
window.onerror = (m) => { document.body.setAttribute('data-error', m); };
const charts = [...document.querySelectorAll('svg.chart')].map(s => s.getBoundingClientRect());
const spans = [...document.querySelectorAll('rect.span')].filter(r => r.getBBox().width > 0);
const out = document.createElement('pre');
out.id = 'probe';
out.textContent = JSON.stringify({charts: charts.map(c => [c.width, c.height]),
                                  spans: spans.length});
document.body.appendChild(out);
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
def test_html_renders_in_headless_chromium(plan, tmp_path):
    plan.save_report(tmp_path / "plan.html")
    page = tmp_path / "probe.html"
    page.write_text((tmp_path / "plan.html").read_text().replace("</body>", PROBE + "</body>"))
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert 'data-error="' not in dom  # no script error
    probe = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom).group(1).replace("&quot;", '"'))
    assert len(probe["charts"]) == 5 and all(w > 100 and h > 20 for w, h in probe["charts"])
    assert probe["spans"] == len(plan.details["timeline"])
    shot = tmp_path / "plan.png"
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,1600",
                            (tmp_path / "plan.html").as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
