"""The compiled program the runtime executes, and the conventions it shares with the compiler.

The compiler never sees a process group: a collective in the graph names its mesh
dimension through the `group_name` argument, `mesh_group_tag("dp")` ==
"autopar.mesh.dp". The runtime binds each tag to the real group of its DeviceMesh
(`bind_groups`) before running the graph.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

MESH_TAG_PREFIX = "autopar.mesh."
# the name of the trailing fp32 0-dim input of a loss-scaled (fp16 AMP) step: the
# runtime's LossScaler passes the scale; the graph differentiates loss * scale
LOSS_SCALE_INPUT = "loss_scale"


def mesh_group_tag(dim: str) -> str:
    return MESH_TAG_PREFIX + dim


def block_rows(rows: int, parts: int) -> int:
    """Rows of each ZeRO dim-0 block: ceil(rows / parts); the last block is padded with
    zero rows when parts does not divide rows (as FSDP2 pads its shards)."""
    return -(-rows // parts)


def block_nbytes(rows: int, nbytes: int, parts: int) -> int:
    """Bytes of each ZeRO dim-0 block of a tensor of `nbytes` bytes and `rows` rows cut
    into `parts` (block_rows rows each): what a rank holds and updates of it."""
    return block_rows(rows, parts) * (nbytes // rows)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    aliases: tuple[str, ...] = ()
    # tensor parallelism: the dim along which this rank holds one of the `tp` mesh
    # dimension's equal blocks (shape is the block's); None: the whole tensor
    shard_dim: int | None = None
    # > 1 (or a tuple of the pieces' sizes): shard_dim is that many equal pieces (or
    # pieces of those sizes) side by side, and this rank holds its block of each, side
    # by side (tp_rules.Strided, compiler/ir/pieces.py)
    shard_pieces: int | tuple[int, ...] = 1


@dataclass
class Program:
    """One rank's training step: a GraphModule of flat (params, buffers, inputs) ->
    (loss, grads, mutated buffers), and the names that bind it to the model."""

    gm: fx.GraphModule
    params: tuple[TensorEntry, ...]
    buffers: tuple[TensorEntry, ...]
    inputs: tuple[TensorEntry, ...]  # shapes of this rank's slice
    batch_dims: tuple[int | None, ...]
    mutated_buffers: tuple[str, ...]
    mesh: tuple[tuple[str, int], ...]  # (("dp", 2),): mesh dimension names and sizes
    layout: dict = field(default_factory=dict)
    # ZeRO-2: per param, into how many dim-0 blocks its returned gradient is cut (the
    # step returns this rank's block); empty: whole gradients
    grad_blocks: tuple[int, ...] = ()
    # ZeRO-3: per param, into how many dim-0 blocks its input is cut (the step takes this
    # rank's block, entry.shape is the block's, and gathers the whole where it is used)
    param_blocks: tuple[int, ...] = ()
    # batch-decided counts the loss divides by (compiler/ir/batch.LossNormalizer): the
    # step takes each one's mean over the global batch's shards, after the batch inputs
    normalizers: tuple = ()
    # Layout.allreduce="hierarchical": ranks of each dp group on one node (the runtime
    # makes the "dp.local" and "dp.node" process groups from it); 1: a flat all-reduce
    node_split: int = 1

    @property
    def world_size(self) -> int:
        n = 1
        for _, size in self.mesh:
            n *= size
        return n

    def mesh_size(self, dim: str) -> int:
        return dict(self.mesh).get(dim, 1)


def bind_groups(gm: fx.GraphModule, group_names: dict[str, str]) -> fx.GraphModule:
    """A copy of `gm` whose collectives name real process groups instead of mesh tags."""
    gm = copy.deepcopy(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        new_args = tuple(_bind(a, group_names) for a in node.args)
        if new_args != node.args:
            node.args = new_args
    gm.recompile()
    return gm


def _bind(arg, group_names: dict[str, str]):
    if isinstance(arg, str) and arg.startswith(MESH_TAG_PREFIX):
        dim = arg[len(MESH_TAG_PREFIX):]
        if dim not in group_names:
            raise RuntimeError(f"the program communicates over mesh dimension {dim!r}, "
                               f"but the runtime mesh has only {sorted(group_names)}")
        return group_names[dim]
    return arg


# The module the runtime runs for given inputs: a program as compiled, unless a code
# generator whose ops a program holds registers a rule for it (codegen/kernels.py: fused
# regions inline where no kernel would run). A rule maps (module, inputs) to a module.
_RUN_RULES: list[Callable[[fx.GraphModule, list[torch.Tensor]], fx.GraphModule]] = []


def register_run_rule(rule: Callable[[fx.GraphModule, list[torch.Tensor]],
                                     fx.GraphModule]) -> None:
    if rule not in _RUN_RULES:
        _RUN_RULES.append(rule)


def runnable(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> fx.GraphModule:
    """What the runtime runs for `gm` on `inputs` (the registered rules, in order)."""
    for rule in _RUN_RULES:
        gm = rule(gm, inputs)
    return gm
