"""autopar: turn a single-device PyTorch training step into an equivalent parallel one.

Public names only (the contract users, docs and tests rely on); docs/architecture.md
maps the package behind them.

Each name is imported on first use (PEP 562), not with the package: the compiler behind
`autopar.compile` pulls in torch.export, AOTAutograd and sympy, about 2 s of a process's
start on this machine, which the command line's `--help`, the parameter servers and the
launchers never run. `import autopar` then costs nothing, and `autopar.compile` the same
as before on its first use. A submodule (`autopar.examples`) is imported when named.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "autopar.api": ("check", "compile", "trace"),
    "autopar.bisection": ("BisectError", "BisectReport", "bisect"),
    "autopar.cluster": ("ClusterSpec",),
    "autopar.compiler.ir.collectives": ("CollectiveMismatch",),
    "autopar.compiler.ir.graph": ("TrainGraph",),
    "autopar.compiler.ir.trace": ("TraceError",),
    "autopar.compiler.passes.base": ("GraphPass", "PassContext", "PassOptions", "PassResult"),
    "autopar.compiler.passes.defaults": ("default_passes", "run_passes"),
    "autopar.compiler.passes.manager": ("PassManager", "register_pass"),
    "autopar.compiler.planner.estimate": ("estimate",),
    "autopar.compiler.planner.plan": ("plan",),
    "autopar.compiler.planner.result": ("Plan", "Prediction"),
    "autopar.compiler.planner.search": ("PlanArgumentError", "PlanError"),
    "autopar.costs": ("Efficiency",),
    "autopar.compiler.lowering.lower_ps": ("PSSplitError",),
    "autopar.layout": ("Layout", "LayoutError", "PSLayout"),
    "autopar.runtime.checkpoint": ("CheckpointError",),
    "autopar.runtime.mesh": ("WorldSizeError",),
    "autopar.runtime.ps": ("PSError", "TokenError"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "BisectError", "BisectReport", "CheckpointError", "ClusterSpec", "CollectiveMismatch",
    "Efficiency", "GraphPass", "Layout", "LayoutError", "PassContext", "PassManager",
    "PassOptions", "PassResult", "Plan", "PlanArgumentError", "PlanError", "PSError",
    "PSLayout", "PSSplitError", "TokenError", "Prediction", "TraceError", "TrainGraph",
    "WorldSizeError", "bisect", "check", "compile", "default_passes", "estimate", "plan",
    "register_pass", "run_passes", "trace",
]


def __getattr__(name: str) -> Any:
    if name in _HOME_OF:
        value = getattr(importlib.import_module(_HOME_OF[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next use is a plain attribute read
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported
    from autopar.api import check, compile, trace
    from autopar.bisection import BisectError, BisectReport, bisect
    from autopar.cluster import ClusterSpec
    from autopar.compiler.ir.collectives import CollectiveMismatch
    from autopar.compiler.ir.graph import TrainGraph
    from autopar.compiler.ir.trace import TraceError
    from autopar.compiler.lowering.lower_ps import PSSplitError
    from autopar.compiler.passes.base import GraphPass, PassContext, PassOptions, PassResult
    from autopar.compiler.passes.defaults import default_passes, run_passes
    from autopar.compiler.passes.manager import PassManager, register_pass
    from autopar.compiler.planner.estimate import estimate
    from autopar.compiler.planner.plan import plan
    from autopar.compiler.planner.result import Plan, Prediction
    from autopar.compiler.planner.search import PlanArgumentError, PlanError
    from autopar.costs import Efficiency
    from autopar.layout import Layout, LayoutError, PSLayout
    from autopar.runtime.checkpoint import CheckpointError
    from autopar.runtime.mesh import WorldSizeError
    from autopar.runtime.ps import PSError, TokenError
