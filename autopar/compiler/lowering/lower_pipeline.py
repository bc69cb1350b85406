"""Lower a stage-assigned TrainGraph to per-stage forward and backward programs.

Each stage s gets two GraphModules cut out of the joint graph: F_s (its forward
nodes) and B_s (its backward nodes). A value produced by one program and used by
another crosses between them under its joint-graph node name: forward values go to
later stages (sent after F, received before F), backward values to earlier stages
(sent after B, received before B); a forward value a stage's own backward needs
stays on that stage (saved activations). Values are keyed by their node names, so
the runtime wires programs, messages and parameters by name.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.pipeline_program import (
    PipelineProgram,
    StageProgram,
    ValueSpec,
)
from autopar.compiler.ir.program import LOSS_SCALE_INPUT
from autopar.compiler.ir.schedule import build as build_schedule
from autopar.compiler.lowering.lower import _entry
from autopar.compiler.passes.assign_stages import StageError
from autopar.compiler.passes.builder import NodeBuilder, scale_backward_seed
from autopar.compiler.passes.insert_allreduce import gradient_terms
from autopar.compiler.passes.sync_batch_norm import training_batch_norms, where
from autopar.layout import Layout


def _program_of(node: fx.Node) -> tuple[int, str] | None:
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "call_function":
        # with the op it reads: an op's tuple of outputs never crosses programs (nll's
        # total weight, read only by its backward, is taken in the forward)
        return _program_of(node.args[0])
    return node.meta[M.STAGE], ("B" if node.meta[M.ROLE] == M.Role.BACKWARD else "F")


def lower_pipeline(tg: TrainGraph, layout: Layout) -> PipelineProgram:
    """Per-stage programs plus the schedule for `layout` (pp, microbatches, schedule)."""
    norms = training_batch_norms(tg) if layout.microbatches > 1 else []
    if norms:
        raise StageError(f"{where(norms[0])}: a batch norm in training mode normalises by the "
                         f"statistics of the whole batch, and a step of {layout.microbatches} "
                         f"micro-batches computes each micro-batch's before the next exists; "
                         f"use microbatches=1 and pp=1 for this model (dp > 1 computes them "
                         f"over every rank's shard), or put the module in eval mode")
    if tg.signature.mutated_buffers:
        raise StageError(f"pipelining and micro-batching keep one copy of each buffer, but the "
                         f"step updates {list(tg.signature.mutated_buffers)}; use "
                         "microbatches=1 and pp=1 for this model")
    tg = tg.copy()
    divisor = layout.microbatches * layout.dp
    grad_divisor = 1
    if not scale_backward_seed(tg, NodeBuilder(tg.graph, "lower_pipeline"), divisor) and divisor > 1:
        if not _loss_scaled(tg):
            raise StageError("cannot average gradients over micro-batches: the graph has no "
                             "ones_like(loss) seed to scale (was it rewritten by another pass?)")
        # fp16: the backward starts from d(loss * scale); the runtime divides the summed
        # gradients instead (before unscaling them)
        grad_divisor = divisor
    stages = layout.pp * layout.virtual_stages
    for node in tg.call_nodes():
        node.meta.setdefault(M.STAGE, _stage_from_inputs(node))
    grad_parts = _split_shared_gradients(tg)
    members: dict[tuple[int, str], list[fx.Node]] = {(s, k): [] for s in range(stages) for k in "FB"}
    for node in tg.call_nodes():
        members[_program_of(node)].append(node)
    needed_by = _consumers(tg, _program_of)
    programs = [_stage_program(tg, s, members, needed_by) for s in range(stages)]
    if layout.schedule == "zero-bubble":
        _split_backwards(tg, programs, members)
    specs = {n.name: ValueSpec(tuple(n.meta[M.VAL].shape), n.meta[M.VAL].dtype)
             for n in tg.graph.nodes if n.op in ("call_function", "placeholder")
             and hasattr(n.meta.get(M.VAL), "shape")}
    sig = tg.signature
    placeholders = tg.placeholders()
    return PipelineProgram(
        stages=tuple(programs),
        schedule=build_schedule(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages),
        params=tuple(_entry(p) for p in sig.params),
        buffers=tuple(_entry(b) for b in sig.buffers),
        inputs=tuple(_entry(i) for i in sig.inputs),
        batch_dims=sig.batch_dims,
        keys=tuple(n.name for n in placeholders),
        grad_parts=grad_parts,
        loss_key=tg.loss_node().name,
        values=specs,
        # pp outermost, tp innermost (as Megatron-LM and the cost model order them): a
        # node's consecutive ranks hold whole tp groups, then dp neighbours
        mesh=(("pp", layout.pp), ("dp", layout.dp)) + ((("tp", layout.tp),) if layout.tp > 1 else ()),
        grad_divisor=grad_divisor,
        normalizers=tg.loss_normalizers,
        layout=layout.to_dict(),
    )


def _loss_scaled(tg: TrainGraph) -> bool:
    inputs = tg.signature.inputs
    return bool(inputs) and inputs[-1].name == LOSS_SCALE_INPUT


def _split_shared_gradients(tg: TrainGraph) -> tuple[tuple[str, ...], ...]:
    """A weight used on several stages (a tied embedding) gets one partial gradient per
    stage instead of a sum across stages per micro-batch: each stage accumulates its
    own part and the runtime sums the parts once per step. Returns, per parameter, the
    names of the nodes holding its gradient's parts; the graph's outputs become the
    loss followed by all parts."""
    build = NodeBuilder(tg.graph, "lower_pipeline")
    parts_per_param, outputs = [], [tg.loss_node()]
    for grad in tg.grad_nodes():
        terms = gradient_terms(grad)
        stages = sorted({t.meta[M.STAGE] for t in terms})
        if len(stages) == 1:
            parts = [grad]
        else:
            parts = []
            for stage in stages:
                mine = [t for t in terms if t.meta[M.STAGE] == stage]
                part = mine[0]
                for term in mine[1:]:
                    part = build.at(max(part, term, key=_position(tg))).call(
                        torch.ops.aten.add.Tensor, (part, term), role=M.Role.BACKWARD)
                    part.meta[M.STAGE] = stage
                parts.append(part)
        parts_per_param.append(tuple(p.name for p in parts))
        outputs += parts
    tg.output_node().args = (tuple(outputs),)
    tg.graph.eliminate_dead_code()
    return tuple(parts_per_param)


def split_gradient_sums(tg: TrainGraph, stage_of: Callable[[fx.Node], int]) -> set[fx.Node]:
    """The adds that sum a shared weight's gradient terms made on several stages (stage
    by `stage_of`): `_split_shared_gradients` replaces them with one part per stage, so
    the terms they read are never sent between stages."""
    out: set[fx.Node] = set()
    for grad in tg.grad_nodes():
        if len({stage_of(t) for t in gradient_terms(grad)}) > 1:
            todo = [grad]
            while todo:
                n = todo.pop()
                if gradient_terms(n) != [n]:  # an accumulating add
                    out.add(n)
                    todo += n.args[:2]
    return out


def _position(tg: TrainGraph):
    order = {n: i for i, n in enumerate(tg.graph.nodes)}
    return order.__getitem__


def _stage_from_inputs(node: fx.Node) -> int:
    return max((a.meta.get(M.STAGE, 0) for a in node.all_input_nodes), default=0)


def _consumers(tg: TrainGraph, program_of) -> dict[fx.Node, set]:
    """For every value, the programs (stage, kind) that use it; "out" for graph outputs."""
    users: dict[fx.Node, set] = {}
    for node in tg.call_nodes():
        for a in node.all_input_nodes:
            users.setdefault(a, set()).add(program_of(node))
    for out in tg.outputs():
        users.setdefault(out, set()).add("out")
    return users


def _stage_program(tg, s, members, needed_by) -> StageProgram:
    forward, f_in, f_out = _cut(tg, members[(s, "F")], (s, "F"), needed_by)
    backward, b_in, b_out = _cut(tg, members[(s, "B")], (s, "B"), needed_by)
    sends_f, sends_b = {}, {}
    for key_node in members[(s, "F")]:
        for user in needed_by.get(key_node, ()):
            if user == "out" or user[0] == s:
                continue
            if user[0] < s:
                raise StageError(f"{key_node.name} ({key_node.meta.get(M.MODULE_PATH)}) is computed "
                                 f"in stage {s}'s forward but used by stage {user[0]}: the cut does "
                                 "not follow the model's data flow; pin other cuts")
            sends_f.setdefault(user[0], set()).add(key_node.name)
    for key_node in members[(s, "B")]:
        for user in needed_by.get(key_node, ()):
            if user != "out" and user[0] != s:
                sends_b.setdefault(user[0], set()).add(key_node.name)
    return StageProgram(
        stage=s, forward=forward, f_inputs=f_in, f_outputs=f_out,
        backward=backward, b_inputs=b_in, b_outputs=b_out,
        send_forward={d: tuple(sorted(k)) for d, k in sends_f.items()},
        send_backward={d: tuple(sorted(k)) for d, k in sends_b.items()},
    )


def input_grad_side(nodes: list[fx.Node], sent: set[str]) -> set[fx.Node]:
    """The backward `nodes` of one stage that the values named in `sent` (the gradients
    sent to earlier stages) depend on: zero-bubble's I; the rest is W."""
    inside, needed = set(nodes), set()
    stack = [n for n in nodes if n.name in sent]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack += [a for a in n.all_input_nodes if a in inside]
    return needed


def _split_backwards(tg, programs, members) -> None:
    """Zero-bubble: each stage's backward as I (what the gradients sent to earlier
    stages need: on the critical path) and W (the rest: weight gradients), W running
    later to fill the bubbles."""
    weight_side: set[fx.Node] = set()
    for program in programs:
        nodes = members[(program.stage, "B")]
        sent = {k for keys in program.send_backward.values() for k in keys}
        weight_side |= set(nodes) - input_grad_side(nodes, sent)

    def program_of(node):
        kind = _program_of(node)
        if kind is None or kind[1] == "F":
            return kind
        return kind[0], "W" if node in weight_side else "I"

    needed_by = _consumers(tg, program_of)
    for program in programs:
        nodes = members[(program.stage, "B")]
        program.input_grad = _cut(tg, [n for n in nodes if n not in weight_side],
                                  (program.stage, "I"), needed_by)
        program.weight_grad = _cut(tg, [n for n in nodes if n in weight_side],
                                   (program.stage, "W"), needed_by)


def _cut(tg, nodes, me, needed_by) -> tuple[fx.GraphModule, tuple[str, ...], tuple[str, ...]]:
    """A GraphModule of `nodes`; its inputs are the values they use from elsewhere
    (tensor constants are copied in), its outputs what others use."""
    inside = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    external = [a for n in nodes for a in n.all_input_nodes if a not in inside]
    for a in dict.fromkeys(external):
        env[a] = graph.get_attr(a.target) if a.op == "get_attr" else graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    outputs = [n for n in nodes if needed_by.get(n, set()) - {me}]
    graph.output(tuple(env[n] for n in outputs))
    inputs = tuple(a.name for a in dict.fromkeys(external) if a.op != "get_attr")
    return fx.GraphModule(tg.gm, graph), inputs, tuple(n.name for n in outputs)
