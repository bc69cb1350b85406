"""Pipelines of any depth from one two-stage trace of a deep model.

With `trace_blocks`, a pipelined layout is not traced with one block per stage:
every stage of a uniform stack runs the same block, so the model is traced once
with two of its L blocks and rewritten as a two-stage pipeline cut between them
(the *template*): stage 0 holds the embeddings and block 0, stage 1 block 1, the
head and the loss. `replicate(template, S)` builds the summaries of an S-stage
pipeline from it, as if the whole model had been traced and cut:

- stage 0 is the template's stage 0, stage S-1 its stage 1, and each stage between
  is the template's block 1 alone (its ops as the template's stage 1 runs them:
  receiving from the stage before, sending its input gradient back);
- stage s holds c_s blocks, cut as AssignStages cuts the whole model (the
  template's head, block and tail times balanced, and with one stage per rank their
  bytes weighed, `Template.blocks_per_stage`): each block op runs c_s times
  (`OpRecord.repeat`, its model FLOPs likewise), each block parameter is there c_s
  times (as c_s tensors), and a block op's storage counts c_s times when it is kept
  for another program of its stage (saved activations, gradients) or handed to the
  stage's next block (`_handed_on`); storage that a program frees itself (a
  transient) counts once, as the real stage runs its blocks one after another
  (`_program` replays a program as its last block: the earlier blocks' kept values
  alive, and the output gradient the block after made on the stage);
- a value one block sends the next goes between each pair of neighbouring stages;
  what the embeddings send the blocks goes from the first stage to every other one;
  a value a stage sends stays in its micro-batch's environment, as in the lowered
  programs; tied parameters read by both template stages are read by the first and
  the last, each of which keeps its part of their gradient (`_split`).

Stages with the same role and block count share one `StageSummary.kinds` entry,
so the pipeline cost model replays their programs once. What a whole-model trace
has and the template lacks: blocks that differ from one another, and the balancing
of AssignStages on exact per-block times (here: every block as the traced one).

`pipeline_memory_from_summary` replays each pipeline rank's schedule over these
summaries with the rules of `pipeline_memory.py` (which replays lowered programs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import fx

from autopar.cluster import ClusterSpec
from autopar.compiler.analysis.memory import (
    CATEGORIES,
    MemoryPrediction,
    graph_liveness,
    held_per_byte,
    optimizer_memory,
    zero_block_bytes,
)
from autopar.compiler.analysis.summary import (
    GraphSummary,
    OpRecord,
    changed,
    summarize,
)
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import tensor_bytes
from autopar.compiler.ir.graph import TrainGraph, param_layers
from autopar.compiler.ir.schedule import build, in_flight, rank_actions, send_releases
from autopar.compiler.lowering.lower_pipeline import split_gradient_sums
from autopar.compiler.passes.assign_stages import (
    CUT_WEIGHTS,
    CutMemory,
    balanced_cuts,
    cut_weights,
)
from autopar.compiler.planner.pipeline_cost import phase_time
from autopar.compiler.planner.pipeline_memory import SentBuffers
from autopar.compiler.planner.scaled import op_layers
from autopar.compiler.planner.stages import Message, StageSummary, stage_summary
from autopar.costs import DEFAULT_EFFICIENCY, Efficiency
from autopar.layout import Layout

TEMPLATE_BLOCKS = 2  # blocks traced for every pipeline: one on each side of the cut


@dataclass(frozen=True)
class Template:
    """The two-stage rewritten graph of two traced blocks, as plain data."""

    summary: GraphSummary
    stages: StageSummary
    op_layer: tuple[int | None, ...]
    param_layer: tuple[int | None, ...]
    blocks: int  # L: the blocks of the whole model
    # AssignStages' estimates (node_time): before the stack, one block, after the stack
    head_s: float = 0.0
    block_s: float = 0.0
    tail_s: float = 0.0
    # AssignStages' CutWeights in bytes, the same three: parameters, and what the forward
    # keeps for the backward per micro-batch (from the rewritten template: after fusion)
    head_bytes: tuple[int, int] = (0, 0)
    block_bytes: tuple[int, int] = (0, 0)
    tail_bytes: tuple[int, int] = (0, 0)
    # per value sent between the two stages: (phase, from a block op, to a block op, bytes)
    sends: tuple[tuple[str, bool, bool, int], ...] = ()
    sent: frozenset[int] = frozenset()  # the storages of those values
    # a weight read on both stages (a tied embedding): the adds summing its gradient's
    # terms across the stages, and the storages of those terms (split_gradient_sums)
    split: frozenset[int] = frozenset()
    parts: frozenset[int] = frozenset()

    def blocks_per_stage(self, n_stages: int, layout: Layout | None = None,
                         optimizer: str = "adamw", budget: float | None = None
                         ) -> tuple[int, ...]:
        """Blocks of each stage, cut as AssignStages cuts the whole model under `layout`
        (balanced_cuts: the last stage may hold only the head; with one stage per rank,
        the fastest cut whose stages fit `budget` bytes, AssignStages' stage_budget).
        Without a layout or a budget: on time alone."""
        memory = None
        if layout is not None and budget is not None and layout.virtual_stages == 1 \
                and n_stages > 1:
            held = held_per_byte(layout, optimizer)
            memory = (held * self.head_bytes[0], self.head_bytes[1],
                      held * self.block_bytes[0], self.block_bytes[1],
                      held * self.tail_bytes[0], self.tail_bytes[1],
                      in_flight(layout.schedule, layout.pp, layout.microbatches))
        return _blocks_per_stage(self.blocks, n_stages, self.block_s, self.head_s, self.tail_s,
                                 memory, budget)

    # worked out once per template, for every depth replicated or floored from it
    @functools.cached_property
    def kept(self) -> frozenset[int]:
        """Storages read by another program of their own stage, or returned by the step."""
        return _kept_storages(self)

    @functools.cached_property
    def block_outputs(self) -> dict[int, frozenset[int]]:
        """_block_outputs of the template."""
        return _block_outputs(self)

    @functools.cached_property
    def handed_on(self) -> dict[int, frozenset[int]]:
        """_handed_on of the template."""
        return _handed_on(self)

    @functools.cached_property
    def saved_per_block(self) -> tuple[int, int]:
        """(bytes the forward of the first stage's block keeps for the stage's other
        programs (its saved activations), bytes of its output a next block on the stage
        keeps (_handed_on)), per micro-batch."""
        stage_of, program_of = self.stages.stage_of, self.stages.program_of
        saved = sum(self.summary.ops[s].allocates for s in self.kept
                    if stage_of[s] == 0 and program_of[s] == "F"
                    and self.op_layer[s] is not None and s not in self.summary.output_storages)
        handed = sum(self.summary.ops[s].allocates for s in self.handed_on.get(0, ()))
        return saved, handed


@functools.lru_cache(maxsize=1024)
def _blocks_per_stage(blocks: int, n_stages: int, block_s: float, head_s: float,
                      tail_s: float, memory: tuple | None, budget: float | None
                      ) -> tuple[int, ...]:
    """Template.blocks_per_stage, once per depth and memory weights of a template (the
    search asks it for every layout it replicates, bounds or costs)."""
    cuts = _time_cuts(blocks, n_stages, block_s, head_s, tail_s)
    if memory is not None:
        head_fixed, head_saved, fixed, saved, tail_fixed, tail_saved, flight = memory
        weighed = CutMemory((fixed,) * blocks, (float(saved),) * blocks, head_fixed,
                            float(head_saved), tail_fixed, float(tail_saved), flight)
        cuts = balanced_cuts([block_s] * blocks, n_stages, head_s, tail_s, weighed, budget,
                             time_cuts=list(cuts))
    bounds = [0, *cuts, blocks]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@functools.lru_cache(maxsize=1024)
def _time_cuts(blocks: int, n_stages: int, block_s: float, head_s: float, tail_s: float
               ) -> tuple[int, ...]:
    """The time-balanced cuts of a template's stack, once per depth (most layouts'
    stages fit their budget: only their bytes are weighed anew)."""
    return tuple(balanced_cuts([block_s] * blocks, n_stages, head_s, tail_s))


def template_of(tg: TrainGraph, blocks: int, cluster: ClusterSpec) -> Template:
    """The template of a stage-assigned graph traced with two blocks and cut between them."""
    stages = stage_summary(tg)
    if stages.stages != 2:
        raise ValueError(f"a pipeline template has 2 stages, this graph has {stages.stages}")
    summary = summarize(tg)
    sends, sent = _sends(tg, summary)
    # what AssignStages weighed for its cut, on the graph it cut (before the passes after
    # it, such as fusion): the whole model's AssignStages weighs the same graph's blocks
    w = tg.attrs.get(CUT_WEIGHTS) or cut_weights(tg, cluster)
    return Template(summary, stages, op_layers(tg), param_layers(tg), blocks,
                    w.head_s, w.seconds.get(1, 0.0), w.tail_s, (w.head_params, w.head_saved),
                    (w.params.get(1, 0), w.saved.get(1, 0)), (w.tail_params, w.tail_saved),
                    sends, sent, *_split(tg, summary))


def _indices(tg: TrainGraph, summary: GraphSummary) -> dict[fx.Node, int]:
    """Each call node's OpRecord in `summary` (summarize's order: user inputs, then calls)."""
    first = sum(1 for op in summary.ops if op.role == "input")
    return {n: first + k for k, n in enumerate(tg.call_nodes())}


def _split(tg: TrainGraph, summary: GraphSummary) -> tuple[frozenset[int], frozenset[int]]:
    """(the adds of split_gradient_sums, the storages of the terms they sum) in `summary`:
    the lowering gives each stage its terms' part of the gradient instead (one step
    output a stage), summed once a step."""
    index = _indices(tg, summary)
    split = split_gradient_sums(tg, lambda n: n.meta.get(M.STAGE))
    terms = {a for n in split for a in n.args[:2] if isinstance(a, fx.Node) and a not in split}
    parts = {summary.ops[index[a]].storage for a in terms if a in index}
    parts.discard(None)
    return frozenset(index[n] for n in split), frozenset(parts)


def _sends(tg: TrainGraph, summary: GraphSummary
           ) -> tuple[tuple[tuple[str, bool, bool, int], ...], frozenset[int]]:
    """The values one template stage sends the other, and whether block ops make and read
    them (as stages.stage_summary counts them: a value once per receiving stage); and
    their storages in `summary` (of `tg`)."""
    out, sent = [], set()
    split = split_gradient_sums(tg, lambda n: n.meta.get(M.STAGE))
    index = _indices(tg, summary)
    for n in tg.call_nodes():
        stage = n.meta.get(M.STAGE)
        readers = [u for u in n.users if u.meta.get(M.STAGE) not in (None, stage) and u not in split]
        if stage is None or not readers:
            continue
        phase = "B" if n.meta[M.ROLE] == M.Role.BACKWARD else "F"
        out.append((phase, n.meta.get(M.LAYER) is not None,
                    any(u.meta.get(M.LAYER) is not None for u in readers),
                    tensor_bytes(n.meta.get(M.VAL))))
        sent.add(summary.ops[index[n]].storage)
    sent.discard(None)
    return tuple(out), frozenset(sent)


def _messages(t: Template, counts: tuple[int, ...]) -> tuple[Message, ...]:
    """The template's values sent on in an S-stage pipeline. Forward: a block's to the
    next stage; one made before the stack to every stage whose blocks read it, else to
    the last. Backward: one that a block makes or reads to the stage before; the rest
    (the head's part of a tied weight's gradient) from the last stage to the first."""
    last = len(counts) - 1
    with_blocks = [s for s in range(1, last + 1) if counts[s]]
    sent: dict[tuple[int, int, str], tuple[int, int]] = {}
    for phase, from_block, to_block, nbytes in t.sends:
        if phase == "F":
            pairs = [(b, b + 1) for b in range(last)] if from_block else \
                [(0, s) for s in (with_blocks if to_block else [last])]
        else:  # NOTE: by its readers: a fused backward op may lose its block (scaled.param_layers)
            pairs = [(b + 1, b) for b in range(last)] if from_block or to_block else [(last, 0)]
        for key in ((src, dst, phase) for src, dst in pairs):
            total, count = sent.get(key, (0, 0))
            sent[key] = (total + nbytes, count + 1)
    return tuple(Message(src, dst, phase, *value) for (src, dst, phase), value in sorted(sent.items()))


def _selection(t: Template, stage: int, n_stages: int, blocks: int) -> tuple[int, list[int]]:
    """(template stage, its op indices) that stage `stage` of `n_stages` runs, holding
    `blocks` blocks (the last stage may hold none: only the head and the loss)."""
    if stage == 0:
        return 0, [i for i, s in enumerate(t.stages.stage_of) if s == 0]
    ops = [i for i, s in enumerate(t.stages.stage_of) if s == 1]
    if stage == n_stages - 1:
        return 1, ops if blocks else [i for i in ops if t.op_layer[i] is None]
    return 1, [i for i in ops if t.op_layer[i] is not None]


def first_rank_saved_floor(t: Template, layout: Layout, optimizer: str = "adamw",
                           budget: float | None = None) -> int:
    """Bytes below the peak of a pipeline's first rank replicated from `t`
    (pipeline_memory_from_summary), from the template alone. Until its first backward,
    the rank holds every micro-batch it has run forward, and each forward of its stage
    of c_0 blocks keeps at least c_0 times what `t.saved_per_block` says (its
    saved activations, and with more than one block what it hands the next, as
    replicate counts them); its static memory and all else only add. 0 under an
    interleaved schedule (the rank runs several stages)."""
    if layout.virtual_stages != 1:
        return 0
    blocks = t.blocks_per_stage(layout.pp, layout, optimizer, budget)[0]
    saved, handed = t.saved_per_block
    return _first_forwards(layout.schedule, layout.pp, layout.microbatches) \
        * blocks * (saved + (handed if blocks > 1 else 0))


@functools.lru_cache(maxsize=1024)
def _first_forwards(schedule: str, pp: int, microbatches: int) -> int:
    """Forwards the first rank runs before its first backward (B or I)."""
    forwards = 0
    for action in rank_actions(schedule, pp, microbatches, 1, 0):
        if action.kind in ("B", "I"):
            break
        forwards += action.kind == "F"
    return forwards


def _kept_storages(t: Template) -> frozenset[int]:
    """Storages read by another program of their own stage, or returned by the step."""
    stage_of, program_of = t.stages.stage_of, t.stages.program_of
    kept = set(t.summary.output_storages)
    for i, op in enumerate(t.summary.ops):
        for u in op.uses:
            s = t.summary.ops[u].storage
            if s is not None and stage_of[s] == stage_of[i] and program_of[s] != program_of[i]:
                kept.add(s)
    return frozenset(kept)


def _handed_on(t: Template) -> dict[int, frozenset[int]]:
    """Template stage -> the storages of its block's output that the next block of the
    same stage would keep for its backward: in the template block 0's output goes to
    block 1 on stage 1, whose backward reads it (a layer norm's input, a recomputed
    block's), and block 1's output to the head. A stage of c blocks keeps c - 1 such
    hand-offs per micro-batch, which no template stage shows (none when a block's
    backward does not read its input)."""
    ops, stage_of, program_of = t.summary.ops, t.stages.stage_of, t.stages.program_of
    outputs = t.block_outputs
    if not any(ops[u].storage in outputs[0] for i, op in enumerate(ops)
               if stage_of[i] == 1 and program_of[i] != "F" for u in op.uses):
        return {}
    return outputs


def _block_outputs(t: Template) -> dict[int, frozenset[int]]:
    """Template stage -> the storages of its block's output: block 0's, read by block 1;
    block 1's, read by the head's forward. Where a fused region of the head took in block
    1's last ops (its residual add: the region's outputs include a block 1 value), that
    output, and not the block's values the region reads."""
    ops, stage_of, program_of = t.summary.ops, t.stages.stage_of, t.stages.program_of
    into_block1 = {ops[u].storage for i, op in enumerate(ops)
                   if stage_of[i] == 1 and t.op_layer[i] == 1 for u in op.uses
                   if stage_of[u] == 0 and t.op_layer[u] == 0}
    into_block1.discard(None)
    head = {i for i, op in enumerate(ops) if stage_of[i] == 1 and program_of[i] == "F"
            and t.op_layer[i] is None}
    tails: dict[int, set[int]] = {}  # a head region -> its getitems of a block 1 value
    for g, op in enumerate(ops):
        if op.target == "getitem" and op.uses and op.uses[0] in head and t.op_layer[g] == 1:
            tails.setdefault(op.uses[0], set()).add(op.storage)
    into_head = {s for i in head for s in tails.get(i, ())}
    into_head |= {ops[u].storage for i in head if i not in tails for u in ops[i].uses
                  if stage_of[u] == 1 and program_of[u] == "F" and t.op_layer[u] == 1}
    into_head.discard(None)
    return {0: frozenset(into_block1), 1: frozenset(into_head)}


def replicate(t: Template, counts: tuple[int, ...], representatives: bool = False
              ) -> tuple[GraphSummary, StageSummary]:
    """The summaries of a pipeline of the whole model whose stage s holds counts[s] blocks
    (`Template.blocks_per_stage`; module docstring).

    `representatives`: only the first stage of each kind has its ops in the summary (the
    others of that kind run the same ops: `StageSummary.kinds`); the parameters, the
    messages and the stages' parameters are the whole pipeline's. Enough for its step
    time (pipeline_cost.run_schedule replays one stage of each kind; the stages 64 and
    128 deep of a large search then copy 4 stages' ops instead of all), not for its
    memory of every rank (stage_programs reads every stage's ops and their uses). It does
    replay each rank's memory as the whole replica does, though (tested): stage_programs
    costs each kind's programs on its first stage in both, and a stage's values reach
    other stages as messages, not as uses (Estimator.memory_floor replays the end ranks
    on it)."""
    n_stages = len(counts)
    kept, handed_on = t.kept, t.handed_on
    handed: list[int] = []
    repeated: list[int] = []
    handed_back: list[tuple[int, int, tuple[int, ...]]] = []
    sent: list[int] = []
    # a block's output gradient: what the template's block receives from the stage after
    back = sum(nbytes for phase, _, to_block, nbytes in t.sends if phase == "B" and to_block)
    n_inputs = sum(1 for s in t.stages.stage_of if s is None)
    ops: list[OpRecord] = list(t.summary.ops[:n_inputs])
    stage_of: list[int | None] = [None] * n_inputs
    program_of: list[str | None] = [None] * n_inputs
    outputs: set[int] = set()
    kinds = []
    for s in range(n_stages):
        role = "first" if s == 0 else "last" if s == n_stages - 1 else "middle"
        kinds.append((role, counts[s]))
        if representatives and kinds[-1] in kinds[:-1]:  # a few kinds: first, last, middles
            continue
        source, chosen = _selection(t, s, n_stages, counts[s])
        where = {i: i for i in range(n_inputs)}
        where.update({i: len(ops) + k for k, i in enumerate(chosen)})
        # the last stage's block output goes to the head, which keeps it: kept already
        passed = handed_on.get(source, frozenset()) if role != "last" and counts[s] > 1 \
            else frozenset()
        handed += [where[i] for i in chosen if i in passed]
        # what a stage sends: the template's messages, and a middle stage's block output
        sent += [where[i] for i in chosen if i in t.sent
                 or (role == "middle" and i in t.block_outputs[1])]
        if counts[s] > 1:
            repeated += [where[i] for i in chosen if t.op_layer[i] is not None
                         and (i in kept or i in passed)]
        if counts[s] > 1 and role != "last" and back:
            readers = _gradient_readers(t, chosen)
            if readers:
                handed_back.append((s, back, tuple(where[i] for i in readers)))
        for i in chosen:
            op = _copy(t.summary.ops[i], where, counts[s] if t.op_layer[i] is not None
                       else None, i in kept or i in passed, s)
            ops.append(changed(op, allocates=0) if i in t.split else op)
            stage_of.append(s)
            program_of.append(t.stages.program_of[i])
        outputs.update(where[i] for i in (t.summary.output_storages - t.split) | t.parts
                       if i in where and i >= n_inputs)
    summary = replace(t.summary, ops=tuple(ops), output_storages=frozenset(outputs),
                      **_params(t, counts))
    messages = _messages(t, counts)
    stages = StageSummary(stages=n_stages, stage_of=tuple(stage_of), program_of=tuple(program_of),
                          messages=messages, param_stages=_params(t, counts, stages=True),
                          kinds=tuple(kinds), handed=tuple(handed), repeated=tuple(repeated),
                          handed_back=tuple(handed_back), sent=tuple(sent))
    return summary, stages


def _gradient_readers(t: Template, chosen: list[int]) -> list[int]:
    """The backward ops of a stage (template indices, of `chosen`) that read a gradient
    made outside the stage's selection: the block's output gradient, which the template's
    block receives (stage 0) or takes from the head (stage 1); not the head's part of a tied
    weight's gradient, which stays on the last stage. Not only block ops: a fused backward
    region across a block's end may have lost its block (fuse_regions)."""
    ops, inside, stage_of = t.summary.ops, set(chosen), t.stages.stage_of
    return [i for i in chosen if t.stages.program_of[i] != "F"
            and any((s := ops[u].storage) is not None and s not in inside
                    and ops[s].role == "backward" and ops[s].allocates
                    and (s in t.sent or stage_of[s] == stage_of[i]) for u in ops[i].uses)]


def block_work_floor(t: Template, cluster: ClusterSpec, layout: Layout,
                     eff: Efficiency = DEFAULT_EFFICIENCY) -> tuple[float, float]:
    """(seconds below one repeated block's work per micro-batch on any stage of a pipeline
    replicated from `t`: its F phase plus its B phase, or I plus W, whichever is less;
    seconds below its F phase alone).

    Stage s runs c_s blocks as the template's block ops of its role (stage 0's, or stage
    1's), each `repeat`ed c_s times (`replicate`). A phase replay (pipeline_cost.
    phase_time) is monotone in every op's time and scales with them, so with the other
    ops left out, and each op's first touch too (a replicated op's allocation is the
    template's or larger, or none for a view of a received value), a stage's phase takes
    at least c_s times the block's phase here. Summed over stages: L blocks, each at
    least the lesser of the two roles' block work."""
    summary = replace(t.summary, ops=tuple(changed(op, allocates=0) for op in t.summary.ops))
    roles = []
    for stage in (0, 1):
        block = [i for i, s in enumerate(t.stages.stage_of)
                 if s == stage and t.op_layer[i] is not None]
        phase = {kind: phase_time(summary, [i for i in block if t.stages.program_of[i] in kind],
                                  cluster, layout, eff).total_s for kind in ("F", "IW", "I", "W")}
        roles.append((phase["F"] + min(phase["IW"], phase["I"] + phase["W"]), phase["F"]))
    return min(work for work, _ in roles), min(forward for _, forward in roles)


def _copy(op: OpRecord, where: dict[int, int], count: int | None, kept: bool,
          stage: int) -> OpRecord:
    def mapped(i):
        return where.get(i) if i is not None else None

    fields = {"name": f"{op.name}.s{stage}" if stage else op.name,
              "uses": tuple(where[u] for u in op.uses if u in where),
              "storage": mapped(op.storage), "waits_on": mapped(op.waits_on)}
    if count is not None:
        fields.update(repeat=op.repeat * count, model_flops=op.model_flops * count,
                      allocates=op.allocates * count if kept else op.allocates)
    if op.storage is not None and op.storage not in where:  # a view of a received value
        fields["allocates"] = 0
    return changed(op, **fields)


def _params(t: Template, counts: tuple[int, ...], stages: bool = False):
    """Parameters of the whole model: the template's outside the blocks (on the first and
    last stage), and each stage's c_s blocks as copies of a traced block's."""
    last = len(counts) - 1
    summary, entries = t.summary, []  # (template parameter, stages reading the copy)
    for p, layer in enumerate(t.param_layer):
        if layer is None:
            entries.append((p, frozenset(0 if s == 0 else last for s in t.stages.param_stages[p])))
        else:
            entries += [(p, frozenset({s})) for s in (range(1, last + 1) if layer else [0])
                        for _ in range(counts[s])]
    if stages:
        return tuple(where for _, where in entries)
    pick = lambda values: tuple(values[p] for p, _ in entries) if values else ()  # noqa: E731
    return {"param_numel": pick(summary.param_numel), "param_itemsize": pick(summary.param_itemsize),
            "param_rows": pick(summary.param_rows), "param_blocks": pick(summary.param_blocks)}


# -- memory ---------------------------------------------------------------------------------

def _program(summary: GraphSummary, members: list[int], own: set[tuple[int, str]],
             readers: dict[int, set[tuple[int, str]]], blocks: int = 1,
             repeated: frozenset[int] = frozenset(),
             handed_back: tuple[int, frozenset[int]] = (0, frozenset()),
             late: dict[int, int] | None = None, accumulate: bool = False,
             dying: dict[int, str] | None = None):
    """Liveness of one program (its inputs held outside it: `own` are its (stage, program)
    labels) and the bytes of step outputs (gradients) it makes. `accumulate`: as the
    runtime runs it once its gradients have their sums (pipeline_program.accumulating):
    each gradient added into its sum as it is made and freed at its last use, so no
    gradient outlives the program (nor do the earlier blocks' copies).

    `dying` (storage -> category): values an earlier program of the stage made that this
    program reads last (PipelineProgram.dying_inputs: the runtime gives them up to it).
    They count from the program's start and are freed after their last use in it; of a
    `repeated` one, the block ops' copy so, and the c - 1 other blocks' copies through
    the block ops in part: run j of c holds c - 1 - j blocks' copies beside j blocks'
    kept outputs (`earlier`), so the block ops hold the larger (j = 0 or c - 1).

    An output of a multi-output op that a later program of the stage takes (`late`:
    getitem -> op; a fused region's weight-gradient part, which W takes from I) is made
    by the op and kept for that program, as the lowered programs pass it on: here, bytes
    the op's program returns, and none in the later program.

    A replicated stage runs its `blocks` blocks one after another, and its block ops stand
    for the last of them (the peak: the earlier blocks' outputs are alive):
    - a `repeated` storage (c copies' bytes) that outlives the program has the c - 1
      earlier blocks' copies alive from the first block op on (their weight gradients,
      their saved values), the last block's from its op; one that the program frees itself
      (a value the weight gradient reads, when I and W run as one program) is one block's,
      freed before the next block makes its own; so does an output taken later (`late`);
    - `handed_back` (bytes, readers): on a stage whose blocks hand their input gradient to
      the block before, the last block's output gradient is the block after's input
      gradient, made on the stage: alive from the first block op to its last reader here
      (with readers in a later program, the c - 1 made on the stage are kept for it)."""
    late = late or {}
    inside = set(members)
    returned = {s for s in members
                if (s in summary.output_storages and not accumulate) or readers.get(s, own) - own}
    taken_later: dict[int, list[int]] = {}  # op -> its outputs a later program takes
    for g, source in late.items():
        if source in inside and g not in inside:
            taken_later.setdefault(source, []).append(g)
    order: list[int | None] = []
    ops: list[OpRecord] = []
    kept_new: list[bool] = []  # per value made here (order None): kept past the program
    earlier = 0
    for i in members:
        op = summary.ops[i]
        if i in late and late[i] not in inside:  # made by an earlier program: held outside
            op = changed(op, allocates=0)
        elif i in repeated and op.storage == i:
            one = op.allocates // blocks
            earlier += op.allocates - one if i in returned else 0
            op = changed(op, allocates=one)
        elif accumulate and op.storage == i and i in summary.output_storages and op.repeat > 1:
            # a scaled summary's block gradient (m_b copies' bytes, planner/scaled.py): its
            # copies are made one after another, each added and freed before the next
            op = changed(op, allocates=op.allocates // op.repeat)
        order.append(i)
        ops.append(op)
        if i in taken_later:
            last = 0  # the last block's copies (or the op's, outside the blocks)
            for g in taken_later[i]:
                one = summary.ops[g].allocates // (blocks if g in repeated else 1)
                last += one
                earlier += one * (blocks - 1) if summary.ops[g].layer is not None else 0
            order.append(None)
            ops.append(OpRecord(f"{op.name} (taken later)", op.role, allocates=last))
            kept_new.append(True)
    back, back_readers = handed_back
    here = [i for i in members if i in back_readers]
    transient = back if here and len(here) == len(back_readers) else 0
    if here and not transient and min(back_readers) in inside:
        # made here, read again by a later program (W): the c - 1 made on the stage kept
        earlier += back * (blocks - 1)
    first = next((k for k, op in enumerate(ops) if op.layer is not None), None)
    made = []  # what the program holds before its last block: (bytes, kept past the program)
    if first is not None:
        made = [(size, kept) for size, kept in ((earlier, True), (transient, False)) if size]
    before = sum(1 for i in order[:first] if i is None) if first is not None else 0
    for k, (size, kept) in enumerate(made):
        order.insert(first + k, None)
        ops.insert(first + k, OpRecord("earlier blocks" if kept else "gradient from the next block",
                                       ops[first + k].role, allocates=size))
        kept_new.insert(before + k, kept)
    where = {i: k for k, i in enumerate(order) if i is not None}
    new = [k for k, i in enumerate(order) if i is None]  # in kept_new's order
    last_reader = where[here[-1]] if transient and first is not None else None
    back_at = new[before + made.index((transient, False))] if last_reader is not None else None
    # the dying values first, as inputs: each its own record (index rec[storage]), the
    # repeated ones' other copies one record after them
    dying = dying or {}
    rec = {x: j for j, x in enumerate(sorted(dying))}
    pre = [OpRecord(f"{summary.ops[x].name} (input)", "input", storage=j,
                    allocates=summary.ops[x].allocates // (blocks if x in repeated else 1))
           for x, j in rec.items()]
    copies = sum(summary.ops[x].allocates - pre[j].allocates for x, j in rec.items())
    categories = {pre[j].name: dying[x] for x, j in rec.items()}
    # the other blocks' copies: up to `earlier` of them freed before the first block op
    # (the op before it and the records it brings), the rest after the last block op
    gone = min(copies, earlier) if first is not None else 0
    spans = [(name, size) for name, size in (("other blocks' inputs, read before", gone),
                                             ("other blocks' inputs", copies - gone)) if size]
    for name, size in spans:
        pre.append(OpRecord(name, "input", storage=len(pre), allocates=size))
        categories[name] = "activations"
    n = len(pre)

    def at(i: int | None) -> int | None:
        if i is None:
            return None
        return where[i] + n if i in where else rec.get(summary.ops[i].storage)

    ops = [changed(op, storage=k + n) if i is None else
           changed(op, uses=tuple(u for u in map(at, op.uses) if u is not None)
                   + ((back_at + n,) if k == last_reader else ()),
                   storage=at(op.storage), waits_on=at(op.waits_on),
                   allocates=op.allocates if op.storage in where else 0)
           for k, (i, op) in enumerate(zip(order, ops))]
    blocks_at = [k for k, op in enumerate(ops) if op.layer is not None]
    for (name, _), index in zip(spans, range(len(rec), n)):
        if name == "other blocks' inputs":  # to the last block op (or the program's end)
            k = blocks_at[-1] if blocks_at else len(ops) - 1
        else:  # to the op before the first block op and what it brings (none: the start)
            k = first - 1
        if k >= 0:
            ops[k] = changed(ops[k], uses=ops[k].uses + (index,))
    returned_at = {where[s] + n for s in returned} | {
        k + n for k, kept in zip(new, kept_new) if kept}
    liveness = graph_liveness(GraphSummary(tuple(pre + ops), (), (), 0, frozenset(returned_at)),
                              dying_inputs=categories)
    grads = 0 if accumulate else sum(summary.ops[s].allocates
                                     for s in summary.output_storages if s in where)
    return liveness, grads


def held_parameters(summary: GraphSummary, layout: Layout, params: list[int]
                    ) -> tuple[int, list[int], int]:
    """As `pipeline_memory.held_parameter_bytes`, from the summary: the bytes of the
    parameters `params` (those a rank's stages read) it holds, of each tensor it
    updates, and of the whole parameters ZeRO-3 gathers for the step."""
    held, updated, gathered = 0, [], 0
    for p in params:
        nbytes = summary.param_numel[p] * summary.param_itemsize[p]
        block = zero_block_bytes(summary, p, layout)
        held += block if layout.zero == 3 and block else nbytes + block
        gathered += nbytes if layout.zero == 3 and block else 0
        updated.append(block or nbytes)
    return held, updated, gathered


def pipeline_memory_from_summary(summary: GraphSummary, stages: StageSummary, layout: Layout,
                                 optimizer: str = "adamw", programs: dict | None = None,
                                 replays: dict | None = None,
                                 ranks: Sequence[int] | None = None,
                                 sends: bool = True) -> list[MemoryPrediction]:
    """Each pipeline rank's predicted peak: its schedule replayed over the summaries.
    `programs`: `stage_programs(summary, stages)`, when the caller keeps it; `replays`:
    a dict the caller keeps for these summaries, where the replays of a schedule are
    kept for the next layout that runs it (they do not depend on dp or ZeRO), and so
    is each rank's share of the parameters. `ranks`:
    only these pipeline ranks (default: all), in that order. `sends` False: a floor of
    each rank's peak that keeps no send past its micro-batch's environment (what stays
    only adds; no schedule.send_releases to work out)."""
    programs = stage_programs(summary, stages) if programs is None else programs
    replays = {} if replays is None else replays
    ranks = range(layout.pp) if ranks is None else ranks
    key = (layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    activity = replays.setdefault(key if sends else (*key, "no sends"), {})  # rank -> replay
    missing = [r for r in ranks if r not in activity]
    if missing:
        across = _across(stages, layout.pp, "dst"), _across(stages, layout.pp, "src")
        if sends:
            schedule = build(*key)
            pairs = tuple(sorted({(m.src, m.dst, m.phase) for m in stages.messages}))
            activity.update({r: _replay_activity(across, programs, schedule.ranks[r],
                                                 _releases(key, r, pairs)) for r in missing})
        else:  # each rank's own actions: nothing of the others' is read
            activity.update({r: _replay_activity(across, programs, rank_actions(*key, r), None)
                             for r in missing})
    if ("held", layout.pp) not in replays:  # what each rank holds: the same for every schedule
        params: list[list[int]] = [[] for _ in range(layout.pp)]
        for p, readers in enumerate(stages.param_stages):
            for rank in {s % layout.pp for s in readers}:
                params[rank].append(p)
        replays["held", layout.pp] = (params, sum(op.allocates for op in summary.ops
                                                  if op.role == "input"))
    params, inputs = replays["held", layout.pp]
    return [_replay_rank(summary, layout, optimizer, activity[r], params[r], inputs)
            for r in ranks]


def stage_programs(summary: GraphSummary, stages: StageSummary, shared: dict | None = None
                   ) -> dict:
    """(stage, "F" | "B" | "I" | "W") -> (liveness, gradient bytes, liveness once its
    gradients have their sums: `_program`'s `accumulate`) of its program (stages of one
    kind computed once); independent of the layout's dp, schedule and ZeRO.
    `shared`: a dict the caller keeps for the replicas of one template, where each kind's
    programs are kept for the other depths (a replicated stage's programs depend on its
    role and block count alone: what it sends or receives is a message, not a use)."""
    kinds = stages.kinds or tuple(range(stages.stages))
    cache = shared if shared is not None and stages.kinds else {}
    out = {}
    keys = [(s, kind, programs, (kinds[s], kind)) for s in range(stages.stages)
            for kind, programs in (("F", "F"), ("B", "IW"), ("I", "I"), ("W", "W"))]
    if any(key not in cache for *_, key in keys):
        readers: dict[int, set[tuple[int, str]]] = {}  # storage -> programs that read it
        for i, op in enumerate(summary.ops):
            for u in op.uses:
                readers.setdefault(summary.ops[u].storage, set()).add(
                    (stages.stage_of[i], stages.program_of[i]))
        for i in stages.handed:  # kept for the stage's next blocks' backward (_handed_on)
            readers.setdefault(i, set()).add((stages.stage_of[i], "W"))
        for i in stages.sent:  # read by another stage: a message, not a use in the replica
            readers.setdefault(i, set()).add((None, "sent"))
        groups = stages.programs()
        repeated = frozenset(stages.repeated)
        back = {s: (size, frozenset(ops)) for s, size, ops in stages.handed_back}
        late = {}  # getitem -> its op, run by another (an earlier) program of the stage
        for i, op in enumerate(summary.ops):
            if op.target == "getitem" and op.uses and op.storage == i:
                source = op.uses[0]
                if stages.stage_of[source] == stages.stage_of[i] is not None \
                        and stages.program_of[source] != stages.program_of[i]:
                    late[i] = source
        kept_apart = set(stages.handed) | set(stages.sent) | set(late)
    for s, kind, programs, key in keys:
        if key not in cache:
            members = sorted(i for p in programs for i in groups.get((s, p), ()))
            dying = _dying(summary, stages, s, programs, readers, kept_apart)
            made = [_program(summary, members, {(s, p) for p in programs}, readers,
                             stages.kinds[s][1] if stages.kinds else 1, repeated,
                             back.get(s, (0, frozenset())), late, accumulate, dying)
                    for accumulate in (False, True)]
            moved: dict[str, int] = {}
            for x, category in dying.items():
                moved[category] = moved.get(category, 0) + summary.ops[x].allocates
            cache[key] = (*made[0], made[1][0], moved)
        out[s, kind] = cache[key]
    return out


_PROGRAM_ORDER = "FIW"  # a stage's programs in the order they run on a micro-batch


def _dying(summary: GraphSummary, stages: StageSummary, s: int, programs: str,
           readers: dict[int, set], kept_apart: set[int]) -> dict[int, str]:
    """Storage -> category ("activations" made by F, "temporaries" by I) of the values an
    earlier program of stage `s` made that `programs` read last: every reader on the
    stage runs no later than them, and the stage does not send them, hand them to
    its next blocks or take them from another program's op (`kept_apart`), as
    PipelineProgram.dying_inputs gives them up in the lowered program."""
    last = max(_PROGRAM_ORDER.index(p) for p in programs)
    upto = {(s, p) for p in _PROGRAM_ORDER[:last + 1]}
    mine = {(s, p) for p in programs}
    out = {}
    for x, who in readers.items():
        if x is None or x in kept_apart or stages.stage_of[x] != s or not summary.ops[x].allocates:
            continue
        maker = (s, stages.program_of[x])
        if summary.ops[x].storage == x and maker not in mine and who & mine and who <= upto:
            out[x] = "activations" if maker[1] == "F" else "temporaries"
    return out


@dataclass(frozen=True)
class _Activity:
    """What one rank's schedule adds to its static memory (parameters, buffers, optimizer
    state, inputs): its highest point (bytes, by category, at which action) and what is
    left at the end (the gradients)."""

    peak: int
    at_peak: dict[str, int]
    label: str
    end: dict[str, int]


def _replay_activity(across: tuple[dict, dict], programs: dict, actions,
                     releases: dict[int, tuple[int, ...]] | None) -> _Activity:
    """One rank's replay, with the rules of pipeline_memory._Replay, without its static
    memory: a constant under the replay, so the peak is at the same action whatever it is.
    `across`: what each (stage, phase) receives and sends across ranks (`_across`);
    `releases`: the rank's schedule.send_releases (None: no send outlives its micro-batch's
    environment)."""
    live = dict.fromkeys(CATEGORIES, 0)
    held = 0  # sum(live.values()), kept as it changes
    peak, label = -1, ""
    at_peak = (dict(live), {})  # at the peak: what is live, and the program's transient
    received, sent_by = across
    env: dict[int, dict[str, int]] = {}
    sends = SentBuffers(releases)
    done = set()
    prepared: dict[tuple[int, str], tuple] = {}  # what one program adds, worked out once
    last = {a.microbatch: i for i, a in enumerate(actions)}
    for i, a in enumerate(actions):
        mb_env = env.setdefault(a.microbatch, {})
        if a.kind in ("F", "B", "I", "W"):
            key = (a.stage, a.kind)
            # its gradients join their sums the first time it runs, are added into them
            # in place after that
            accumulate = key in done and programs[key][1] > 0
            if (key, accumulate) not in prepared:
                plain, grads, summing, moved = programs[key]
                liveness = summing if accumulate else plain
                grads = 0 if accumulate else grads
                mine = "activations" if a.kind == "F" else "temporaries"
                transient = dict(liveness.at_peak)
                transient[mine] += transient.pop("gradients")
                prepared[key, accumulate] = (transient, sum(transient.values()), mine, grads,
                                             max(liveness.outputs_bytes - grads, 0), moved)
            transient, during, mine, grads, kept, moved = prepared[key, accumulate]
            for category, size in moved.items():  # the values it frees, given up to it
                mb_env[category] -= size
                live[category] -= size
                held -= size
            if held + during > peak:
                peak, label, at_peak = held + during, a, (dict(live), transient)
            if key not in done:
                done.add(key)
                live["gradients"] += grads
                held += grads
            mb_env[mine] = mb_env.get(mine, 0) + kept
            live[mine] += kept
            held += kept
        elif a.kind in ("RF", "RB"):
            size = received.get((a.stage, a.kind[1]), 0)
            mb_env["comm_buffers"] = mb_env.get("comm_buffers", 0) + size
            released = sends.received(i)
            live["comm_buffers"] += size - released
            held += size - released
        elif a.kind in ("SF", "SB"):
            sends.sent(i, a.microbatch, sent_by.get((a.stage, a.kind[1]), 0))
        if last[a.microbatch] == i:
            dropped = env.pop(a.microbatch, {})
            for category, size in dropped.items():
                live[category] -= size
            freed = sum(dropped.values())
            kept_sent = sends.dropped(a.microbatch, freed)
            live["comm_buffers"] += kept_sent
            held += kept_sent - freed
    base, transient = at_peak
    return _Activity(max(peak, 0), {c: base[c] + transient.get(c, 0) for c in CATEGORIES},
                     str(label), dict(live))


def _replay_rank(summary, layout, optimizer, activity: _Activity, rank_params, inputs
                 ) -> MemoryPrediction:
    """One rank's peak: its static memory, with the schedule's activity on top, and the
    optimizer step at the end."""
    opt = optimizer_memory(optimizer)
    params, updated, gathered = held_parameters(summary, layout, rank_params)
    static = {"parameters": params, "buffers": summary.buffer_bytes,
              "optimizer_states": int(opt.states * sum(updated) + opt.counter_bytes * len(updated)),
              "inputs": layout.microbatches * inputs}
    during = dict(static)
    during["parameters"] += gathered  # ZeRO-3's whole parameters, held through the step
    total = sum(during.values())
    peak = total + activity.peak
    at_peak = {c: during.get(c, 0) + activity.at_peak.get(c, 0) for c in CATEGORIES}
    label = activity.label
    end = {c: static.get(c, 0) + activity.end.get(c, 0) for c in CATEGORIES}
    end["comm_buffers"] += activity.end["gradients"] if layout.dp > 1 else 0  # flat all-reduce
    end["temporaries"] += int(opt.temporaries * max(updated, default=0))
    if sum(end.values()) > peak:
        peak, at_peak, label = sum(end.values()), end, "optimizer.step"
    return MemoryPrediction(peak, at_peak, "pipeline", label, 0, static)


@functools.lru_cache(maxsize=1024)
def _releases(key: tuple, rank: int, pairs: tuple[tuple[int, int, str], ...]
              ) -> dict[int, tuple[int, ...]]:
    """schedule.send_releases of `build(*key)` on `rank`, with the (src, dst, phase) pairs
    of stages that send each other values (the same for every tp, AMP and micro-batch
    size of a model: kept for all of them)."""
    to: dict[tuple[int, str], list[int]] = {}
    sources: dict[tuple[int, str], list[int]] = {}
    for src, dst, phase in pairs:
        to.setdefault((src, phase), []).append(dst)
        sources.setdefault((dst, phase), []).append(src)
    return send_releases(build(*key), rank, lambda stage, phase: to.get((stage, phase), ()),
                         lambda stage, phase: sources.get((stage, phase), ()))


def _across(stages: StageSummary, pp: int, end: str) -> dict[tuple[int, str], int]:
    """(stage, phase) -> bytes it receives (end="dst") or sends (end="src") per micro-batch
    from or to stages on other ranks."""
    out: dict[tuple[int, str], int] = {}
    for m in stages.messages:
        if m.src % pp != m.dst % pp:
            key = (getattr(m, end), m.phase)
            out[key] = out.get(key, 0) + m.nbytes
    return out
