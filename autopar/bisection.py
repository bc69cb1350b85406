"""autopar.bisect: the first node where a compiled parallel step departs from the
single-process step, with its module, source line, the pass that made it, and the ranks.

    on every rank of a launched job:  report = autopar.bisect(model, batch, loss_fn,
                                                              layout=Layout(tp=2))
    from the shell:                   autopar bisect gpt2 --tp 2

How it decides (docs/equivalence.md has the user's view):

1. The reference (on rank 0) is the model's joint graph traced on the whole global
   batch, without passes, run twice: in fp32 as traced, and in float64 (`_Float64`:
   every floating value and dtype argument promoted). The float64 run is taken as the
   exact value; the fp32 run's distance from it is the rounding expected at that node.
2. Every rank builds the layout's step, with each pass marking what it rewrote
   (M.REWRITTEN_BY), and runs its graph once on its slice of the same batch, recording
   every value; rank 0 gathers them. A pipeline runs its schedule once, each stage
   program's values recorded per micro-batch; the micro-batches are then one more
   dimension to combine over (`_Programs`).
3. Each rank node is matched to the reference node it computes: by name where the step
   kept the trace's names (a fused region's outputs carry the name they replaced,
   M.COMPUTES; a recomputed copy the forward node it recomputes, M.RECOMPUTED); where a
   forward-level pass re-traced the step (tensor parallelism, AMP), by grouping both
   graphs' ops by the exported op they were traced from and pairing the groups that run
   the same ops (`_align`). Graph inputs match by name and graph outputs by position.
4. The ranks' values of a node are combined per mesh dimension as replicated (every
   rank holds it), split along a tensor dim (concatenated; ZeRO's padded blocks
   trimmed), or a partial sum or mean (a rank's loss over its shard of a fixed-size
   batch is a mean; only where an input is not replicated on that dimension,
   and never for a value the step returns). The combination closest to the float64 value is
   the node's placement; its error is max |value - exact| / max |exact|.
5. The first node in program order whose error exceeds `rounding` times the fp32
   reference's own error, plus 1e-6, has diverged. Between the last agreeing values and
   it, the nodes that have no reference (a pass's own ops) are the suspects: the first
   one a pass created that changes values, else the last one a pass rewired, else the
   node itself, is named as the cause.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.utils._pytree import tree_map

from autopar.api import build_step
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.batch import Batch, LossFn, Objective
from autopar.compiler.ir.pieces import join_blocks, rank_major
from autopar.compiler.ir.program import MESH_TAG_PREFIX, mesh_group_tag
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.passes.defaults import run_passes
from autopar.layout import Layout
from autopar.runtime.executor import DistributedStep
from autopar.runtime.pipeline import PipelineStep

aten = torch.ops.aten

# how many times the fp32 reference's own rounding error a parallel value may be off,
# and the relative floor (a node whose fp32 value happens to be exact)
ROUNDING = 16.0
FLOOR = 1e-6

# ops that draw random numbers: their values differ between any two programs
_RANDOM = {"native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like",
           "randint", "randint_like", "randperm", "normal", "uniform", "exponential"}

# ops that move or regroup values without changing them: a pass's own such nodes
# (bucket packing, collectives, views) are not blamed before one that computes
_MOVES = {"view", "_unsafe_view", "reshape", "expand", "permute", "t", "transpose",
          "squeeze", "unsqueeze", "flatten", "unflatten", "slice", "select", "narrow",
          "split", "split_with_sizes", "chunk", "cat", "stack", "clone", "contiguous",
          "alias", "_to_copy", "copy", "copy_", "detach", "as_strided", "getitem",
          "all_reduce", "wait_tensor", "all_gather_into_tensor", "reduce_scatter_tensor",
          "broadcast", "constant_pad_nd", "new_zeros", "zeros", "empty", "full",
          "scalar_tensor", "index_select", "slice_scatter", "select_scatter"}


# who made a value a pipeline stage takes from another stage
RECEIVED = "pipeline runtime (received from the stage that computes it)"


class BisectError(ValueError):
    """autopar.bisect cannot compare this model or layout (says what to change)."""


@dataclass(frozen=True)
class Divergence:
    """The first node whose parallel value departs from the single-process value."""

    node: str  # the rank program's node
    op: str
    reference: str  # the reference node it computes
    module: str | None
    source: str | None  # "file.py:123" of the user's code
    pass_name: str  # the pass that created or last rewrote the node ("tracing": neither)
    placement: str  # how the ranks' values were combined, per mesh dimension
    error: float  # max |parallel - exact| / max |exact|
    allowed: float  # the rounding allowed at this node (same units)
    ranks: tuple[int, ...]  # the ranks whose values differ (a partial sum or mean: its group)
    cause: str  # the node named as the likely cause (this node, or a suspect before it)
    cause_pass: str
    cause_op: str
    suspects: tuple[tuple[str, str, str], ...] = ()  # (node, op, pass) between agreement and it
    program: str = "step"  # which program: "step", or a pipeline's "stage 1 forward", ...
    microbatches: tuple[int, ...] = ()  # a pipeline's micro-batches whose values differ

    def __str__(self) -> str:
        where = f"{self.module or '(no module)'}" + (f" at {self.source}" if self.source else "")
        if self.program != "step":
            where += f", {self.program}, micro-batches {list(self.microbatches)}"
        text = (f"first divergence at node {self.node} ({self.op}, the reference's "
                f"{self.reference}) in {where}: error {self.error:.3g} of its magnitude, "
                f"rounding allows {self.allowed:.3g}; placement {self.placement}; ranks "
                f"{list(self.ranks)}; made by pass {self.pass_name!r}")
        if self.cause != self.node:
            chain = ", ".join(f"{n} ({op}, {p})" for n, op, p in self.suspects[:8])
            chain += f" and {len(self.suspects) - 8} more" if len(self.suspects) > 8 else ""
            text += (f". Likely cause: node {self.cause} ({self.cause_op}) of pass "
                     f"{self.cause_pass!r}, among the nodes without a reference value since "
                     f"the last agreeing ones: {chain}")
        return text


@dataclass
class BisectReport:
    layout: Layout
    compared: int  # nodes compared (matched to the reference) up to the first divergence
    nodes: int  # nodes of the rank's programs walked up to there (all of them if none)
    first: Divergence | None
    closest_call: float = 0.0  # the largest error / allowed among the agreeing nodes

    @property
    def ok(self) -> bool:
        return self.first is None

    def __str__(self) -> str:
        head = (f"{self.layout}: compared {self.compared} of the program's {self.nodes} nodes "
                f"with the single-process step")
        if self.first is None:
            return (f"{head}; no divergence (the closest node used {self.closest_call:.0%} of "
                    f"its rounding allowance)")
        return f"{head}; {self.first}"


def bisect(model: torch.nn.Module, example_inputs: Batch, loss_fn: LossFn | None = None,
           layout: Layout | None = None, *, example_targets: Batch | None = None,
           passes=None, rounding: float = ROUNDING) -> BisectReport:
    """Compare the compiled step of `layout` with the single-process step node by node on
    one batch; on every rank of a launched job (collective), like `autopar.compile`.
    Returns the same BisectReport on every rank. `passes` replaces the default pass list
    (to bisect your own pass). The model must be deterministic (dropout 0): random ops
    draw other numbers in the parallel program."""
    if not isinstance(layout, Layout):
        raise BisectError(f"bisect needs a layout (an autopar.Layout), got {layout!r}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    layout.check_world_size(world)
    objective, flat = Objective.from_example(example_inputs, example_targets, loss_fn)
    if not flat:
        raise BisectError("bisect needs example_inputs: one global batch")
    rank = dist.get_rank() if world > 1 else 0
    if layout.amp == "fp16":
        raise BisectError("bisect compares bf16 AMP against the single-process AMP step, not "
                          "fp16 (its loss scaling skips steps); use amp='bf16' to bisect")
    if rank == 0:
        reference = trace_train_step(model, flat, objective)
        _refuse_random(reference.gm)
        if layout.amp != "off":  # the single-process step under the same casts
            reference, _ = run_passes(reference, Layout(amp=layout.amp, fusion=False))
    step = build_step(copy.deepcopy(model), None, flat, objective,
                      lambda ps: torch.optim.SGD(ps, lr=0.0), layout, passes,
                      record_rewrites=True)
    values = _record(step, flat)
    everyone = [values]
    if world > 1:
        everyone = [None] * world if rank == 0 else None
        dist.gather_object(values, everyone, dst=0)
    report = None
    if rank == 0:
        exact, fp32 = _reference_values(reference, model, flat)
        report = _compare(step, reference, everyone, exact, fp32, layout, rounding)
    if world > 1:
        box = [report]
        dist.broadcast_object_list(box, src=0)
        report = box[0]
    return report


# -- running graphs ------------------------------------------------------------------------

def _record(step, flat: tuple) -> dict[tuple, dict[str, torch.Tensor]]:
    """Every value of this rank's programs on one step, by (stage, program kind,
    micro-batch): (None, None, 0) for the one program of a DistributedStep; a pipeline's
    stage programs as the schedule runs them (the optimizer step after it takes lr 0)."""
    if isinstance(step, DistributedStep):
        return {(None, None, 0): _Recorder(step.gm).record(step.graph_inputs(*flat))}
    records: dict[tuple, dict] = {}

    def run(gm, args, action):
        recorder = _Recorder(gm)
        out = recorder.run(*args)
        records[(action.stage, action.kind, action.microbatch)] = recorder.values
        return out

    step.run_graph = run
    try:
        step(*flat)
    finally:
        step.run_graph = None
    return records


class _Recorder(fx.Interpreter):
    """Runs a graph and keeps a copy of every tensor value, by node name."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, torch.Tensor] = {}

    def record(self, args) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            self.run(*args)
        return self.values

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach().clone()
        return out


class _Float64(_Recorder):
    """The same graph with every floating value and dtype argument in float64."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "placeholder" and isinstance(out, torch.Tensor) and out.is_floating_point():
            out = out.double()
            self.values[n.name] = out
        return out

    def call_function(self, target, args, kwargs):
        args, kwargs = tree_map(_promote, (args, kwargs))
        return super().call_function(target, args, kwargs)


def _promote(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    return x


def _reference_values(reference, model: torch.nn.Module, flat: tuple):
    """The reference graph's values on the global batch: (float64, fp32), by node name."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    sig = reference.signature
    args = [named[p.name].detach() for p in sig.params + sig.buffers] + list(flat)
    return _Float64(reference.gm).record(args), _Recorder(reference.gm).record(args)


def _refuse_random(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function" or _op(node).rstrip("_") not in _RANDOM:
            continue
        if _op(node) == "native_dropout" and (node.args[1] == 0 or node.args[2] is False):
            continue
        where = node.meta.get(M.MODULE_PATH) or "the model"
        raise BisectError(f"{where} draws random numbers ({_op(node)}, node {node.name}, "
                          f"{node.meta.get(M.SOURCE) or 'source unknown'}): the parallel "
                          "program draws other ones, so no value after it can be compared. "
                          "Build the model with dropout 0 (e.g. the config's *_pdrop / "
                          "*dropout fields) to bisect it")


def _op(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "placeholder"
    target = node.target
    if hasattr(target, "_opname"):
        return target._opname
    return getattr(target, "__name__", str(target))


# -- matching rank nodes to reference nodes -----------------------------------------------

def _match(rank_gm: fx.GraphModule, ref_gm: fx.GraphModule, retraced: bool) -> dict[str, str]:
    """Rank node name -> the reference node whose value it holds."""
    ref_nodes = {n.name: n for n in ref_gm.graph.nodes}
    out: dict[str, str] = {}
    traced_name: dict[str, str] = {}  # the name a node had before fusion
    items: list[tuple[str | None, M.Provenance]] = []  # (rank node, what it was traced as)
    for node in rank_gm.graph.nodes:
        if node.op == "placeholder" and node.name in ref_nodes:
            out[node.name] = node.name
        if node.op != "call_function" or node.meta.get(M.RECOMPUTED):
            continue
        traced_name[node.name] = node.meta.get(M.COMPUTES, (node.name,))[0]
        provenance = node.meta.get(M.FUSED_PROVENANCE)
        if provenance is not None:  # a fused region: its ops, the outputs by their getitems
            outputs = {u.meta[M.COMPUTES][0]: u for u in node.users if M.COMPUTES in u.meta}
            items += [(_comparable(outputs.get(p[0])), p) for p in provenance]
            continue
        if M.COMPUTES in node.meta or node.meta.get(M.CREATED_BY) is not None:
            continue  # a fused output (placed with its region) or a pass's own node
        items.append((_comparable(node), M.Provenance(node)))
    if not retraced:
        for name, traced in items:
            ref = ref_nodes.get(traced[0])
            if name is not None and ref is not None and M.op_key(ref) == traced[1]:
                out[name] = traced[0]
    else:
        _align(items, [M.Provenance(n) for n in ref_gm.graph.nodes if n.op == "call_function"],
               out)
    by_traced = {traced_name[n]: ref for n, ref in out.items() if n in traced_name}
    for node in rank_gm.graph.nodes:
        original = node.meta.get(M.RECOMPUTED)
        if original and original in by_traced:
            out[node.name] = by_traced[original]
    return out


def _comparable(node: fx.Node | None) -> str | None:
    """The node's name, or None where it holds no value of the trace: absent (an op fused
    away) or computing something else (a pass changed its op, or the op it takes from)."""
    if node is None or node.meta.get(M.REWRITTEN_BY):
        return None
    if _op(node) == "getitem" and isinstance(node.args[0], fx.Node) and \
            node.args[0].meta.get(M.REWRITTEN_BY):
        return None
    return node.name


def _align(items: list[tuple], ref_items: list, out: dict) -> None:
    """Pairs of a re-traced rank graph's nodes and the reference's. Both graphs are traces
    of the same exported forward, so each op is grouped by the exported op it comes from
    (a backward op by the forward op it differentiates, through autograd's `seq_nr`; a
    fused region's ops as they were before fusion). Where a group runs the reference's
    ops in the same order (the rank's collectives aside), its values pair one to one;
    where a pass lowered the op another way, only the group's last values pair, when
    they are the same op: what the exported op returns."""
    def groups(entries):
        by_seq = {}
        for _, (_, _, origin, backward, seq) in entries:
            if not backward and seq is not None:
                by_seq.setdefault(seq, origin)
        found: dict[tuple, list] = {}
        for name, (_, op, origin, backward, seq) in entries:
            key = ("backward", by_seq.get(seq)) if backward else ("forward", origin)
            found.setdefault(key, []).append((name, op, seq))
        # a fused region's ops stand where the region does, which may be after an op
        # traced later: a forward group is put back in the order autograd recorded its
        # ops (one without a seq_nr stays after the op before it). A backward group keeps
        # the graph's order: its ops carry the seq_nr of the forward op they differentiate.
        for key, members in found.items():
            if key[0] == "forward":
                last, order = -1, []
                for _, _, seq in members:
                    last = seq if seq is not None else last
                    order.append(last)
                members[:] = [m for _, m in sorted(zip(order, members), key=lambda x: x[0])]
        return found

    mine = groups([(name, p) for name, p in items if not p[1].startswith("_c10d_functional")])
    theirs = groups([(p[0], p) for p in ref_items])
    for key, members in mine.items():
        if key[1] is None or key not in theirs:
            continue
        ref_members = theirs[key]
        if [m[1] for m in members] == [m[1] for m in ref_members]:
            pairs = list(zip(members, ref_members))
        elif members[-1][1] == ref_members[-1][1]:
            pairs = [(members[-1], ref_members[-1])]
        else:
            continue
        for (name, _, _), (ref, _, _) in pairs:
            if name is not None:
                out[name] = ref


def _outputs(gm: fx.GraphModule) -> list:
    return list(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0])


# -- placements ----------------------------------------------------------------------------

# the piece counts tried for a tensor-parallel value split in pieces, ("S", dim, pieces):
# q/k/v (3), gate/up (2), four gates of an LSTM-like cell (4)
PIECES = (2, 3, 4)

# replicated, a partial sum, a partial mean (each rank's mean over its shard of a
# fixed-size batch: the shards' average is the whole's), ("S", dim): split along dim
R, P, A = ("R",), ("P",), ("A",)


def _describe(placement: tuple, mesh) -> str:
    words = {"R": "replicated", "P": "partial sum", "A": "partial mean"}
    parts = [f"{dim}: " + (words[p[0]] if p[0] in words else f"split on dim {p[1]}"
                           + (f" in {p[2]} pieces" if len(p) > 2 else ""))
             for (dim, size), p in zip(mesh, placement) if size > 1]
    return ", ".join(parts) or "one rank"


def _coords(rank: int, mesh) -> tuple[int, ...]:
    out = []
    for _, size in reversed(mesh):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def _candidates(local: tuple, ref: tuple, mesh, partial_ok: list[bool],
                unequal: Iterable[tuple[int, ...]] = ()) -> list[tuple]:
    """Placements (one per mesh dim) whose combined shape is the reference's. `unequal`:
    the pieces of unequal sizes the step's parameters are held in (a value computed
    from one, as a fused projection's output, is split in the same pieces)."""
    options = []
    for (name, size), may_sum in zip(mesh, partial_ok):
        if size == 1:
            options.append([R])
            continue
        opts = [R] + [("S", d) for d in range(len(local))] + ([P, A] if may_sum else [])
        if name == "tp":  # a fused projection's q, k and v each split (tp_rules.Strided)
            opts += [("S", d, k) for d in range(len(local)) for k in PIECES if local[d] % k == 0]
            opts += [("S", d, k) for d in range(len(local)) for k in unequal
                     if sum(k) == local[d] * size]
        options.append(opts)
    out = []
    for combo in itertools.product(*options):
        shape = list(local)
        for (_, size), p in zip(mesh, combo):
            if p[0] == "S":
                shape[p[1]] *= size
        if len(shape) == len(ref) and all(s == r or (s > r and s - r < _split(combo, mesh, d))
                                           for d, (s, r) in enumerate(zip(shape, ref))):
            out.append(combo)
    return sorted(out, key=lambda c: [({"R": 0, "S": 1, "P": 2, "A": 3}[p[0]], len(p)) for p in c])


def _split(combo, mesh, dim: int) -> int:
    n = 1
    for (_, size), p in zip(mesh, combo):
        if p[0] == "S" and p[1] == dim:
            n *= size
    return n


def _combine(values: dict[int, torch.Tensor], mesh, combo, ref_shape) -> list[tuple]:
    """[(ranks, value)]: the ranks' values merged over the split and partial dims, in mesh
    order (dp before tp: a ZeRO block lies inside a tensor-parallel block); one entry per
    group of the replicated dims, each compared on its own."""
    groups = {_coords(r, mesh): ((r,), v.double()) for r, v in values.items()}
    for m, ((_, size), p) in enumerate(zip(mesh, combo)):
        if size == 1 or p == R:
            continue
        merged: dict[tuple, list] = {}
        for key, (ranks, v) in groups.items():
            merged.setdefault(key[:m] + (None,) + key[m + 1:], []).append((key[m], ranks, v))
        groups = {}
        for key, parts in merged.items():
            parts.sort(key=lambda t: t[0])
            ranks = tuple(r for _, rs, _ in parts for r in rs)
            if p in (P, A):
                value = sum(v for _, _, v in parts) / (len(parts) if p == A else 1)
            else:
                dim = p[1]
                pieces = p[2] if len(p) > 2 else 1
                value = join_blocks([v for _, _, v in parts], dim, pieces)
                want = -(-ref_shape[dim] // _split(combo[m + 1:], mesh[m + 1:], dim))
                if value.shape[dim] > want:  # ZeRO's padded last block
                    value = value.narrow(dim, 0, want)
            groups[key] = (ranks, value)
    return list(groups.values())


def _ranks_off(values: dict[int, torch.Tensor], mesh, combo, truth: torch.Tensor,
               allowed: float) -> tuple[int, ...]:
    """The ranks whose own value is off from their part of the exact value (replicated
    and split placements; a partial sum or mean is judged only as a whole: empty)."""
    if P in combo or A in combo:
        return ()
    off = []
    for r, v in values.items():
        part, coords = truth, _coords(r, mesh)
        for dim in range(truth.dim()):
            splits = [(coords[m], size) for m, ((_, size), p) in enumerate(zip(mesh, combo))
                      if p[0] == "S" and p[1] == dim]
            if not splits:
                continue
            for (_, size), p in zip(mesh, combo):
                if p[0] == "S" and p[1] == dim and len(p) > 2:
                    # a value in pieces: each rank's part then lies together
                    part = rank_major(part, dim, p[2], size)
            start, stride = 0, v.shape[dim]
            for c, size in splits:  # combined first (dp) is innermost
                start += c * stride
                stride *= size
            length = max(0, min(v.shape[dim], part.shape[dim] - start))
            part = part.narrow(dim, start, length)
            v = v.narrow(dim, 0, length)
        if _error(v, part) > allowed:
            off.append(r)
    return tuple(off)


def _error(value: torch.Tensor, exact: torch.Tensor) -> float:
    """max |value - exact| / max |exact| over the finite elements of `exact`; where it is
    infinite or NaN (a mask's -inf), `value` must be the same; exact integers and bools
    must be equal (1.0 otherwise)."""
    if value.shape != exact.shape:
        return float("inf")
    if not exact.is_floating_point():
        return 0.0 if torch.equal(value.to(exact.dtype), exact) else 1.0
    value = value.double()
    finite = torch.isfinite(exact)
    if not finite.all():
        same = (value == exact) | (value.isnan() & exact.isnan())
        if not bool(same[~finite].all()):
            return float("inf")
        value, exact = value[finite], exact[finite]
    if not exact.numel():
        return 0.0
    scale = exact.abs().max().item()
    diff = (value - exact).abs().max().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


# -- the comparison ------------------------------------------------------------------------

@dataclass
class _Programs:
    """What rank 0 walks: each program of the step in the order it runs, and where the
    values of one of its nodes come from. `mesh` is what they are combined over,
    innermost split first: the ranks' mesh for one program per rank; for a pipeline, the
    micro-batches (inside a data-parallel rank's rows), dp and tp, on the ranks that hold
    the node's stage."""

    mesh: list
    programs: list  # (label, (stage, kind) or (None, None), GraphModule)
    ranks: list  # the ranks' mesh
    microbatches: int = 0  # 0: one program per rank

    def members(self, stage: int | None) -> dict[int, tuple[int, int]]:
        """Index in `mesh` -> (rank, micro-batch) of the values of a node of `stage`."""
        world = 1
        for _, size in self.ranks:
            world *= size
        if not self.microbatches:
            return {r: (r, 0) for r in range(world)}
        sizes = dict(self.ranks)
        out = {}
        for rank in range(world):
            coords = dict(zip(sizes, _coords(rank, self.ranks)))
            if coords["pp"] != stage % sizes["pp"]:
                continue
            for mb in range(self.microbatches):
                index = (mb * sizes["dp"] + coords["dp"]) * sizes.get("tp", 1) + coords.get("tp", 0)
                out[index] = (rank, mb)
        return out

    def values(self, everyone: list[dict], key: tuple, members: dict,
               name: str) -> dict | None:
        """The recorded values of node `name` of program `key` (whose `members`), by
        index in `mesh`."""
        out = {}
        for index, (rank, mb) in members.items():
            record = everyone[rank].get((key[0], key[1], mb))
            if record is None or name not in record:
                return None
            out[index] = record[name]
        return out


def _programs_of(step) -> _Programs:
    if isinstance(step, DistributedStep):
        return _Programs(list(step.program.mesh), [("step", (None, None), step.train_graph.gm)],
                         list(step.program.mesh))
    program = step.program
    sizes = dict(program.mesh)
    mesh = [("microbatch", program.schedule.microbatches), ("dp", sizes["dp"]),
            ("tp", sizes.get("tp", 1))]
    progs = [(f"stage {s.stage} forward", (s.stage, "F"), s.forward) for s in program.stages]
    for s in reversed(program.stages):
        if s.input_grad is not None:
            progs += [(f"stage {s.stage} input-gradient", (s.stage, "I"), s.input_grad[0]),
                      (f"stage {s.stage} weight-gradient", (s.stage, "W"), s.weight_grad[0])]
        else:
            progs.append((f"stage {s.stage} backward", (s.stage, "B"), s.backward))
    return _Programs(mesh, progs, list(program.mesh), program.schedule.microbatches)


def _compare(step, reference, everyone: list[dict], exact: dict, fp32: dict, layout: Layout,
             rounding: float) -> BisectReport:
    rank_tg = step.train_graph
    retraced_by = tuple(rank_tg.attrs.get("retraced_by", ()))
    matched = _match(rank_tg.gm, reference.gm, bool(retraced_by))
    pipelined = isinstance(step, PipelineStep)
    # what the runtime takes as it is: never partial (a pipeline's stage outputs are
    # partial gradients, which the runtime sums)
    returned = set()
    for mine, theirs in zip(_outputs(rank_tg.gm), _outputs(reference.gm)):
        if isinstance(mine, fx.Node) and isinstance(theirs, fx.Node):
            matched.setdefault(mine.name, theirs.name)
            if not pipelined:
                returned.add(mine.name)
    walk = _programs_of(step)
    mesh = walk.mesh
    unequal = {e.shard_pieces for e in step.program.params if isinstance(e.shard_pieces, tuple)}
    placement: dict[str, tuple] = {}
    whole = tuple([R] * len(mesh))
    constants: set[str] = set()
    compared, closest, total = 0, 0.0, 0
    agreed: set[str] = set()
    for label, key, gm in walk.programs:
        members = walk.members(key[0])
        for node in gm.graph.nodes:
            if node.op not in ("placeholder", "call_function"):
                continue
            total += 1
            inputs = [placement.get(a.name, whole) for a in node.all_input_nodes]
            if node.op == "placeholder" and node.name in placement:
                inputs = [placement[node.name]]  # a value an earlier program computed
            spread = [any(p[m] != R for p in inputs) for m in range(len(mesh))]
            ref_name = matched.get(node.name)
            values = walk.values(everyone, key, members, node.name)
            shaped = node.op == "call_function" and \
                all(a.name in constants for a in node.all_input_nodes)
            partial_ok = [s and node.name not in returned for s in spread]
            candidates = [] if ref_name is None or ref_name not in exact or values is None \
                or shaped else _candidates(tuple(next(iter(values.values())).shape),
                                           tuple(exact[ref_name].shape), mesh, partial_ok,
                                           unequal)
            if not candidates:  # no reference, or one no placement gives the shape of
                if shaped:
                    constants.add(node.name)
                if node.op == "call_function" or node.name not in placement:
                    placement[node.name] = _unmatched_placement(node, mesh, spread)
                continue
            truth = exact[ref_name]
            rounding_err = _error(fp32[ref_name], truth) if ref_name in fp32 else 0.0
            allowed = rounding * rounding_err + FLOOR
            best = None
            for combo in candidates:
                groups = _combine(values, mesh, combo, truth.shape)
                errors = [(_error(v, truth), ranks) for ranks, v in groups]
                worst = max(e for e, _ in errors)
                if best is None or worst < best[0]:
                    best = (worst, combo, errors)
                if worst <= allowed:
                    break
            compared += 1
            if best[0] <= allowed:
                placement[node.name] = best[1]
                closest = max(closest, best[0] / allowed)
                agreed.add(node.name)
                continue
            error, combo, errors = best
            off = _ranks_off(values, mesh, combo, truth, allowed) or \
                tuple(sorted(r for e, rs in errors if e > allowed for r in rs))
            ranks = tuple(sorted({members[i][0] for i in off}))
            mbs = tuple(sorted({members[i][1] for i in off})) if pipelined else ()
            first = _divergence(node, ref_name, combo, mesh, error, allowed, ranks,
                                matched, agreed, retraced_by)
            received = node.op == "placeholder" and pipelined and \
                node.name not in step.program.keys
            first = dataclasses.replace(
                first, program=label, microbatches=mbs,
                **({"pass_name": RECEIVED, "cause_pass": RECEIVED} if received else {}))
            return BisectReport(layout, compared, total, first, closest)
    return BisectReport(layout, compared, total, None, closest)


def _unmatched_placement(node: fx.Node, mesh, spread: list[bool]) -> tuple:
    """A node without a reference value: replicated on the dims a collective makes whole
    (an all-reduce or all-gather over it), else as spread as its inputs."""
    group = next((a for a in node.args if isinstance(a, str) and a.startswith(MESH_TAG_PREFIX)),
                 None)
    gathers = _op(node) in ("all_reduce", "all_gather_into_tensor") and group is not None
    out = []
    for (dim, _), s in zip(mesh, spread):
        out.append(R if not s or (gathers and group == mesh_group_tag(dim)) else P)
    return tuple(out)


def _blame(node: fx.Node, retraced_by: tuple) -> str:
    """The pass that created or last changed `node` ("tracing": none)."""
    if node.meta.get(M.REWIRED_BY):
        return node.meta[M.REWIRED_BY]
    if node.meta.get(M.REWRITTEN_BY):
        return node.meta[M.REWRITTEN_BY][-1]
    if node.meta.get(M.CREATED_BY):
        return node.meta[M.CREATED_BY]
    return "tracing" + (f" (re-traced by {', '.join(retraced_by)})" if retraced_by else "")


def _divergence(node: fx.Node, ref_name: str, combo, mesh, error: float, allowed: float,
                ranks: tuple, matched: dict, agreed: set, retraced_by: tuple) -> Divergence:
    suspects = _suspects(node, matched, agreed)
    if node.meta.get(M.CREATED_BY) and _op(node) not in _MOVES:
        cause = node  # a pass's own computing node
    else:
        cause = next((s for s in suspects if s.meta.get(M.CREATED_BY)
                      and _op(s) not in _MOVES), None)
    if cause is None:
        cause = next((s for s in reversed(suspects + [node])
                      if s.meta.get(M.REWIRED_BY) or s.meta.get(M.REWRITTEN_BY)), node)
    return Divergence(
        node=node.name, op=_op(node), reference=ref_name,
        module=node.meta.get(M.MODULE_PATH), source=node.meta.get(M.SOURCE),
        pass_name=_blame(node, retraced_by), placement=_describe(combo, mesh), error=error,
        allowed=allowed, ranks=ranks, cause=cause.name, cause_pass=_blame(cause, retraced_by),
        cause_op=_op(cause),
        suspects=tuple((s.name, _op(s), _blame(s, retraced_by)) for s in suspects))


def _suspects(node: fx.Node, matched: dict, agreed: set) -> list[fx.Node]:
    """The call nodes without a reference value on the paths into `node` from the last
    compared nodes, in program order, less those a compared value that agreed reads
    (directly, or through a getitem): their values were right where they were checked."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function" or n.name in matched:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)

    def cleared(n: fx.Node) -> bool:
        return any(u.name in agreed or (_op(u) == "getitem" and cleared(u)) for u in n.users)

    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted((n for n in seen if not cleared(n)), key=order.__getitem__)
