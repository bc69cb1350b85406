"""Memory of a pipelined step (pp > 1 or micro-batches): the rank's schedule replayed.

The pipeline runtime (`runtime/pipeline.py`) keeps one environment of values per
micro-batch in flight: what its forward programs produce (activations the backward
reads, values to send), what it receives, what its backward programs produce; the
environment is dropped after the micro-batch's last action on the rank. Gradient
parts are summed into one accumulator per part: the first micro-batch's parts become
the sums, and a later program adds each part into its sum as it makes it
(`pipeline_program.accumulating`), so there the part is freed at its last use instead
of being returned; a sent tensor stays alive until the
rank's first receive that proves its receiver has it (`schedule.send_releases`), even
when its micro-batch's environment was dropped before (`SentBuffers`). So the peak
depends on how many micro-batches the schedule keeps in flight on the rank: a 1F1B
stage holds up to `pp - stage` of them, GPipe all `microbatches`.

`pipeline_memory` walks the rank's actions in order with those rules. Each F / B /
I / W action adds its program's own transient peak (liveness over the program,
`memory.graph_liveness`, its inputs held outside it) on top of what is alive. After
the schedule come the gradient sum over data-parallel ranks (one flat buffer with
dp > 1) and the optimizer step, as for an unpipelined step.
"""

from __future__ import annotations

import math
from dataclasses import replace

from autopar.compiler.analysis.memory import (
    CATEGORIES,
    MemoryPrediction,
    OptimizerMemory,
    graph_liveness,
    optimizer_memory,
)
from autopar.compiler.analysis.summary import summarize_program
from autopar.compiler.ir.pipeline_program import PROGRAM_KINDS, PipelineProgram
from autopar.compiler.ir.program import block_nbytes


def _bytes(program: PipelineProgram, key: str) -> int:
    spec = program.values[key]
    return math.prod(spec.shape) * spec.dtype.itemsize


class SentBuffers:
    """The bytes of one rank's sends that outlive their micro-batch's environment. A value
    sent is part of the environment; when the environment is dropped, what is not yet
    known received stays (as comm_buffers, at most the environment's bytes) until the
    receive `releases` names (schedule.send_releases) lets go of it."""

    def __init__(self, releases: dict[int, tuple[int, ...]] | None) -> None:
        self.releases = releases  # None: none stays (a floor: what stays only adds to it)
        self.unreleased: dict[int, dict[int, int]] = {}  # micro-batch -> {send: bytes}
        self.microbatch_of: dict[int, int] = {}  # send -> its micro-batch
        self.kept: dict[int, tuple[int, int]] = {}  # dropped micro-batch -> (kept, its env)

    def sent(self, index: int, mb: int, nbytes: int) -> None:
        self.unreleased.setdefault(mb, {})[index] = nbytes
        self.microbatch_of[index] = mb

    def dropped(self, mb: int, freed: int) -> int:
        """Bytes of micro-batch `mb`'s environment (`freed` in all) that stay."""
        if self.releases is None:
            return 0
        kept = min(sum(self.unreleased.get(mb, {}).values()), freed)
        if kept:
            self.kept[mb] = (kept, freed)
        return kept

    def received(self, index: int) -> int:
        """Bytes let go of after receive action `index`."""
        freed = 0
        for j in (self.releases or {}).get(index, ()):
            mb = self.microbatch_of.pop(j)
            self.unreleased.get(mb, {}).pop(j, None)
            if mb in self.kept:
                kept, env = self.kept[mb]
                now = min(sum(self.unreleased[mb].values()), env)
                freed += kept - now
                self.kept[mb] = (now, env)
        return freed


class _Replay:
    """Bytes alive on one rank while its actions run."""

    def __init__(self, program: PipelineProgram, pp_rank: int, regions_inline: bool = False):
        self.program, self.pp = program, program.schedule.pp
        self.regions_inline = regions_inline
        self.stages = {p.stage: p for p in program.stages if p.stage % self.pp == pp_rank}
        self.part_keys = {k for parts in program.grad_parts for k in parts}
        # the parts that leave the environment for their sums (the others are also sent)
        self.leaving = self.part_keys - program.values_read()
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.env: dict[int, dict[str, int]] = {}  # micro-batch -> its environment's bytes
        # the storages of the values the rank made (the ones a program may free:
        # PipelineProgram.dying_inputs), per micro-batch: key -> its storage's id, and
        # id -> [the keys naming it still in the environment, its bytes, its category]
        self.env_keys: dict[int, dict[str, int]] = {}
        self.env_storages: dict[int, dict[int, list]] = {}
        self.dying = program.dying_inputs(pp_rank)
        self.sends = SentBuffers(program.send_releases(pp_rank))
        self.grads: set[str] = set()
        self.peak, self.at_peak, self.peak_op = 0, dict(self.live), ""
        self._programs: dict[tuple[int, str], tuple] = {}
        self._liveness_memo: dict[tuple, object] = {}

    def _program(self, stage: int, kind: str):
        """(module, input keys, output keys, summary) of the stage's program."""
        if (stage, kind) not in self._programs:
            gm, inputs, outputs = self.stages[stage].program(kind)
            self._programs[stage, kind] = (gm, inputs, outputs, summarize_program(gm))
        return self._programs[stage, kind]

    def _liveness(self, stage: int, kind: str, accumulate: bool = False,
                  moved: tuple[tuple[tuple[str, ...], int, str], ...] = ()):
        """The liveness of the stage's program; `accumulate`: as the runtime runs it once
        its gradient parts have their sums (pipeline_program.accumulating), each part
        freed at its last use instead of returned; `moved`: (input keys naming one
        storage, its bytes, its category) for each storage the environment gave up to
        the program, freed after its last use inside it."""
        key = (stage, kind, accumulate, moved)
        if key not in self._liveness_memo:
            gm, inputs, outputs, summary = self._program(stage, kind)
            placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
            order = {name: i for i, name in enumerate(placeholders)}
            names = dict(zip(inputs, placeholders))
            owned, categories = {}, {}
            for keys, size, category in moved:
                first, *aliases = sorted((names[k] for k in keys), key=order.__getitem__)
                owned[first], categories[first] = (first, size), category
                owned.update((alias, (first, 0)) for alias in aliases)
            if owned:
                summary = summarize_program(gm, owned)
            if accumulate:
                summary = replace(summary, output_storages=summary.output_storages
                                  - _part_storages(gm, summary, outputs, self.leaving))
            self._liveness_memo[key] = graph_liveness(summary, self.regions_inline, categories)
        return self._liveness_memo[key]

    def note(self, label: str, extra: dict[str, int]) -> None:
        total = sum(self.live.values()) + sum(extra.values())
        if total > self.peak:
            self.peak, self.peak_op = total, label
            self.at_peak = {c: self.live[c] + extra.get(c, 0) for c in CATEGORIES}

    def act(self, index: int, action) -> None:
        self.env.setdefault(action.microbatch, {})
        if action.kind in PROGRAM_KINDS:
            self._compute(action, self.dying.get(index, ()))
        elif action.kind in ("RF", "RB"):
            sources = self.program.receives(action.stage,
                                            "forward" if action.kind == "RF" else "backward")
            self._add_env(action.microbatch, self._bytes_across(action.stage, sources),
                          "comm_buffers")
            self.live["comm_buffers"] -= self.sends.received(index)
        elif action.kind in ("SF", "SB"):
            stage = self.stages[action.stage]
            table = stage.send_forward if action.kind == "SF" else stage.send_backward
            self.sends.sent(index, action.microbatch, self._bytes_across(action.stage, table))

    def _compute(self, action, dying: tuple[str, ...] = ()) -> None:
        """A program runs: its own peak on top of what is alive, the environment's values
        it reads last (`dying`) moved into it, freed after their last use there; then its
        gradient parts join their accumulators and its other outputs the micro-batch's
        environment."""
        outputs = self._program(action.stage, action.kind)[2]
        parts = [k for k in outputs if k in self.part_keys]
        accumulate = bool(parts) and self.grads.issuperset(parts)
        moved = self._take_env(action.microbatch, dying)
        liveness = self._liveness(action.stage, action.kind, accumulate, moved)
        mine = "activations" if action.kind == "F" else "temporaries"
        transient = dict(liveness.at_peak)
        transient[mine] += transient.pop("gradients")  # its outputs, alive at its peak
        self.note(str(action), transient)
        self.live["gradients"] += sum(_bytes(self.program, k) for k in parts if k not in self.grads)
        self.grads.update(parts)
        kept = liveness.outputs_bytes - (0 if accumulate else sum(
            _bytes(self.program, k) for k in parts if k in self.leaving))
        self._add_env(action.microbatch, max(kept, 0), mine)
        for keys, size in self._output_storages(action.stage, action.kind):
            keys = tuple(k for k in keys if k not in parts or k not in self.leaving)
            if keys:
                self._name_env(action.microbatch, keys, size, mine)

    def _output_storages(self, stage: int, kind: str) -> list[tuple[tuple[str, ...], int]]:
        """(the output keys naming it, its bytes) of each storage the program makes and
        returns: what the environment holds of it (an output that views an input or a
        parameter names no storage of the program's and frees nothing when let go of)."""
        gm, _, outputs, summary = self._program(stage, kind)
        return [(tuple(keys), summary.ops[s].allocates)
                for s, keys in _returned_storages(gm, summary, outputs).items()
                if summary.ops[s].allocates]

    def _name_env(self, mb: int, keys: tuple[str, ...], size: int, category: str) -> None:
        """One storage of `size` bytes, in `category`, named by `keys` in the environment."""
        storages = self.env_storages.setdefault(mb, {})
        sid = len(storages)
        storages[sid] = [set(keys), size, category]
        self.env_keys.setdefault(mb, {}).update(dict.fromkeys(keys, sid))

    def _take_env(self, mb: int, dying: tuple[str, ...]
                  ) -> tuple[tuple[tuple[str, ...], int, str], ...]:
        """The environment lets go of the keys `dying` for the program about to run: each
        storage no other key of the environment names moves into the program (its bytes
        leave the environment), as (its keys, bytes, category); the others stay."""
        moved, keys_of = [], self.env_keys.get(mb, {})
        for sid in dict.fromkeys(keys_of[k] for k in dying if k in keys_of):
            keys, size, category = self.env_storages[mb][sid]
            going = keys.intersection(dying)
            keys -= going
            if not keys and size <= self.env[mb].get(category, 0):
                del self.env_storages[mb][sid]
                self.env[mb][category] -= size
                self.live[category] -= size
                moved.append((tuple(sorted(going)), size, category))
        for k in dying:
            keys_of.pop(k, None)
        return tuple(moved)

    def _bytes_across(self, stage: int, by_stage: dict[int, tuple[str, ...]]) -> int:
        """Bytes of the values exchanged with stages on other ranks (a later stage on
        this rank, under interleaving, reads the same environment)."""
        return sum(_bytes(self.program, k) for other, keys in by_stage.items()
                   if other % self.pp != stage % self.pp for k in keys)

    def _add_env(self, mb: int, size: int, category: str) -> None:
        self.env[mb][category] = self.env[mb].get(category, 0) + size
        self.live[category] += size

    def drop(self, mb: int) -> None:
        """The micro-batch's environment is released; what is not known received is not."""
        env = self.env.pop(mb, {})
        self.env_keys.pop(mb, None)
        self.env_storages.pop(mb, None)
        for category, size in env.items():
            self.live[category] -= size
        self.live["comm_buffers"] += self.sends.dropped(mb, sum(env.values()))


def _returned_storages(gm, summary, outputs: tuple[str, ...]) -> dict[int, list[str]]:
    """Storage -> the output keys of the program that return it (views included)."""
    ops = {op.name: op for op in summary.ops}
    returned = gm.graph.output_node().args[0]
    returned = returned if isinstance(returned, (tuple, list)) else (returned,)
    storages: dict[int, list[str]] = {}
    for key, node in zip(outputs, returned):
        op = ops.get(getattr(node, "name", None))
        if op is not None and op.storage is not None:
            storages.setdefault(op.storage, []).append(key)
    return storages


def _part_storages(gm, summary, outputs: tuple[str, ...], part_keys: set[str]) -> frozenset:
    """The storages of the program's outputs that are gradient parts."""
    return frozenset(s for s, keys in _returned_storages(gm, summary, outputs).items()
                     if part_keys.intersection(keys))


def held_parameter_bytes(program: PipelineProgram, pp_rank: int) -> tuple[int, list[int], int]:
    """Bytes of the parameters this rank holds between steps (those its stages read), of
    each tensor its optimizer updates, and of the whole parameters it gathers for the
    step. The optimizer updates the parameter, or under ZeRO a dim-0 block of
    ceil(rows / dp) rows when it has at least dp rows: held beside the parameter under
    ZeRO-1/2, instead of it under ZeRO-3 (whose step gathers the parameter)."""
    dp = dict(program.mesh).get("dp", 1)
    zero = program.layout.get("zero", 0)
    held, updated, gathered = 0, [], 0
    for key, entry, parts in zip(program.keys, program.params, program.grad_parts):
        if not any(s % program.schedule.pp == pp_rank
                   for s in program.stages_reading(key, parts)):
            continue
        nbytes = math.prod(entry.shape) * entry.dtype.itemsize
        rows = entry.shape[0] if entry.shape else 0
        block = block_nbytes(rows, nbytes, dp) if zero and rows >= dp else 0
        held += block if zero == 3 and block else nbytes + block
        gathered += nbytes if zero == 3 and block else 0
        updated.append(block or nbytes)
    return held, updated, gathered


def pipeline_memory(program: PipelineProgram, pp_rank: int,
                    optimizer: str | OptimizerMemory = "adamw",
                    regions_inline: bool = False) -> MemoryPrediction:
    """The predicted peak of pipeline rank `pp_rank`'s step (`regions_inline`: fused regions
    run their eager fallback, as on a CPU: memory.graph_liveness)."""
    opt = optimizer_memory(optimizer)
    params, updated, gathered = held_parameter_bytes(program, pp_rank)
    m = program.schedule.microbatches
    static = {"parameters": params,
              "buffers": sum(math.prod(b.shape) * b.dtype.itemsize for b in program.buffers),
              "optimizer_states": int(opt.states * sum(updated) + opt.counter_bytes * len(updated)),
              "inputs": m * sum(math.prod(e.shape) * e.dtype.itemsize for e in program.inputs)}
    replay = _Replay(program, pp_rank, regions_inline)
    replay.live.update(static)
    replay.live["parameters"] += gathered  # ZeRO-3: gathered for the schedule
    actions = program.schedule.ranks[pp_rank]
    last = {a.microbatch: i for i, a in enumerate(actions)}
    for i, action in enumerate(actions):
        replay.act(i, action)
        if last[action.microbatch] == i:
            replay.drop(action.microbatch)
    dp = dict(program.mesh).get("dp", 1)
    flat = replay.live["gradients"] if dp > 1 else 0  # the gradients packed for the all-reduce
    replay.live["parameters"] -= gathered  # dropped before the optimizer step
    replay.note("optimizer.step", {"comm_buffers": flat,
                                   "temporaries": int(opt.temporaries * max(updated, default=0))})
    return MemoryPrediction(replay.peak, replay.at_peak, "pipeline", replay.peak_op,
                            0, static)


def pipeline_memory_per_rank(tg, layout, optimizer: str | OptimizerMemory = "adamw",
                             regions_inline: bool = False) -> list[MemoryPrediction]:
    """Each pipeline rank's predicted peak for a stage-assigned TrainGraph under `layout`."""
    from autopar.compiler.lowering.lower_pipeline import lower_pipeline

    program = lower_pipeline(tg, layout)
    return [pipeline_memory(program, rank, optimizer, regions_inline) for rank in range(layout.pp)]
