"""The pipelined program IR: one program per pipeline stage and the schedule that runs them.

`lower_pipeline` builds a PipelineProgram from the staged joint graph; the runtime
(runtime/pipeline.py) executes it rank by rank and the planner replays its memory
(planner/pipeline_memory.py). Values are keyed by the joint graph's node names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.program import LOSS_SCALE_INPUT, TensorEntry
from autopar.compiler.ir.schedule import Schedule, send_releases


@dataclass(frozen=True)
class ValueSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class StageProgram:
    stage: int
    forward: fx.GraphModule
    f_inputs: tuple[str, ...]
    f_outputs: tuple[str, ...]
    backward: fx.GraphModule
    b_inputs: tuple[str, ...]
    b_outputs: tuple[str, ...]
    send_forward: dict[int, tuple[str, ...]] = field(default_factory=dict)  # stage -> keys
    send_backward: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # zero-bubble only: the backward split into input-gradient and weight-gradient
    # programs, each (GraphModule, input keys, output keys)
    input_grad: tuple | None = None
    weight_grad: tuple | None = None

    def uses(self) -> set[str]:
        return set(self.f_inputs) | set(self.b_inputs)

    def program(self, kind: str) -> tuple[fx.GraphModule, tuple[str, ...], tuple[str, ...]]:
        """(module, input keys, output keys) of the program a `kind` action (F, B, I, W)
        runs on this stage."""
        if kind == "F":
            return self.forward, self.f_inputs, self.f_outputs
        if kind == "B":
            return self.backward, self.b_inputs, self.b_outputs
        return self.input_grad if kind == "I" else self.weight_grad


@dataclass
class PipelineProgram:
    stages: tuple[StageProgram, ...]
    schedule: Schedule
    params: tuple[TensorEntry, ...]
    buffers: tuple[TensorEntry, ...]
    inputs: tuple[TensorEntry, ...]  # one micro-batch's shapes
    batch_dims: tuple[int | None, ...]
    keys: tuple[str, ...]  # placeholder key of each param, buffer, input (in that order)
    grad_parts: tuple[tuple[str, ...], ...]  # per param: the nodes of its gradient's parts
    loss_key: str
    values: dict[str, ValueSpec]
    mesh: tuple[tuple[str, int], ...]
    layout: dict = field(default_factory=dict)
    # the summed gradients are divided by this (fp16 steps, whose backward seed is
    # d(loss * scale) and not scaled by 1/(microbatches * dp) in the graph)
    grad_divisor: int = 1
    # batch-decided counts the loss divides by (compiler/ir/batch.LossNormalizer)
    normalizers: tuple = ()

    @property
    def loss_scaled(self) -> bool:
        return bool(self.inputs) and self.inputs[-1].name == LOSS_SCALE_INPUT

    def receives(self, stage: int, kind: str) -> dict[int, tuple[str, ...]]:
        """What `stage` receives before its F ("forward") or B ("backward"), by source stage."""
        attr = "send_forward" if kind == "forward" else "send_backward"
        return {p.stage: getattr(p, attr)[stage] for p in self.stages if stage in getattr(p, attr)}

    def send_releases(self, pp_rank: int) -> dict[int, tuple[int, ...]]:
        """schedule.send_releases for this program's send and receive tables: after which
        of the rank's receives each of its sends is known to be received."""
        by_stage = {p.stage: p for p in self.stages}

        def sends_to(stage: int, phase: str):
            return list(by_stage[stage].send_forward if phase == "F"
                        else by_stage[stage].send_backward)

        def receives_from(stage: int, phase: str):
            return list(self.receives(stage, "forward" if phase == "F" else "backward"))
        return send_releases(self.schedule, pp_rank, sends_to, receives_from)

    def values_read(self) -> set[str]:
        """The keys some program reads or some stage sends: a gradient part among them
        (a parameter's gradient that is also the input gradient a stage sends back)
        stays in its micro-batch's environment beside its sum."""
        read = set()
        for p in self.stages:
            read.update(p.f_inputs, p.b_inputs)
            for program in (p.input_grad, p.weight_grad):
                if program:
                    read.update(program[1])
            for table in (p.send_forward, p.send_backward):
                for keys in table.values():
                    read.update(keys)
        return read

    def dying_inputs(self, pp_rank: int) -> dict[int, tuple[str, ...]]:
        """Action index (in the rank's schedule) -> the inputs of its program (F, B, I or
        W) that no later action of the rank reads in that micro-batch: outputs of the
        rank's programs that it never sends to another rank (a saved activation, an
        input gradient W reads). The runtime gives them up when it calls that program,
        which frees each after its last use inside it (autograd frees a saved tensor
        once the node reading it has run); the memory replays free them there too
        (planner/pipeline_memory.py, and replicated.py's from a summary). Received
        values stay to the micro-batch's last action, as do parameters, buffers and the
        micro-batch's inputs (not the micro-batch's own, or the step keeps them)."""
        by_stage = {p.stage: p for p in self.stages}
        actions = self.schedule.ranks[pp_rank]
        pp = self.schedule.pp
        made, sent, last = set(), set(), {}
        for i, action in enumerate(actions):
            stage, mb = by_stage[action.stage], action.microbatch
            if action.kind in PROGRAM_KINDS:
                _, inputs, outputs = stage.program(action.kind)
                last.update(((mb, k), i) for k in inputs)
                made.update((mb, k) for k in outputs)
            elif action.kind in ("SF", "SB"):
                table = stage.send_forward if action.kind == "SF" else stage.send_backward
                for dst, keys in table.items():
                    last.update(((mb, k), i) for k in keys)
                    if dst % pp != pp_rank:
                        sent.update((mb, k) for k in keys)
        dying: dict[int, list[str]] = {}
        for (mb, key), i in last.items():
            if actions[i].kind in PROGRAM_KINDS and (mb, key) in made and (mb, key) not in sent:
                dying.setdefault(i, []).append(key)
        return {i: tuple(keys) for i, keys in sorted(dying.items())}

    def stages_reading(self, param_key: str, parts: tuple[str, ...]) -> set[int]:
        """Stages whose programs read the parameter or produce a part of its gradient."""
        return {p.stage for p in self.stages
                if param_key in p.uses() or set(parts) & (set(p.b_outputs) | set(p.f_outputs))}


PROGRAM_KINDS = ("F", "B", "I", "W")  # the schedule's actions that run a stage program


def boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` called with one list of its inputs, which it empties before its
    first op (torch.fx's boxed calling convention, as AOTAutograd's compiled programs
    take theirs): the caller's list no longer holds the inputs, and the generated code
    drops each after its last use, so an input nothing else holds is freed there."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_BoxedCodeGen())
    return fx.GraphModule(gm, graph)


def accumulating(gm: fx.GraphModule, outputs: tuple[str, ...], parts: set[str],
                 keep: set[str] = frozenset()
                 ) -> tuple[fx.GraphModule, tuple[str, ...], tuple[str, ...]]:
    """A stage program that adds its gradient parts into their accumulators in place, as
    autograd accumulates into `.grad` across micro-batches: one more input per part
    (its running sum, after the program's own inputs), each part added into it right
    after the node that makes it, so the part's storage is freed there instead of
    living to the program's end beside the sums. Returns the module, the keys of the
    accumulators it takes (in input order) and the outputs it still returns (the
    others, in their order, and the parts in `keep`, which something else reads: those
    are added into their sums and returned too). The runtime runs it once every part has
    its accumulator
    (from the first micro-batch on a stage); the planner's memory replay frees each
    part at its last use the same way (planner/pipeline_memory.py)."""
    graph = fx.Graph()
    remap: dict[fx.Node, fx.Node] = {}
    returned = graph.graph_copy(gm.graph, remap)
    values = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    acc_keys = tuple(k for k in outputs if k in parts)
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        sums = {k: graph.placeholder(f"acc_{k}") for k in reversed(acc_keys)}
    for key, value in zip(outputs, values):
        if key in sums:
            with graph.inserting_after(value):
                add = graph.call_function(torch.ops.aten.add_.Tensor, (sums[key], value))
            add.meta = {k: v for k, v in value.meta.items() if k in (M.VAL, M.ROLE)}
    kept = tuple(k for k in outputs if k not in parts or k in keep)
    graph.output(tuple(v for k, v in zip(outputs, values) if k not in parts or k in keep))
    graph.lint()
    return fx.GraphModule(gm, graph), acc_keys, kept
