"""GraphSummary: what the cost model needs from a TrainGraph, as plain data.

The cost model (cost_model.py) reads only this summary, never FX nodes, so it can
be tested on hand-made summaries and stays a pure function of (summary, cluster,
layout). One `OpRecord` per op in execution order (the graph's node order, which is
the order the runtime runs it), plus the user inputs, which occupy memory from the
start of the step.

Storage, not tensors, is what occupies memory: a view (`is_view` in the op's
schema) and a `wait_tensor` (it returns the very tensor its collective produced) own
no storage; they point at the op that does. Each output of a multi-output op that a
`getitem` takes is its own storage, owned by that getitem (a layer norm's backward
returns an activation-sized input gradient that dies soon and a weight gradient the
step returns); the op owns the outputs nobody takes.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec
from autopar.compiler.ir import comm_ops
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import executed_flops, op_name, tensor_bytes
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.program import MESH_TAG_PREFIX
from autopar.costs import op_time

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# collective op -> (kind for collective_time, index of its group-name argument)
COLLECTIVES = {
    c10d.all_reduce.default: ("all_reduce", 2),
    c10d.all_gather_into_tensor.default: ("all_gather", 2),
    c10d.reduce_scatter_tensor.default: ("reduce_scatter", 3),
    c10d.broadcast.default: ("broadcast", 2),
    comm_ops.reduce: ("reduce", 2),
}
# NOTE: `_unsafe_view` has no alias annotation in its schema, yet eager returns a view
# of its input (it follows ops whose result is already fresh); counting it would
# double the bytes of every reshaped matmul output.
_ALIASING = {c10d.wait_tensor.default, aten._unsafe_view.default, operator.getitem}

DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16",
               torch.float16: "fp16", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8",
               torch.int8: "int8"}


@dataclass(frozen=True)
class OpRecord:
    """One op of the step. `storage` is the index of the record owning the memory its
    output lives in (itself for an op that allocates, None for a view of a parameter
    or buffer); `uses` are the indices of the records it reads. Plain data, no
    __post_init__: `changed` copies records without running __init__ (a check added
    here would have to go there too; tests/unit/test_replicated.py holds both to it)."""

    name: str
    role: str  # autopar.compiler.ir.meta.Role value, or "input" for a user input
    flops: int = 0  # what the kernel computes (attention backward recomputes scores)
    bytes: int = 0  # read + written (0 for views)
    model_flops: int = 0  # flops without recomputation (for MFU)
    dtype: str | None = None  # cluster dtype name of the op's operands ("fp32", "bf16")
    allocates: int = 0  # bytes of new storage the op creates
    storage: int | None = None
    uses: tuple[int, ...] = ()
    collective: str | None = None  # "all_reduce" | "all_gather" | "reduce_scatter"
    comm_bytes: int = 0  # the collective's full tensor: reduced, scattered or gathered
    group: str | None = None  # mesh dimension of the collective ("dp")
    waits_on: int | None = None  # a wait: index of the collective it waits for
    repeat: int = 1  # times the op runs back to back (planner/scaled.py: a block's copies)
    target: str = ""  # the op it runs ("mm"; ir.annotate.op_name), "" for user inputs
    # a fused region: (op, flops, bytes, bytes allocated) of each op its eager fallback
    # runs (on a CPU)
    members: tuple[tuple[str, int, int, int], ...] = ()
    # a fused region whose ops run inline (a CPU): per op, (bytes made, bytes freed after
    # it, positions in `uses` of the inputs it reads last; passes/fuse_regions.inline_timeline)
    inline: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    layer: int | None = None  # the repeated block it belongs to (M.LAYER), None outside


_OP_FIELDS = frozenset(f.name for f in fields(OpRecord))


def changed(op: OpRecord, **values) -> OpRecord:
    """`dataclasses.replace(op, **fields)` without re-running the frozen __init__ (a
    setattr per field): the planner copies hundreds of thousands of records while it
    replicates templates and replays pipeline programs."""
    unknown = values.keys() - _OP_FIELDS
    if unknown:
        raise TypeError(f"OpRecord has no field(s) {sorted(unknown)}")
    out = object.__new__(OpRecord)
    out.__dict__.update(op.__dict__)
    out.__dict__.update(values)
    return out


@dataclass(frozen=True)
class GraphSummary:
    """One rank's step: ops in order, parameter sizes, and which storages the step
    returns (loss, gradients, new buffers: counted by the memory model apart from
    activations)."""

    ops: tuple[OpRecord, ...]
    param_numel: tuple[int, ...]  # per parameter tensor
    param_itemsize: tuple[int, ...]
    buffer_bytes: int
    output_storages: frozenset[int]
    # per parameter: dim-0 size of the graph's tensor (0 for a scalar), and into how many
    # dim-0 blocks ZeRO-3 cut it (the graph then takes one block); empty: unknown / whole
    param_rows: tuple[int, ...] = ()
    param_blocks: tuple[int, ...] = ()
    # per parameter: how many of the model's parameters it stands for (a scaled
    # summary's block parameters, planner/scaled.py: each of its m_b copies is gathered
    # on its own); empty: one each
    param_copies: tuple[int, ...] = ()

    def reads(self, i: int) -> tuple[int, ...]:
        """The ops whose storage op i keeps alive: its inputs and, for a wait, its
        collective's (an issued collective holds its input until waited for)."""
        op = self.ops[i]
        return op.uses if op.waits_on is None else op.uses + self.ops[op.waits_on].uses

    @property
    def param_bytes(self) -> int:
        return sum(n * s for n, s in zip(self.param_numel, self.param_itemsize))

    @property
    def flops(self) -> int:
        """FLOPs the step's kernels perform: each op's as often as it runs (`repeat`: the
        copies of a block a scaled trace stands for), as the cost model times them."""
        return sum(op.flops * op.repeat for op in self.ops)

    @property
    def model_flops(self) -> int:
        return sum(op.model_flops for op in self.ops)

    def compute_dtype(self, copies: Sequence[int] | None = None) -> str:
        """The dtype that carries most FLOPs (fp32 when nothing has FLOPs); `copies`: per
        op, how many times it counts (StageSummary.op_copies of a replica with one stage
        of each kind)."""
        by_dtype: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            if op.flops and op.dtype:
                weight = copies[i] if copies is not None else 1
                by_dtype[op.dtype] = by_dtype.get(op.dtype, 0) + op.flops * op.repeat * weight
        return max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "fp32"


def summarize(tg: TrainGraph) -> GraphSummary:
    """The summary of a (possibly rewritten) TrainGraph."""
    n_state = len(tg.signature.params) + len(tg.signature.buffers)
    index: dict[fx.Node, int] = {}
    ops: list[OpRecord] = []
    for node in tg.placeholders()[n_state:]:
        index[node] = len(ops)
        size = tensor_bytes(node.meta.get(M.VAL))
        ops.append(OpRecord(node.name, "input", allocates=size, storage=len(ops)))
    for node in tg.call_nodes():
        index[node] = len(ops)
        ops.append(_record(node, index, ops))
    outputs = frozenset(ops[index[n]].storage for n in tg.outputs()
                        if n in index and ops[index[n]].storage is not None)
    params = tg.signature.params
    return GraphSummary(ops=tuple(ops), param_numel=tuple(p.numel for p in params),
                        param_itemsize=tuple(p.dtype.itemsize for p in params),
                        buffer_bytes=sum(b.nbytes for b in tg.signature.buffers),
                        output_storages=outputs,
                        param_rows=tuple(p.shape[0] if p.shape else 0 for p in params),
                        param_blocks=tuple(tg.signature.param_blocks))


def summarize_program(gm: fx.GraphModule,
                      owned: Mapping[str, tuple[str, int]] | None = None) -> GraphSummary:
    """The summary of one program of a pipelined step (a stage's forward or backward):
    its inputs are held by the runtime, so they own no storage here, except the
    placeholders in `owned` (inputs the runtime gives up to the program:
    PipelineProgram.dying_inputs), recorded as "input" ops: name -> (the placeholder
    owning the storage, its bytes), a placeholder that views an earlier one's storage
    naming that one (with 0 bytes)."""
    index: dict[fx.Node, int] = {}
    by_name: dict[str, int] = {}
    ops: list[OpRecord] = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in (owned or {}):
            owner, size = owned[node.name]
            index[node] = by_name[node.name] = len(ops)
            ops.append(OpRecord(node.name, "input", allocates=size, storage=by_name[owner]))
        elif node.op == "call_function":
            index[node] = len(ops)
            ops.append(_record(node, index, ops))
    returned = [a for a in gm.graph.output_node().all_input_nodes if a in index]
    outputs = frozenset(ops[index[n]].storage for n in returned
                        if ops[index[n]].storage is not None)
    return GraphSummary(ops=tuple(ops), param_numel=(), param_itemsize=(), buffer_bytes=0,
                        output_storages=outputs)


def _record(node: fx.Node, index: dict[fx.Node, int], earlier: list[OpRecord]) -> OpRecord:
    uses = tuple(index[a] for a in node.all_input_nodes if a in index)
    first = node.all_input_nodes[0] if node.all_input_nodes else None
    aliases = node.target in _ALIASING or (isinstance(node.target, torch._ops.OpOverload)
                                          and node.target.is_view)
    kind, group_arg = COLLECTIVES.get(node.target, (None, None))
    flops = node.meta.get(M.FLOPS, 0)
    record = OpRecord(
        name=node.name, role=node.meta[M.ROLE].value, flops=executed_flops(node),
        target=op_name(node),
        members=tuple(node.meta.get(M.FUSED_MEMBERS, ())),
        inline=_inline(node, index),
        model_flops=0 if node.meta.get(M.RECOMPUTED) else flops - attention_recompute_flops(node),
        bytes=node.meta.get(M.BYTES, 0), dtype=_dtype_of(node), uses=uses,
        collective=kind, comm_bytes=_comm_bytes(node, kind),
        group=_mesh_dim(node.args[group_arg]) if kind else None, layer=node.meta.get(M.LAYER))
    if node.target is operator.getitem and _allocates(earlier, index.get(first)):
        # an output of a multi-output op lives on its own (its siblings may die sooner)
        return replace(record, storage=len(earlier), allocates=tensor_bytes(node.meta.get(M.VAL)))
    if aliases:
        # a view of a parameter, buffer or constant owns nothing we count
        owner = index.get(first)
        storage = None if owner is None else earlier[owner].storage
        waits = storage if node.target == c10d.wait_tensor.default else None
        return replace(record, storage=storage, waits_on=waits)
    taken = {u.args[1]: tensor_bytes(u.meta.get(M.VAL)) for u in node.users
             if u.target is operator.getitem}  # owned by those getitems
    return replace(record, storage=len(earlier),
                   allocates=tensor_bytes(node.meta.get(M.VAL)) - sum(taken.values()))


def _inline(node: fx.Node, index: dict[fx.Node, int]) -> tuple:
    """A fused region's inline timeline with its inputs' positions in the region's input
    list (M.FUSED_INLINE) turned into positions in the record's `uses` (inputs outside
    the summary, parameters, drop out: the model never frees them)."""
    timeline = node.meta.get(M.FUSED_INLINE, ())
    if not timeline:
        return ()
    inputs = node.args[1]
    at = {a: j for j, a in enumerate(a for a in node.all_input_nodes if a in index)}
    return tuple((made, freed, tuple(at[inputs[p]] for p in reads if inputs[p] in at))
                 for made, freed, reads in timeline)


def _allocates(earlier: list[OpRecord], i: int | None) -> bool:
    return i is not None and earlier[i].storage == i


# SDPA backward kernels whose torch.utils.flop_counter count (sdpa_backward_flop_count)
# includes recomputing the scores q @ k^T; all take (grad_out, query, key, value, ...)
_ATTENTION_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
}


def attention_recompute_flops(node: fx.Node) -> int:
    """FLOPs an attention backward spends recomputing q @ k^T: not model FLOPs, so
    that MFU follows the usual count (attention backward = 2x its forward)."""
    if node.target not in _ATTENTION_BACKWARD:
        return 0
    query, key = node.args[1].meta[M.VAL], node.args[2].meta[M.VAL]
    batch, heads, s_q, d = query.shape
    return 2 * batch * heads * s_q * d * key.shape[2]


def _mesh_dim(tag) -> str | None:
    return tag[len(MESH_TAG_PREFIX):] if isinstance(tag, str) and tag.startswith(MESH_TAG_PREFIX) \
        else None


def _comm_bytes(node: fx.Node, kind: str | None) -> int:
    """The full tensor a collective moves (cost_model.collective_time's `nbytes`): a
    reduce-scatter's input, whose output is one rank's block of it; the others' output."""
    if kind is None:
        return 0
    return tensor_bytes((node.args[0] if kind == "reduce_scatter" else node).meta.get(M.VAL))


def _dtype_of(node: fx.Node) -> str | None:
    """The dtype an op computes in: its first floating-point operand's (a matmul's inputs)."""
    for arg in node.all_input_nodes:
        val = arg.meta.get(M.VAL)
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            return DTYPE_NAMES.get(val.dtype)
    val = node.meta.get(M.VAL)
    return DTYPE_NAMES.get(val.dtype) if isinstance(val, torch.Tensor) else None


def node_time(node: fx.Node, cluster: ClusterSpec) -> float:
    """The roofline time of one node at the device's fp32 peak: the cost stage balancing
    and the planner's per-block tables weigh nodes by."""
    device = cluster.device
    peak = device.peak_flops.get("fp32", max(device.peak_flops.values()))
    return op_time(node.meta.get(M.FLOPS, 0), node.meta.get(M.BYTES, 0), peak,
                   device.memory_bandwidth)
