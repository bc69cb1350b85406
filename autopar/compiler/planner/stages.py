"""StageSummary: what the pipeline cost model needs from a stage-assigned TrainGraph.

Plain data, like GraphSummary (summary.py), indexed the same way: one entry per
OpRecord of `summarize(tg)` (user inputs first, then call nodes in order). For each
op, its pipeline stage and program ("F" forward, "I" backward on the way to the
gradients sent to earlier stages, "W" the rest of the backward: weight gradients);
the bytes each stage receives from other stages per micro-batch; which stages read
each parameter. The stage of a node is the one `AssignStages` gave it (nodes added
after it, like the scaled backward seed, run with their latest input, as in
`lower_pipeline`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import tensor_bytes
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.lowering.lower_pipeline import (
    input_grad_side,
    split_gradient_sums,
)


@dataclass(frozen=True)
class Message:
    """`tensors` values of `nbytes` in all, sent from `src` stage to `dst` stage once per
    micro-batch in phase F or B (the runtime sends each value as its own message)."""

    src: int
    dst: int
    phase: str
    nbytes: int
    tensors: int


@dataclass(frozen=True)
class StageSummary:
    stages: int
    stage_of: tuple[int | None, ...]  # per op of the GraphSummary (None: a user input)
    program_of: tuple[str | None, ...]  # "F", "I" or "W" per op (None: a user input)
    messages: tuple[Message, ...]
    param_stages: tuple[frozenset[int], ...]  # per parameter: the stages that read it
    # per stage: stages with equal entries run identical programs (planner/replicated.py);
    # None: every stage its own
    kinds: tuple | None = None
    # replicated stages: ops whose output the stage's next blocks keep for their backward
    # (replicated._handed_on), counted as read by a later program of the stage
    handed: tuple[int, ...] = ()
    # replicated stages: block ops whose storage counts once per block of their stage
    # (kept for another program of the stage, or handed on; replicated._copy)
    repeated: tuple[int, ...] = ()
    # replicated stages: (stage, bytes, its block ops that read it) of the gradient a stage's
    # blocks hand one another in the backward, which the template's block receives
    handed_back: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    # replicated stages: ops whose value the stage sends to another stage, an output of
    # its program as in the lowered program (in the micro-batch's environment)
    sent: tuple[int, ...] = ()

    def op_copies(self) -> tuple[int, ...] | None:
        """Per op: the stages of its stage's kind (a replica with one stage of each kind
        stands for them all); None when every stage is its own."""
        if not self.kinds:
            return None
        count = Counter(self.kinds)
        return tuple(count[self.kinds[s]] if s is not None else 1 for s in self.stage_of)

    def programs(self) -> dict[tuple[int, str], list[int]]:
        """(stage, program) -> indices of its ops, in order."""
        out: dict[tuple[int, str], list[int]] = {}
        for i, (s, p) in enumerate(zip(self.stage_of, self.program_of)):
            if s is not None:
                out.setdefault((s, p), []).append(i)
        return out

    def members(self, stage: int, programs: str) -> frozenset[int]:
        """Indices of the ops of `stage` whose program is one of `programs` ("F", "IW")."""
        return frozenset(i for i, (s, p) in enumerate(zip(self.stage_of, self.program_of))
                         if s == stage and p is not None and p in programs)


def stage_summary(tg: TrainGraph) -> StageSummary:
    """The stage facts of a graph that `AssignStages` has run on."""
    if "stages_assigned" not in tg.provides:
        raise ValueError("stage_summary needs a graph after the assign_stages pass "
                         f"(this one has: {sorted(tg.provides)})")
    calls = tg.call_nodes()
    stage = {n: n.meta.get(M.STAGE) for n in calls}
    for n in calls:  # inserted after the cut: with its latest input (lower_pipeline's rule)
        if stage[n] is None:
            stage[n] = max((stage.get(a) or 0 for a in n.all_input_nodes), default=0)
    split = split_gradient_sums(tg, stage.__getitem__)
    messages = _messages(calls, stage, split)
    program = _programs(calls, stage, split)
    n_state = len(tg.signature.params) + len(tg.signature.buffers)
    n_inputs = len(tg.placeholders()) - n_state
    params = tg.placeholders()[:len(tg.signature.params)]
    return StageSummary(
        stages=1 + max(stage.values(), default=0),
        stage_of=(None,) * n_inputs + tuple(stage[n] for n in calls),
        program_of=(None,) * n_inputs + tuple(program[n] for n in calls),
        messages=tuple(Message(s, d, ph, *sent) for (s, d, ph), sent in sorted(messages.items())),
        param_stages=tuple(frozenset(stage[u] for u in p.users if u in stage) for p in params))


def _messages(calls: list[fx.Node], stage: dict, split: set[fx.Node]
              ) -> dict[tuple[int, int, str], tuple[int, int]]:
    """(src, dst, phase) -> (bytes, count) of the distinct values a stage's program reads
    from another stage's (as the pipeline runtime sends them, once per micro-batch; not
    a shared weight's gradient term read by a sum the lowering splits: `split`)."""
    out: dict[tuple[int, int, str], tuple[int, int]] = {}
    for n in calls:
        phase = "B" if n.meta[M.ROLE] == M.Role.BACKWARD else "F"
        for dst in sorted({stage[u] for u in n.users if u in stage and u not in split}
                          - {stage[n]}):
            key = (stage[n], dst, phase)
            nbytes, count = out.get(key, (0, 0))
            out[key] = (nbytes + tensor_bytes(n.meta.get(M.VAL)), count + 1)
    return out


def _programs(calls: list[fx.Node], stage: dict, split: set[fx.Node]) -> dict[fx.Node, str]:
    """F for forward ops; the backward split as the zero-bubble lowering splits it (a term
    of a shared weight's gradient that `split` sums across stages is the stage's part of
    it, not a value sent: lower_pipeline._split_shared_gradients)."""
    sent = {n for n in calls if n.meta[M.ROLE] == M.Role.BACKWARD
            and any(u in stage and stage[u] != stage[n] and u not in split for u in n.users)}
    out: dict[fx.Node, str] = {}
    for s in sorted(set(stage.values())):
        backward = [n for n in calls if stage[n] == s and n.meta[M.ROLE] == M.Role.BACKWARD]
        needed = input_grad_side(backward, {n.name for n in backward if n in sent})
        for n in backward:
            out[n] = "I" if n in needed else "W"
    for n in calls:
        out.setdefault(n, "F")
    return out
