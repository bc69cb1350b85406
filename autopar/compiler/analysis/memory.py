"""The memory model: the predicted peak bytes of one rank's step, by category.

Pure functions of (GraphSummary, Layout, optimizer), like the cost model. The step
runs in three phases, and the peak is the largest of them:

1. what the rank holds across steps ("static"): its parameters (blocks under ZeRO-3
   and tensor parallelism), the dim-0 blocks the optimizer updates under ZeRO-1/2,
   the optimizer states of what it updates, buffers, and the step's input batch;
2. the graph: liveness over the program in the order it runs. A storage is alive
   from the op that creates it to the last op that reads it or a view of it (the
   generated code drops every value after its last use), and a collective's input
   to its wait (the issued collective holds it); gradients and the loss
   stay alive to the end, since the step returns them;
3. the optimizer step: the gradients, plus the temporaries of the update itself
   (torch.optim's for-loop AdamW holds two tensors the size of the parameter it is
   updating: sqrt(v) and its quotient).

Categories at the peak: parameters, buffers, optimizer_states, inputs (static);
gradients (the step's outputs); activations (made by forward and loss ops);
temporaries (made by backward ops, recomputed activations included); comm_buffers
(made by collectives and their packing). It is checked against live storage counted
as the step runs (`autopar.compiler.analysis.live_bytes`; tests/unit/test_memory_model.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from autopar.compiler.analysis.summary import GraphSummary
from autopar.compiler.ir.program import block_nbytes
from autopar.costs import dgc_compressed
from autopar.layout import Layout

STATIC = ("parameters", "buffers", "optimizer_states", "inputs")
CATEGORIES = STATIC + ("gradients", "activations", "temporaries", "comm_buffers")
_ROLE_CATEGORY = {"forward": "activations", "loss": "activations", "backward": "temporaries",
                  "comm": "comm_buffers", "optimizer": "temporaries", "input": "inputs"}


@dataclass(frozen=True)
class OptimizerMemory:
    """What an optimizer holds: `states` bytes per byte it updates, `counter_bytes` per
    updated tensor (Adam's step count), and during its step `temporaries` bytes per
    byte of the largest tensor it updates (it updates one tensor at a time)."""

    states: float
    counter_bytes: int = 0
    temporaries: float = 0.0


# torch.optim on the CPU (for-loop implementations); `profile_optimizer` measures any other.
# The fused kernels (fused=True) make no temporaries.
_DEFAULT = {"adamw": OptimizerMemory(2, 4, 2), "adam": OptimizerMemory(2, 4, 2),
            "sgd-momentum": OptimizerMemory(1), "sgd": OptimizerMemory(0)}
OPTIMIZERS = {**_DEFAULT, **{f"{kind}-fused": dataclasses.replace(m, temporaries=0.0)
                             for kind, m in _DEFAULT.items()}}


def optimizer_memory(optimizer: str | OptimizerMemory) -> OptimizerMemory:
    if isinstance(optimizer, OptimizerMemory):
        return optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer kind {optimizer!r}; expected one of "
                         f"{', '.join(OPTIMIZERS)} or an OptimizerMemory")
    return OPTIMIZERS[optimizer]


def profile_optimizer(factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                      numel: int = 4096) -> OptimizerMemory:
    """Measure an optimizer factory's memory on a dummy parameter (two steps: the first
    creates the state, the second shows the temporaries of a steady step)."""
    from autopar.compiler.analysis.live_bytes import LiveBytes, held_bytes

    param = torch.nn.Parameter(torch.zeros(numel))
    opt = factory([param])
    param.grad = torch.ones(numel)
    opt.step()
    with LiveBytes() as live:
        opt.step()
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    big = [t for t in states if t.numel() == numel]
    small = held_bytes([t for t in states if t.numel() != numel])
    nbytes = param.nbytes
    return OptimizerMemory(held_bytes(big) / nbytes, small, live.peak_bytes / nbytes)


WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # Layout.grad_comm_dtype -> bytes per element


def static_lower_bound(param_bytes: int, layout: Layout,
                       optimizer: str | OptimizerMemory = "adamw",
                       bucketed: Sequence[tuple[tuple[int, ...], int]] = ()) -> float:
    """Bytes of parameters, gradients and optimizer state the fullest rank holds at least
    under `layout`, from the model's trainable parameter bytes alone (no trace): each is
    split at best evenly over tp and pp (the fullest stage holds at least its share),
    and over dp where ZeRO shards it (parameters only without a pipeline: a pipelined
    ZeRO-3 step gathers its stages' parameters for the whole schedule). step_memory's
    peak is never below it: the optimizer phase holds all three.

    `bucketed`: (shape, itemsize) of each gradient a whole-graph data-parallel step
    (no pipeline, no micro-batches, dp > 1) sums in buckets (passes/insert_allreduce.py:
    every trainable parameter's but an embedding table's, whose rows may be gathered
    instead). An all-reduced bucket waits for its collective just before the graph
    returns, and until then the collective holds its input: the bucket, in
    Layout.grad_comm_dtype when set, at least the smallest tensor-parallel piece of each
    gradient (tp_piece_bytes). So do ZeRO-2/3's reduce-scattered buckets without
    overlap_comm (with it, each is waited for two buckets later: no bound from them):
    the whole gradient, not its 1/dp block, beside the parameters and optimizer state."""
    share = param_bytes / (layout.tp * layout.pp)
    dp = layout.dp
    params = share / dp if layout.zero >= 3 and layout.pp == 1 else share
    states = optimizer_memory(optimizer).states * (share / dp if layout.zero >= 1 else share)
    held = share * held_per_byte(layout, optimizer)
    at_output = layout.zero < 2 or not layout.overlap_comm  # where the buckets are waited for
    if bucketed and dp > 1 and layout.pp == layout.microbatches == 1 and at_output:
        wire = WIRE_BYTES.get(layout.grad_comm_dtype)
        buckets = sum(tp_piece_bytes(shape, wire or itemsize, layout.tp) * count
                      for (shape, itemsize), count in Counter(bucketed).items())
        held = max(held, params + states + buckets)
    return held


def held_per_byte(layout: Layout, optimizer: str | OptimizerMemory = "adamw") -> float:
    """Bytes of parameters, gradients and optimizer state a rank holds per byte of the
    parameters it runs, as static_lower_bound splits them over dp under ZeRO."""
    dp = layout.dp
    params = 1 / dp if layout.zero >= 3 and layout.pp == 1 else 1.0
    grads = 1 / dp if layout.zero >= 2 else 1.0
    states = optimizer_memory(optimizer).states * (1 / dp if layout.zero >= 1 else 1.0)
    return params + grads + states


def tp_piece_bytes(shape: tuple[int, ...], itemsize: int, tp: int) -> float:
    """Bytes below a rank's piece of a tensor of `shape` under tensor parallelism: whole,
    or cut in tp along one dim d, keeping at least d // tp of its d rows."""
    return math.prod(shape) * min([1.0, *((d // tp) / d for d in shape if d)]) * itemsize


@dataclass(frozen=True)
class GraphLiveness:
    """Liveness of one program: its peak (bytes made by the program), the op where it
    falls, the bytes alive there by category, and forward storage still alive when
    the first backward op runs (the activations saved for the backward)."""

    peak_bytes: int
    peak_op: str
    at_peak: dict[str, int]
    saved_bytes: int
    outputs_bytes: int  # alive when the program ends (what it returns)


def graph_liveness(summary: GraphSummary, regions_inline: bool = False,
                   dying_inputs: Mapping[str, str] | None = None) -> GraphLiveness:
    """Walk the ops in order, adding each new storage and dropping it after its last use.
    `regions_inline`: fused regions run as their ops inline (a CPU, where no kernel runs:
    codegen/kernels.py's run rule), so a region's values come and go op by op inside it
    and an input it reads last is freed after the op that reads it last
    (`OpRecord.inline`); otherwise a region is one kernel. Inputs are held outside the
    program, except `dying_inputs` (input op name -> category): the caller gave them up
    (a pipeline stage's boxed call), so they count from the start in that category, or
    as gradients where the program returns them, and are freed after their last use."""
    ops = summary.ops
    last_use = last_uses(summary)
    freed_after: dict[int, list[int]] = {}
    for s, last in last_use.items():
        freed_after.setdefault(last, []).append(s)
    dying_inputs = dying_inputs or {}
    dying = {i: dying_inputs[op.name] for i, op in enumerate(ops)
             if op.role == "input" and op.storage == i and op.allocates
             and op.name in dying_inputs}

    def freeable(s: int) -> bool:
        return bool(ops[s].allocates) and s not in summary.output_storages \
            and (ops[s].role != "input" or s in dying)

    def category(s: int) -> str:
        return dying[s] if s in dying and s not in summary.output_storages \
            else _category(summary, s)

    live = dict.fromkeys(CATEGORIES, 0)
    for s in dying:
        live[category(s)] += ops[s].allocates
    peak, peak_op, at_peak, saved = 0, "", dict(live), None
    for i, op in enumerate(ops):
        if saved is None and op.role == "backward":
            saved = live["activations"]
        if op.allocates and op.storage == i and op.role != "input":  # inputs are static
            live[_category(summary, i)] += op.allocates
        if sum(live.values()) > peak:
            peak, peak_op, at_peak = sum(live.values()), op.name, dict(live)
        if regions_inline and op.inline:
            peak, peak_op, at_peak = _replay_inline(summary, i, live, set(freed_after.get(i, ())),
                                                    freeable, (peak, peak_op, at_peak), category)
        for s in freed_after.get(i, ()):
            if freeable(s):
                live[category(s)] -= ops[s].allocates
    return GraphLiveness(peak, peak_op, at_peak, saved or 0, live["gradients"])


def _replay_inline(summary: GraphSummary, i: int, live: dict[str, int], dying: set[int],
                   freeable, best: tuple[int, str, dict[str, int]], category):
    """The peak (bytes, op, by category) of `best` and of fused region i run op by op on
    top of `live`: its values as OpRecord.inline makes and frees them (the outputs stay:
    the getitems after it count them), and each input storage that dies with the region
    (`dying`) freed after the region's last read of it."""
    ops, op = summary.ops, summary.ops[i]
    last_read: dict[int, int] = {}
    for k, (_, _, reads) in enumerate(op.inline):
        for j in reads:
            s = ops[op.uses[j]].storage
            if s is not None and s in dying and freeable(s):
                last_read[s] = k
    now, made = dict(live), 0
    peak, peak_op, at_peak = best
    for k, (makes, frees, _) in enumerate(op.inline):
        made += makes
        if sum(now.values()) + made > peak:
            peak, peak_op = sum(now.values()) + made, op.name
            at_peak = {**now, "temporaries": now["temporaries"] + made}
        made -= frees
        for s in [s for s, at in last_read.items() if at == k]:
            now[category(s)] -= ops[s].allocates
    return peak, peak_op, at_peak


def last_uses(summary: GraphSummary) -> dict[int, int]:
    """Storage -> the last op that makes or reads it (GraphSummary.reads: a collective's
    hold on its input until its wait included)."""
    last: dict[int, int] = {}
    ops = summary.ops
    for i, op in enumerate(ops):
        for s in [op.storage] + [ops[u].storage for u in summary.reads(i)]:
            if s is not None:
                last[s] = i
    return last


def _category(summary: GraphSummary, index: int) -> str:
    if index in summary.output_storages:
        return "gradients"
    return _ROLE_CATEGORY[summary.ops[index].role]


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted peak bytes of one rank's step; `by_category` sums to `peak_bytes`."""

    peak_bytes: int
    by_category: dict[str, int]
    phase: str  # "graph" or "optimizer": where the peak falls
    peak_op: str
    saved_activation_bytes: int
    static: dict[str, int] = field(default_factory=dict)


def held_parameter_bytes(summary: GraphSummary, layout: Layout) -> tuple[int, list[int]]:
    """Bytes of parameters a rank holds, and the bytes of each tensor its optimizer
    updates: the graph's parameter (a block under ZeRO-3 or tensor parallelism), plus
    under ZeRO-1/2 a separate dim-0 block of ceil(rows / dp) rows of each parameter
    with at least dp rows (the runtime's `updated`)."""
    held, updated = 0, []
    for i, block in enumerate(outside_graph_blocks(summary, layout)):
        nbytes = summary.param_numel[i] * summary.param_itemsize[i]
        held += nbytes + block
        updated.append(block or nbytes)
    return held, updated


def zero_block_bytes(summary: GraphSummary, i: int, layout: Layout) -> int:
    """Bytes of a rank's dim-0 block of parameter i under ZeRO (runtime/shards.zero_block:
    ceil(rows / dp) rows), 0 where it is updated whole (no ZeRO, or fewer rows than dp)."""
    rows = summary.param_rows[i] if summary.param_rows else 0
    if not layout.zero or layout.dp == 1 or rows < layout.dp:
        return 0
    return block_nbytes(rows, summary.param_numel[i] * summary.param_itemsize[i], layout.dp)


def outside_graph_blocks(summary: GraphSummary, layout: Layout) -> list[int]:
    """Per parameter, the bytes of the block the runtime updates beside the graph's
    parameter under ZeRO (zero_block_bytes, unless ZeRO-3 shards it in the graph), and
    gathers back after the optimizer step; 0 for the others."""
    return [0 if summary.param_blocks and summary.param_blocks[i] > 1
            else zero_block_bytes(summary, i, layout) for i in range(len(summary.param_numel))]


def step_memory(summary: GraphSummary, layout: Layout,
                optimizer: str | OptimizerMemory = "adamw",
                regions_inline: bool = False) -> MemoryPrediction:
    """The predicted peak of one rank's (non-pipelined) step under `layout`;
    `regions_inline` as for graph_liveness (True on a CPU device)."""
    opt = optimizer_memory(optimizer)
    params, updated = held_parameter_bytes(summary, layout)
    inputs = sum(op.allocates for op in summary.ops if op.role == "input")
    static = {"parameters": params, "buffers": summary.buffer_bytes,
              "optimizer_states": int(opt.states * sum(updated) + opt.counter_bytes * len(updated)),
              "inputs": inputs}
    if layout.dgc is not None:  # DGC holds u and v of each tensor it compresses (runtime/dgc.py)
        copies = summary.param_copies or (1,) * len(summary.param_numel)
        compressed = sum(n * size for n, size, k in zip(summary.param_numel,
                                                        summary.param_itemsize, copies)
                         if dgc_compressed(n // k, size))
        static["optimizer_states"] += int((2 - opt.states) * compressed)
    graph = graph_liveness(summary, regions_inline)
    in_graph = graph.at_peak
    in_graph_total = graph.peak_bytes
    optim_temps = int(opt.temporaries * max(updated, default=0))
    if graph.outputs_bytes + optim_temps > in_graph_total:
        phase, dynamic, peak_op = "optimizer", dict.fromkeys(CATEGORIES, 0), "optimizer.step"
        dynamic.update(gradients=graph.outputs_bytes, temporaries=optim_temps)
    else:
        phase, dynamic, peak_op = "graph", in_graph, graph.peak_op
    by_category = {c: static.get(c, 0) + dynamic.get(c, 0) for c in CATEGORIES}
    return MemoryPrediction(sum(by_category.values()), by_category, phase, peak_op,
                            graph.saved_bytes, static)
