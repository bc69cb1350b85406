"""The planning report: JSON round trip, Markdown and HTML content, the Chrome trace,
the CLI, and the HTML rendered by a real headless Chromium (skipped without one)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess

import pytest

import autopar
from autopar.compiler.planner.report import save_trace
from autopar.examples import gpt2

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
    for title in ("Step time", "Memory per device", "Tensor-parallel placements", "Alternatives",
                  "Layouts not costed or refused, by reason", "Per-layer cost",
                  "Predicted timeline"):
        assert f"## {title}" in text
    # skipped layouts group by their reason without its figures, and every one is counted
    section = text.split("## Layouts not costed or refused, by reason")[1].split("\n## ")[0]
    counts = [int(line.split("|")[1]) for line in section.splitlines()
              if re.match(r"\| \d+ \|", line)]
    assert sum(counts) == len(plan.skipped) and 0 < len(counts) < len(plan.skipped)
    assert str(plan.layout) in text and "transformer.h.0.attn.c_attn.weight | S(" in text
    rows = [line for line in text.splitlines() if line.startswith("| Layout(")]
    assert len(rows) == len(plan.alternatives)
    assert text.count("\n- rank ") == len(plan.details["timeline"])


def test_html_is_one_offline_page(plan, tmp_path):
    plan.save_report(tmp_path / "plan.html")
    html = (tmp_path / "plan.html").read_text()
    assert "<script" not in html and "<link" not in html
    assert re.findall(r"(?:src|href)=", html) == []  # nothing loaded from elsewhere
    assert html.count('class="span"') == len(plan.details["timeline"])
    assert html.count("<svg") == 4  # step time, memory, timeline, per-layer


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
    assert len(probe["charts"]) == 4 and all(w > 100 and h > 20 for w, h in probe["charts"])
    assert probe["spans"] == len(plan.details["timeline"])
    shot = tmp_path / "plan.png"
    subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,1600",
                            (tmp_path / "plan.html").as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
