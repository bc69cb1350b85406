"""autopar.plan: choose the layout of a model on a cluster (search.py), with the
facts the report shows (details): the chosen layout's predicted timeline per rank,
its tensor-parallel placements, the cost of each layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopar.cluster import ClusterSpec
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import repeated_block_container
from autopar.compiler.ir.trace import LossFn, batch_dims_of
from autopar.compiler.passes.assign_stages import node_time
from autopar.compiler.planner.cost_model import DEFAULT_EFFICIENCY, Efficiency
from autopar.compiler.planner.estimate import Estimator
from autopar.compiler.planner.memory import static_lower_bound
from autopar.compiler.planner.pipeline_cost import pipeline_time
from autopar.compiler.planner.search import (PlanError, candidate_layouts, check_constraints,
                                             refinements, search)
from autopar.compiler.planner.summary import DTYPE_NAMES
from autopar.layout import Layout, Plan

# how many times the nodes a model that fits nowhere is tried on, to name a cluster
LARGER_CLUSTERS = (2, 4, 8)


def plan(model: torch.nn.Module, cluster: ClusterSpec, example_inputs: Sequence[torch.Tensor],
         loss_fn: LossFn | None = None, optimizer: str = "adamw",
         efficiency: Efficiency = DEFAULT_EFFICIENCY,
         progress: Callable[[int, int, Layout], None] | None = None,
         trace_blocks: int | None = None, **constraints: Any) -> Plan:
    """The fastest layout of `model` on `cluster` that fits memory, and every other one
    with why not. Constraints fix Layout fields (tp=2, amp="bf16") or set
    max_memory_fraction (default 0.9). `progress(done, total, layout)` is called
    before each candidate is costed. `trace_blocks=k` traces k of the model's repeated
    blocks (one per stage for a pipeline) and scales their costs to the whole stack
    (planner/scaled.py): faster for deep models, approximate."""
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"cluster must be an autopar.ClusterSpec, got {type(cluster).__name__}")
    fixed, fraction = check_constraints(constraints)
    example_inputs = tuple(example_inputs)
    estimator = Estimator(model, cluster, example_inputs, loss_fn, optimizer, efficiency,
                          trace_blocks=trace_blocks)
    candidates = _candidates(model, cluster, example_inputs, fixed)
    start = time.perf_counter()
    costed, pruned = prune_static(candidates, model, cluster, fraction, optimizer)
    step = None if progress is None else _counter(progress, len(costed))
    bound = compute_bound(estimator, costed, efficiency) if costed else None
    try:
        result = search(costed, estimator.predict, cluster, fraction, step, refinements(fixed),
                        bound)
        result.skipped += pruned
    except PlanError as exc:
        if pruned:  # the error names the smallest peak: it may be a pruned layout's
            floor = _static_bound(model, optimizer)
            try:
                search(costed + sorted((lay for lay, _ in pruned), key=floor), estimator.predict,
                       cluster, fraction, None, refinements(fixed), memory_bound=floor)
            except PlanError as again:
                exc = again
        hint = _larger_cluster_hint(model, cluster, example_inputs, loss_fn, optimizer,
                                    efficiency, trace_blocks, constraints)
        raise PlanError(f"{exc}{hint}") from None
    result.details = details(estimator, result.layout, cluster, efficiency, optimizer)
    bounded = sum(why.startswith("not costed") for _, why in result.skipped)
    result.details["search"] = {"candidates": len(candidates), "pruned": len(pruned),
                                "bounded": bounded, "costed": len(result.alternatives) + 1,
                                **estimator.counts(),
                                "seconds": time.perf_counter() - start}
    return result


# model FLOPs of the global batch are measured on one micro-batch size and used for all:
# the few ops whose count does not scale with the batch (the loss's mean) get this margin
BOUND_MARGIN = 0.99


def compute_bound(estimator: Estimator, candidates: list[Layout], eff: Efficiency
                  ) -> Callable[[Layout], float]:
    """`bound(layout)`: seconds below any predicted step of `layout`. Each rank computes at
    least its 1/world share of the step's model FLOPs, and no op runs faster than at the
    highest peak among the dtypes it can compute in (fp32, the parameters' and buffers',
    the layout's AMP dtype) times the compute efficiency and the smallest fitted op factor
    below 1 (cost_model.kernel_time)."""
    cluster, model = estimator.cluster, estimator.model
    try:
        total = estimator.step_model_flops(candidates[0]) * BOUND_MARGIN
    except ValueError:  # the model does not trace: the search reports it for every layout
        total = 0.0
    dtypes = {"fp32"} | {DTYPE_NAMES.get(t.dtype) for t in (*model.parameters(), *model.buffers())
                         if t.is_floating_point()}
    factor = min([1.0, *cluster.device.op_time_factors.values()])
    listed = cluster.device.peak_flops

    def bound(layout: Layout) -> float:
        peaks = [listed[d] for d in dtypes | {layout.amp} if d in listed]
        if not peaks or not total:
            return 0.0
        return total / cluster.world_size / (max(peaks) * eff.compute) * factor

    return bound


def prune_static(candidates: list[Layout], model: torch.nn.Module, cluster: ClusterSpec,
                 fraction: float, optimizer: str) -> tuple[list[Layout], list[tuple[Layout, str]]]:
    """(candidates worth tracing, the others with why): a layout whose parameters,
    gradients and optimizer state alone exceed the memory allowed
    (memory.static_lower_bound, from parameter counts: no trace) cannot fit."""
    floor = _static_bound(model, optimizer)
    capacity = cluster.device.memory_bytes * fraction
    keep, pruned = [], []
    for layout in candidates:
        bound = floor(layout)
        if bound > capacity:
            pruned.append((layout, f"does not fit: parameters, gradients and {optimizer} state "
                                   f"alone take at least {bound / 1e9:.3g} GB per device, over "
                                   f"the {capacity / 1e9:.3g} GB allowed (not traced)"))
        else:
            keep.append(layout)
    return keep, pruned


def _static_bound(model: torch.nn.Module, optimizer: str) -> Callable[[Layout], float]:
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return lambda layout: static_lower_bound(param_bytes, layout, optimizer)


def _candidates(model, cluster, example_inputs, fixed) -> list[Layout]:
    blocks = repeated_block_container(model)
    candidates = candidate_layouts(cluster, batch_size(example_inputs),
                                   blocks[1] if blocks else 1, fixed)
    if not candidates:
        raise PlanError(f"no layout of {cluster.world_size} devices satisfies the constraints "
                        f"{fixed} with a global batch of {batch_size(example_inputs)}: dp * "
                        "microbatches must divide the batch, tp must fit in one node "
                        f"({cluster.devices_per_node} devices)")
    return candidates


def _counter(progress, total):
    done = iter(range(total))
    return lambda layout: progress(next(done), total, layout)


def batch_size(example_inputs: tuple) -> int | None:
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    dims = batch_dims_of(tensors)
    return next((x.shape[d] for x, d in zip(tensors, dims) if d is not None), None)


def _larger_cluster_hint(model, cluster, example_inputs, loss_fn, optimizer, efficiency,
                         trace_blocks, constraints) -> str:
    """' The smallest cluster that fits: nodes=N' from planning again on more nodes."""
    for factor in LARGER_CLUSTERS:
        bigger = ClusterSpec.from_dict({**cluster.to_dict(), "nodes": cluster.nodes * factor})
        try:
            found = _plan_only(model, bigger, example_inputs, loss_fn, optimizer, efficiency,
                               trace_blocks, constraints)
        except PlanError:
            continue
        return (f". The smallest cluster of these nodes that fits: nodes={bigger.nodes} "
                f"({bigger.world_size} devices, {found.layout})")
    return f". It fits none of nodes={[cluster.nodes * f for f in LARGER_CLUSTERS]} either"


def _plan_only(model, cluster, example_inputs, loss_fn, optimizer, efficiency, trace_blocks,
               constraints):
    fixed, fraction = check_constraints(constraints)
    estimator = Estimator(model, cluster, example_inputs, loss_fn, optimizer, efficiency,
                          trace_blocks=trace_blocks)
    candidates, _ = prune_static(_candidates(model, cluster, example_inputs, fixed), model,
                                 cluster, fraction, optimizer)
    bound = compute_bound(estimator, candidates, efficiency) if candidates else None
    return search(candidates, estimator.predict, cluster, fraction, refine=refinements(fixed),
                  bound=bound)


# -- what the report shows ------------------------------------------------------------------

def details(estimator: Estimator, layout: Layout, cluster: ClusterSpec, eff: Efficiency,
            optimizer: str) -> dict[str, Any]:
    return {"timeline": timeline(estimator, layout, cluster, eff, optimizer),
            "tp_placements": estimator.tp_placements(layout) if layout.tp > 1 else None,
            "layers": layer_costs(estimator.traced(layout), cluster)}


def timeline(estimator: Estimator, layout: Layout, cluster: ClusterSpec, eff: Efficiency,
             optimizer: str) -> list[dict[str, Any]]:
    """Predicted spans per pipeline rank: the schedule's actions, then gradient sync and
    optimizer; a whole-graph step as compute, exposed communication, optimizer."""
    summary, stages, _ = estimator.rewritten(layout)
    if stages is None:
        pred = estimator.predict(layout)
        parts = [("compute", pred.breakdown["compute"]),
                 ("exposed comm", pred.breakdown["exposed_comm"]),
                 ("optimizer", pred.breakdown["optimizer"])]
        return _sequence(0, 0.0, parts)
    times = pipeline_time(summary, stages, cluster, layout, optimizer, eff)
    events = []
    for rank, spans in enumerate(times.timeline.spans):
        events += [{"rank": rank, "name": str(a), "kind": a.kind, "start": s, "end": e}
                   for a, s, e in spans]
        end = max((e for _, _, e in spans), default=0.0)
        events += _sequence(rank, end, [("grad sync", times.grad_sync_s[rank]),
                                        ("optimizer", times.optimizer_per_rank_s[rank])])
    return events


def _sequence(rank: int, start: float, parts: list[tuple[str, float]]) -> list[dict[str, Any]]:
    out = []
    for name, seconds in parts:
        out.append({"rank": rank, "name": name, "kind": name, "start": start,
                    "end": start + seconds})
        start += seconds
    return out


def layer_costs(tg, cluster: ClusterSpec) -> list[dict[str, Any]]:
    """FLOPs and roofline seconds (forward + backward) of each repeated block and of the
    rest (embeddings, head, loss), on one rank's micro-batch."""
    rows: dict[str, dict[str, Any]] = {}
    for n in tg.call_nodes():
        layer = n.meta.get(M.LAYER)
        name = f"block {layer}" if layer is not None else "outside the blocks"
        row = rows.setdefault(name, {"name": name, "flops": 0, "seconds": 0.0})
        row["flops"] += n.meta.get(M.FLOPS, 0)
        row["seconds"] += node_time(n, cluster)
    return list(rows.values())
