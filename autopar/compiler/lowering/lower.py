"""Lower a rewritten TrainGraph to the runtime's Program (the serialisable hand-off)."""

from __future__ import annotations

from autopar.compiler.ir.graph import TensorSpec, TrainGraph
from autopar.compiler.ir.program import Program, TensorEntry
from autopar.layout import Layout


def _entry(spec: TensorSpec) -> TensorEntry:
    return TensorEntry(spec.name, spec.shape, spec.dtype, spec.aliases, spec.shard_dim,
                       spec.shard_pieces)


def mesh_dims(layout: Layout) -> tuple[tuple[str, int], ...]:
    """Mesh dimensions, outermost first (tp innermost: its ranks are neighbours); dp is
    kept at size 1 so its name resolves."""
    return (("dp", layout.dp),) + ((("tp", layout.tp),) if layout.tp > 1 else ())


def to_program(tg: TrainGraph, layout: Layout) -> Program:
    sig = tg.signature
    return Program(
        gm=tg.gm,
        params=tuple(_entry(p) for p in sig.params),
        buffers=tuple(_entry(b) for b in sig.buffers),
        inputs=tuple(_entry(i) for i in sig.inputs),
        batch_dims=sig.batch_dims,
        mutated_buffers=sig.mutated_buffers,
        mesh=mesh_dims(layout),
        layout=layout.to_dict(),
        grad_blocks=sig.grad_blocks,
        param_blocks=sig.param_blocks,
        normalizers=tg.loss_normalizers,
        node_split=tg.attrs.get("dp_node_split", 1),
    )
