"""Cost a deep model from a trace of a few of its repeated blocks.

A model whose main stack holds L identical blocks (same class, same shapes: what
`repeated_block_container` finds) is traced with only k of them: the container is
swapped for its first k blocks while tracing, then put back. Each traced block b
stands for m_b of the L real blocks (sum m_b = L, as even as L / k allows), and the
summaries are scaled to the whole model:

- every op of block b runs m_b times (`OpRecord.repeat`: its compute, launch and
  collectives cost m_b times), its model FLOPs are multiplied by m_b, and so are the
  parameters only block b reads (each stands for m_b parameters,
  `GraphSummary.param_copies`: ZeRO-1/2's gather after the optimizer step issues m_b
  gathers of a block's size, not one m_b times larger);
- a block op's storage counts m_b times when it outlives its own pass over the
  blocks: read by the backward though made before it (saved activations, recomputed
  blocks' inputs), or returned by the step (gradients). Storage the forward or the
  backward frees itself (a gathered ZeRO-3 weight, a block's temporaries, the
  gradient one block hands the one before it) counts once, as the real step runs
  the m_b blocks one after another (replicated.py keeps the same rule per stage);
- the gradient buckets (ops of the data-parallel pass, `autopar.bucket`) carry m_b
  times the gradients of each block: their bytes and their collectives' bytes are
  scaled by the ratio of whole-model to traced gradient bytes (fewer, larger
  buckets than the real step: per-message latency is undercounted), and so is their
  storage where the step holds it to its end (the all-reduced buckets, the blocks
  ZeRO-2/3 returns); a bucket let go of before the backward ends (a reduce-scatter's
  input, waited for two buckets later; its packing) counts once: the real step
  holds as few at a time, of the same size;
- gradient accumulation without a pipeline (one stage, several micro-batches) replays
  its stage's programs over the scaled summary (planner/estimate.py), with each block
  parameter split into its m_b copies (`split_copies`): the pipeline cost model sums
  and gathers a stage's parameters one tensor at a time, as the runtime does;
- a pipeline of several stages is costed from a two-block template instead
  (planner/replicated.py), whatever k is.

Nothing else changes: embeddings, head and loss are traced whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from autopar.compiler.analysis.memory import last_uses
from autopar.compiler.analysis.summary import GraphSummary, OpRecord
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import repeated_block_container
from autopar.compiler.ir.graph import TrainGraph, param_layers
from autopar.compiler.planner.stages import StageSummary


def multiplicities(total: int, keep: int) -> tuple[int, ...]:
    """How many of `total` blocks each of `keep` traced blocks stands for."""
    base, extra = divmod(total, keep)
    return tuple(base + (b < extra) for b in range(keep))


@contextlib.contextmanager
def reduced(model: torch.nn.Module, keep: int | None) -> Iterator[tuple[str, int] | None]:
    """The model with its stack cut to its first `keep` blocks (None: all), restored on
    exit. Yields (container path, blocks in the whole model), None if there is no stack."""
    found = repeated_block_container(model)
    if keep is None or found is None or found[1] <= keep:
        yield found
        return
    path, count = found
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    whole = getattr(parent, name)
    setattr(parent, name, type(whole)(list(whole)[:keep]))
    try:
        yield found
    finally:
        setattr(parent, name, whole)


def op_layers(tg: TrainGraph) -> tuple[int | None, ...]:
    """The block of each OpRecord of `summarize(tg)` (user inputs first, then calls)."""
    n_state = len(tg.signature.params) + len(tg.signature.buffers)
    n_inputs = len(tg.placeholders()) - n_state
    return (None,) * n_inputs + tuple(n.meta.get(M.LAYER) for n in tg.call_nodes())


def op_buckets(tg: TrainGraph) -> tuple[bool, ...]:
    n_state = len(tg.signature.params) + len(tg.signature.buffers)
    n_inputs = len(tg.placeholders()) - n_state
    return (False,) * n_inputs + tuple(M.BUCKET in n.meta for n in tg.call_nodes())


def scale_summary(summary: GraphSummary, tg: TrainGraph, counts: tuple[int, ...]) -> GraphSummary:
    """`summary` (of `tg`, traced with len(counts) blocks) as the model of sum(counts)."""
    params = param_layers(tg)
    numel = tuple(n * (counts[b] if b is not None else 1)
                  for n, b in zip(summary.param_numel, params))
    traced = sum(n * s for n, s in zip(summary.param_numel, summary.param_itemsize))
    whole = sum(n * s for n, s in zip(numel, summary.param_itemsize))
    ratio = whole / traced if traced else 1.0
    buckets = op_buckets(tg)
    kept = _kept_storages(summary, buckets)
    held = _held_to_end(summary)
    ops = tuple(_scaled(op, counts[b] if b is not None else None, bucket,
                        ratio, i in held if bucket else i in kept)
                for i, (op, b, bucket) in enumerate(zip(summary.ops, op_layers(tg), buckets)))
    return replace(summary, ops=ops, param_numel=numel,
                   param_copies=tuple(counts[b] if b is not None else 1 for b in params))


def split_copies(summary: GraphSummary, stages: StageSummary
                 ) -> tuple[GraphSummary, StageSummary]:
    """A scaled summary and its stages with each parameter that stands for k copies
    (`param_copies`) listed as k parameters of a k-th of its elements each: what the
    pipeline cost model reads per parameter tensor (rank_params: one collective each)."""
    if not summary.param_copies:
        return summary, stages
    entries = [i for i, k in enumerate(summary.param_copies) for _ in range(k)]

    def pick(values: tuple[int, ...], per_copy: bool = False) -> tuple[int, ...]:
        if not values:
            return ()
        return tuple(values[i] // summary.param_copies[i] if per_copy else values[i]
                     for i in entries)

    return (replace(summary, param_numel=pick(summary.param_numel, per_copy=True),
                    param_itemsize=pick(summary.param_itemsize),
                    param_rows=pick(summary.param_rows), param_blocks=pick(summary.param_blocks),
                    param_copies=()),
            replace(stages, param_stages=tuple(stages.param_stages[i] for i in entries)))


def _held_to_end(summary: GraphSummary) -> frozenset[int]:
    """Storages alive after the last backward op: returned, or made or read (a
    collective's hold on its input until its wait included) after it."""
    ops = summary.ops
    last = max((i for i, op in enumerate(ops) if op.role == "backward"), default=len(ops))
    return frozenset(summary.output_storages) | {
        s for s, use in last_uses(summary).items() if use > last}


def _kept_storages(summary: GraphSummary, buckets: tuple[bool, ...]) -> frozenset[int]:
    """Storages the step returns, read by a gradient bucket (a bucket of the scaled step
    packs the gradients of all m_b copies), or made before the first backward op and
    read from it on; a read is also a collective's hold on its input until its wait."""
    ops = summary.ops
    boundary = next((i for i, op in enumerate(ops) if op.role == "backward"), len(ops))
    kept = set(summary.output_storages)
    for i in range(len(ops)):
        kept.update(s for s in (ops[u].storage for u in summary.reads(i))
                    if s is not None and (buckets[i] or s < boundary <= i))
    return frozenset(kept)


def _scaled(op: OpRecord, count: int | None, bucket: bool, ratio: float, kept: bool) -> OpRecord:
    if count is not None:
        return replace(op, repeat=op.repeat * count, model_flops=op.model_flops * count,
                       allocates=op.allocates * count if kept else op.allocates)
    if bucket:
        return replace(op, bytes=int(op.bytes * ratio), comm_bytes=int(op.comm_bytes * ratio),
                       allocates=int(op.allocates * ratio) if kept else op.allocates)
    return op
