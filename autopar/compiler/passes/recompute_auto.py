"""recompute="auto": the per-layer recompute policy that fits a memory budget at the
least recompute time.

Each layer's policies (none, selective, full; see recompute.py) are costed one layer
at a time on the real graph: the bytes of activations they stop saving (the memory
model's saved bytes at the first backward op) and the time their copies add (roofline, as the cost model prices ops).
Recomputation never reaches across a layer, so the layers' choices add up, and the
choice is a multiple-choice knapsack:

    minimise    sum_{l,k} time[l,k] * x[l,k]
    subject to  sum_k x[l,k] = 1                       for every layer l
                sum_{l,k} freed[l,k] * x[l,k] >= need  (need = peak without recompute - budget)

solved exactly by HiGHS. Saved activations are not the whole peak (where in the
backward it falls matters too), so the memory model then predicts the peak of the
rewritten step; while it is over the budget, `need` grows by the overshoot and the
knapsack is solved again. If that does not converge the cheapest uniform policy that
fits is taken, so the plan never exceeds the budget when any plan in this space fits.

The budget is `PassOptions.memory_budget` (bytes per device), else the cluster's
`device.memory_bytes`. The optimizer's memory comes from `PassOptions.optimizer_memory`
(`autopar.compile` profiles the user's optimizer), else AdamW's.
"""

from __future__ import annotations

import highspy

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import graph_liveness, step_memory
from autopar.compiler.analysis.summary import summarize
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import executed_flops
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.passes.base import PassContext
from autopar.compiler.passes.recompute_rules import (
    RecomputeError,
    choose,
    layers_of,
    rewrite,
)
from autopar.costs import op_time
from autopar.highs import new_model

POLICIES = ("none", "selective", "full")
_MAX_ROUNDS = 8


def memory_budget(ctx: PassContext) -> int:
    budget = ctx.options.memory_budget
    if budget is None and ctx.cluster is not None:
        budget = ctx.cluster.device.memory_bytes
    if budget is None:
        raise RecomputeError("Layout.recompute='auto' needs a memory budget per device: pass "
                             "a cluster (its device.memory_bytes is the budget) or the pass "
                             "option memory_budget (bytes)")
    return int(budget)


class _Costing:
    """Rewrites and costs the graph under a policy per layer (memoised)."""

    def __init__(self, tg: TrainGraph, ctx: PassContext):
        self.tg, self.layout = tg, ctx.layout
        self.optimizer = ctx.options.optimizer_memory
        cluster = ctx.cluster or ClusterSpec.preset("dgx-h100")  # only the ratio matters
        self.peak_flops = cluster.peak_flops_for("fp32")
        self.bandwidth = cluster.device.memory_bandwidth
        self._cache: dict[tuple, tuple[int, int, int]] = {}

    def _seconds(self, node) -> float:
        """Roofline time of one recomputed op (most are memory-bound: FLOPs alone would
        make pointwise ops free)."""
        return op_time(executed_flops(node), node.meta.get(M.BYTES, 0), self.peak_flops,
                       self.bandwidth)

    def cost(self, per_layer: dict) -> tuple[int, int, float]:
        """(predicted peak, saved activation bytes, seconds of recomputation)."""
        key = tuple(sorted(per_layer.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
        if key not in self._cache:
            tg = self.tg.copy()
            chosen, _ = choose(tg, per_layer)
            rewrite(tg.graph, chosen)
            summary = summarize(tg)
            seconds = sum(self._seconds(n) for n in tg.call_nodes() if n.meta.get(M.RECOMPUTED))
            peak = step_memory(summary, self.layout, self.optimizer).peak_bytes
            self._cache[key] = (peak, graph_liveness(summary).saved_bytes, seconds)
        return self._cache[key]


def plan_auto(tg: TrainGraph, ctx: PassContext) -> dict:
    """The policy per layer (None: a model without a repeated stack) for the budget."""
    budget = memory_budget(ctx)
    costing = _Costing(tg, ctx)
    layers = layers_of(tg)
    uniform = {k: {layer: k for layer in layers} for k in POLICIES}
    base_peak, base_saved, _ = costing.cost(uniform["none"])
    if base_peak <= budget:
        return uniform["none"]
    fitting = [k for k in POLICIES if costing.cost(uniform[k])[0] <= budget]
    if not fitting:
        best = min(POLICIES, key=lambda k: costing.cost(uniform[k])[0])
        smallest = costing.cost(uniform[best])[0]
        raise RecomputeError(
            f"no recompute plan fits the memory budget of {budget / 2**20:.1f} MiB per device: "
            f"the smallest predicted peak is {smallest / 2**20:.1f} MiB "
            f"(recompute={best!r} in every layer); "
            f"give at least that much memory (the cluster's device.memory_bytes), or shard "
            f"more (Layout.zero, tp, pp)")
    options = {}
    for layer in layers:
        for k in POLICIES:
            _, saved, seconds = costing.cost({layer: k})
            options[layer, k] = (base_saved - saved, seconds)
    need = base_peak - budget
    for _ in range(_MAX_ROUNDS):
        choice = _knapsack(layers, options, need)
        if choice is None:
            break
        peak = costing.cost(choice)[0]
        if peak <= budget:
            return choice
        need += peak - budget
    return min((uniform[k] for k in fitting), key=lambda c: costing.cost(c)[2])


def _knapsack(layers: list, options: dict, need: int) -> dict | None:
    """The fastest policy per layer that frees at least `need` bytes (None: none does)."""
    h = new_model()
    x = {key: h.addBinary(obj=float(seconds)) for key, (_, seconds) in options.items()}
    for layer in layers:
        h.addConstr(sum(x[layer, k] for k in POLICIES) == 1)
    h.addConstr(sum(float(freed) * x[key] for key, (freed, _) in options.items()) >= float(need))
    h.minimize()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return {layer: max(POLICIES, key=lambda k: h.val(x[layer, k])) for layer in layers}
