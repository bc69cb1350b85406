"""autopar.compile in one process (no torchrun): parity with eager, errors, user passes, docs."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

import autopar
from autopar.examples import gpt2, mlp
from autopar.testing import compare, make_batches, reference_train

DOCS = Path(__file__).resolve().parents[2] / "docs"


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def test_single_process_step_equals_eager_training():
    ex = gpt2()
    init = {k: v.clone() for k, v in ex.model.state_dict().items()}
    batches = make_batches(ex.batch, 3)
    ref_losses, ref_state = reference_train(ex.model, batches, ex.loss_fn, sgd)
    step = autopar.compile(copy.deepcopy(ex.model), None, ex.batch, ex.loss_fn, optimizer=sgd)
    losses = [step(*b).item() for b in batches]
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)


def test_world_size_mismatch_outside_torchrun():
    ex = mlp()
    with pytest.raises(autopar.LayoutError, match="torchrun --nproc-per-node 2"):
        autopar.compile(ex.model, None, ex.batch, ex.loss_fn, layout=autopar.Layout(dp=2))


def test_batch_shape_mismatch_at_step_time():
    ex = mlp()
    step = autopar.compile(copy.deepcopy(ex.model), None, ex.batch, ex.loss_fn)
    with pytest.raises(ValueError, match=r"compiled for 16 \(16 per rank x dp=1\)"):
        step(torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"compiled to be called as step\(input_0\)"):
        step(*ex.batch, *ex.batch)


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_DUMP", str(tmp_path))
    ex = mlp()
    autopar.compile(copy.deepcopy(ex.model), None, ex.batch, ex.loss_fn)
    assert (tmp_path / "000_traced.py").exists()


def test_docs_pass_example_runs():
    """The example of docs/passes.md, executed as written."""
    code = re.findall(r"```python\n(.*?)```", (DOCS / "passes.md").read_text(), re.S)
    namespace: dict = {}
    exec(code[0], namespace)  # noqa: S102 - our own documentation
    ex = mlp()
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    layout = autopar.Layout()
    new, results = autopar.run_passes(tg, layout, passes=["scale_loss_gradient"])
    assert not results[0].changed and results[0].declined
    pm = autopar.PassManager([namespace["ScaleLossGradient"](scale=2.0)])
    new, results = pm.run(tg, autopar.PassContext(layout))
    with torch.no_grad():
        plain = tg.gm(*ex.model.parameters(), *ex.batch)
        scaled = new.gm(*ex.model.parameters(), *ex.batch)
    torch.testing.assert_close(scaled[1], 2 * plain[1])


def test_planned_compile_needs_the_jobs_world_size_and_a_known_optimizer():
    ex = mlp()
    with pytest.raises(autopar.LayoutError, match=r"2 devices and this job has 1 process"):
        autopar.compile(ex.model, autopar.ClusterSpec.local(2), ex.batch, ex.loss_fn)
    with pytest.raises(ValueError, match="knows AdamW, Adam and SGD.*built Adagrad"):
        autopar.compile(ex.model, None, ex.batch, ex.loss_fn,
                        optimizer=lambda p: torch.optim.Adagrad(p))
    assert autopar.api.optimizer_kind(lambda p: torch.optim.AdamW(p, fused=True)) \
        == "adamw-fused"
    assert autopar.api.optimizer_kind(lambda p: torch.optim.SGD(p, lr=0.1)) == "sgd"
    assert autopar.api.optimizer_kind(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) \
        == "sgd-momentum"


def test_planned_compile_on_one_process_trains_the_plans_layout():
    ex = mlp()
    step = autopar.compile(ex.model, None, ex.batch, ex.loss_fn)
    assert step.plan is not None and step.plan.layout == autopar.Layout()
    assert torch.isfinite(step(*ex.batch))


def test_every_public_name_is_its_home_modules_object():
    """`autopar.X` (imported on first use) is the object its module defines; `from autopar
    import *` gives every name of __all__; a submodule is imported when named."""
    import importlib

    assert sorted(autopar.__all__) == sorted(autopar._HOME_OF)
    for name in autopar.__all__:
        home = importlib.import_module(autopar._HOME_OF[name])
        assert getattr(autopar, name) is getattr(home, name), name
    names: dict = {}
    exec("from autopar import *", names)
    assert set(autopar.__all__) <= set(names)
    assert autopar.examples.gpt2 is importlib.import_module("autopar.examples").gpt2
    assert "compile" in dir(autopar)
    with pytest.raises(AttributeError, match="no attribute 'compil'"):
        autopar.compil  # noqa: B018


@pytest.mark.parametrize("code, left_out", [
    # the command line's help and its flag errors, before any command runs
    ("from autopar.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
     ["torch", "autopar.api"]),
    ("from autopar.cli import main\ntry:\n    main(['train', '--help'])\nexcept SystemExit:\n"
     "    pass", ["torch", "autopar.api"]),
    ("import autopar; autopar.Layout(dp=2)", ["torch", "autopar.api"]),
    # a parameter server and the elastic launcher do not compile: no compiler in them
    ("import autopar.ps_worker", ["autopar.api", "autopar.compiler.passes", "torch._dynamo"]),
    ("import autopar.elastic", ["autopar.api", "autopar.compiler.passes"]),
])
def test_entry_points_import_only_what_they_run(code, left_out):
    """`import autopar` imports nothing until a name is used, so a process that never
    compiles does not pay the compiler's imports (about 2 s on this machine), and
    `autopar --help` answers without torch."""
    import subprocess
    import sys

    check = f"{code}\nimport sys\nprint(sorted(m for m in {left_out!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", (code, out.stdout)
