"""TrainGraph: one FX graph holding forward, loss and backward of a training step.

The graph is a function of flat inputs, in this order:

    params..., buffers..., user inputs...   ->   (loss, grad per param..., new value per mutated buffer...)

`GraphSignature` names each placeholder and each output. A pass edits only a graph no one
else holds: `TrainGraph.copy()` gives it its own, unless the PassManager hands it one
that the pass before it made in the same run (`passes.base.writable`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.compiler.ir import meta as M


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one graph input (parameter, buffer or user input)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights)
    # tensor parallelism: the dim this rank holds one block of (shape is the block's)
    shard_dim: int | None = None
    # > 1 (or a tuple of the pieces' sizes): shard_dim is that many equal pieces (or
    # pieces of those sizes) side by side, and the rank holds one block of each
    # (tp_rules.Strided, compiler/ir/pieces.py)
    shard_pieces: int | tuple[int, ...] = 1

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class GraphSignature:
    params: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]
    inputs: tuple[TensorSpec, ...]
    # names of the buffers the step writes (e.g. BatchNorm running stats), in output order
    mutated_buffers: tuple[str, ...] = ()
    # input index -> dim split across data-parallel ranks (None: replicated input)
    batch_dims: tuple[int | None, ...] = ()
    # ZeRO-2: param index -> into how many dim-0 blocks its gradient output is cut (the
    # step returns this rank's block); empty: every gradient whole
    grad_blocks: tuple[int, ...] = ()
    # ZeRO-3: param index -> into how many dim-0 blocks the step's input is cut (params[i]
    # then has the block's shape, and the step gathers the rest); empty: whole inputs
    param_blocks: tuple[int, ...] = ()

    def grad_shape(self, param_index: int) -> tuple[int, ...]:
        """Shape of the step's gradient output for a parameter (its block under ZeRO-2)."""
        shape = self.params[param_index].shape
        blocks = self.grad_blocks[param_index] if self.grad_blocks else 1
        return shape if blocks == 1 else (-(-shape[0] // blocks),) + tuple(shape[1:])

    @property
    def num_placeholders(self) -> int:
        return len(self.params) + len(self.buffers) + len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return 1 + len(self.params) + len(self.mutated_buffers)

    def grad_output_index(self, param_index: int) -> int:
        return 1 + param_index

    def param_names(self) -> list[str]:
        return [p.name for p in self.params]


@dataclass
class TrainGraph:
    """A joint training-step graph plus what passes have established about it."""

    gm: fx.GraphModule
    signature: GraphSignature
    provides: frozenset[str] = frozenset({"traced"})
    history: tuple[str, ...] = ()
    # per-graph facts passes record for later passes and the runtime (JSON-able values)
    attrs: dict = field(default_factory=dict)
    # how to trace the joint graph again (autopar.compiler.ir.trace.TraceSource), for
    # passes that change the forward pass and let autograd derive the backward
    source: Any = None
    # True: `source` has a forward hook `gm` was not traced with yet; the next pass
    # re-traces from the source anyway (trace.retrace(..., deferred=True); the
    # PassManager traces it, `trace.complete_pending_retrace`, before any other pass)
    retrace_pending: bool = False
    # counts the loss divides by that the batch decides (global_loss_mean.py): the step
    # takes each one's mean over the global batch's shards as an input
    loss_normalizers: tuple = ()

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def output_node(self) -> fx.Node:
        return self.graph.output_node()

    def outputs(self) -> list[fx.Node]:
        return list(self.output_node().args[0])

    def loss_node(self) -> fx.Node:
        return self.outputs()[0]

    def grad_nodes(self) -> list[fx.Node]:
        """The node giving each parameter's gradient, in parameter order."""
        outs = self.outputs()
        return outs[1:1 + len(self.signature.params)]

    def copy(self) -> TrainGraph:
        """A deep copy of the graph (node metadata included) for a pass to rewrite."""
        graph = fx.Graph()
        value_map: dict[fx.Node, fx.Node] = {}
        out = graph.graph_copy(self.graph, value_map)
        graph.output(out)
        for old, new in value_map.items():
            new.meta = dict(old.meta)
        out_node = graph.output_node()
        out_node.meta = dict(self.output_node().meta)
        # NOTE: lazy: its Python code is generated when it first runs or is read, not
        # after every pass (the planner rewrites graphs it only costs, never runs)
        gm = _LazyGraphModule(self.gm, graph)
        return dataclasses.replace(self, gm=gm, attrs=copy.deepcopy(self.attrs))

    def call_nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function"]

    def nodes_by_role(self) -> dict[M.Role, list[fx.Node]]:
        out: dict[M.Role, list[fx.Node]] = {r: [] for r in M.Role}
        for n in self.call_nodes():
            out[n.meta[M.ROLE]].append(n)
        return out

    def total_flops(self) -> int:
        return sum(n.meta.get(M.FLOPS, 0) for n in self.call_nodes())


def new_node_meta(val, role: M.Role, created_by: str, module_path: str | None = None,
                  **extra) -> dict:
    """Metadata for a node a pass inserts (the verifier requires these keys)."""
    meta = {M.VAL: val, M.ROLE: role, M.MODULE_PATH: module_path, M.CREATED_BY: created_by,
            M.FLOPS: 0, M.BYTES: 0}
    meta.update(extra)
    return meta


def param_layers(tg: TrainGraph) -> tuple[int | None, ...]:
    """The block of each parameter: the one block all its forward readers (else all its
    readers) belong to, else None. NOTE: forward first, because a fused backward region
    can cross a block boundary and carry its last op's block (fuse_regions._replace): a
    block's layer-norm weight is then also read by an op outside the blocks."""
    out = []
    for node in tg.placeholders()[:len(tg.signature.params)]:
        forward = [u for u in node.users if u.meta.get(M.ROLE) != M.Role.BACKWARD]
        layers = {u.meta.get(M.LAYER) for u in (forward or node.users)}
        out.append(layers.pop() if len(layers) == 1 else None)
    return tuple(out)
