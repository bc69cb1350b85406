"""The layering of docs/architecture.md, enforced by import-linter's contracts in
pyproject.toml: each layer imports only the layers below it, the compiler never imports
the runtime, and no package has an import loop."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    if not LINT.exists():
        pytest.fail(f"{LINT} is missing: `make setup` installs import-linter (dev extra)")
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_import_contracts_hold():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout


@pytest.mark.parametrize("importer, line, broken", [
    # a pass reaching up into the planner
    ("compiler/passes/tp_solver.py", "from autopar.compiler.planner import cost_model",
     "autopar.compiler.passes is not allowed to import autopar.compiler.planner"),
    # the planner reaching into the runtime (both sit above the IR)
    ("compiler/planner/plan.py", "from autopar.runtime import executor",
     "autopar.compiler is not allowed to import autopar.runtime"),
    # a loop inside the IR
    ("compiler/ir/meta.py", "from autopar.compiler.ir import graph",
     "No cycles are allowed in autopar.compiler.ir"),
])
def test_contracts_refuse_a_wrong_import(tmp_path, importer, line, broken):
    """The contracts are not vacuous: one added import in a copy of the package breaks them."""
    shutil.copytree(ROOT / "autopar", tmp_path / "autopar",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "autopar" / importer
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode == 1, out.stdout
    assert broken in " ".join(out.stdout.split()), out.stdout


def test_every_import_of_autopar_names_resolves():
    """An import inside a function (the CLI's, kept lazy for start-up) runs only when
    that command does: check that each `from autopar... import name` in the package
    names something that exists, so a moved module or renamed name fails here."""
    import ast
    import importlib

    missing = []
    for path in sorted((ROOT / "autopar").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0
                    and (node.module or "").split(".")[0] == "autopar"):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno} "
                                       f"from {node.module} import {alias.name}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
