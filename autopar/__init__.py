"""autopar: turn a single-device PyTorch training step into an equivalent parallel one.

Public names only (the contract users, docs and tests rely on); docs/architecture.md
maps the package behind them.
"""

from autopar.api import check, compile, trace
from autopar.bisection import BisectError, BisectReport, bisect
from autopar.cluster import ClusterSpec
from autopar.compiler.ir.collectives import CollectiveMismatch
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.trace import TraceError
from autopar.compiler.passes.base import GraphPass, PassContext, PassOptions, PassResult
from autopar.compiler.passes.defaults import default_passes, run_passes
from autopar.compiler.passes.manager import PassManager, register_pass
from autopar.compiler.planner.estimate import estimate
from autopar.compiler.planner.plan import plan
from autopar.compiler.planner.result import Plan, Prediction
from autopar.compiler.planner.search import PlanArgumentError, PlanError
from autopar.costs import Efficiency
from autopar.compiler.lowering.lower_ps import PSSplitError
from autopar.layout import Layout, LayoutError, PSLayout
from autopar.runtime.checkpoint import CheckpointError
from autopar.runtime.mesh import WorldSizeError
from autopar.runtime.ps import PSError, TokenError

__version__ = "0.1.0"

__all__ = [
    "BisectError", "BisectReport", "CheckpointError", "ClusterSpec", "CollectiveMismatch", "Efficiency", "GraphPass", "Layout", "LayoutError",
    "PassContext", "PassManager", "PassOptions", "PassResult", "Plan", "PlanArgumentError",
    "PlanError", "PSError", "PSLayout", "PSSplitError", "TokenError",
    "Prediction", "TraceError", "TrainGraph", "WorldSizeError", "bisect", "check", "compile", "default_passes",
    "estimate", "plan", "register_pass", "run_passes", "trace",
]
