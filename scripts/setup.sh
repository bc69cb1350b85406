#!/usr/bin/env bash
# Creates .venv and installs autopar with its test dependencies.
# torch is pinned to 2.13.0 here, the CPU build this machine keeps on disk: an open
# range would pull a multi-GB CUDA build. The package itself asks only torch>=2.13.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.autopar-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  # torch first and alone, so nothing later can ask pip for a different build
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 numpy 2>&1 | grep -v "is ignored" || true
  .venv/bin/pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -c "import autopar, transformers, triton, torch; assert torch.__version__.startswith('2.13')"
  touch "$stamp"
fi
# Headless Chromium renders the planning report in tests/unit/test_planner_report.py
# (the test skips, saying why, without it). Best effort: root and apt only, never fatal.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q chromium >/dev/null 2>&1 || echo "setup: chromium not installed; the report's browser test will skip" >&2
fi
