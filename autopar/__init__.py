"""autopar: turn a single-device PyTorch training step into an equivalent parallel one.

Public names only; see DESIGN.md's contract and docs/.
"""

from autopar.api import compile, run_passes, trace
from autopar.cluster import ClusterSpec
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.trace import TraceError
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.manager import PassManager, register_pass
from autopar.compiler.passes.pipeline import default_passes
from autopar.compiler.planner.cost_model import Efficiency
from autopar.compiler.planner.estimate import estimate
from autopar.compiler.planner.plan import plan
from autopar.compiler.planner.search import PlanError
from autopar.layout import Layout, LayoutError, Plan, Prediction
from autopar.runtime.checkpoint import CheckpointError
from autopar.runtime.mesh import WorldSizeError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ClusterSpec", "Efficiency", "GraphPass", "Layout", "LayoutError",
    "PassContext", "PassManager", "PassResult", "Plan", "PlanError", "Prediction", "TraceError",
    "TrainGraph", "WorldSizeError", "compile", "default_passes", "estimate", "plan",
    "register_pass", "run_passes", "trace",
]
