"""Every rank's collectives checked against its peers' before a step runs.

A collective is only correct when every rank of its group calls it, in the same order,
with the same shape and dtype: a rank whose program differs (a pass that decided
otherwise on one rank, a plan that differed) would hang or silently combine the wrong
tensors. `program_collectives` lists the collectives of a rank's program in the order
it runs them, per program part (the step's graph; a pipeline stage's forward,
backward, input- and weight-gradient programs); `check_collectives` compares, for each
mesh dimension, the lists of the ranks of every group of that dimension, and raises
CollectiveMismatch naming the rank, the node and the two operations at the first
difference.

Scope: the collectives in the programs' graphs (tensor parallelism's, the data-parallel
gradient buckets, ZeRO's gathers and reduce-scatters). A pipeline's sends and receives
are not in the graphs: they follow its Schedule, which `schedule.build` checks pairs
every send with its receive and cannot deadlock. The pipeline dimension's stages hold
different programs by design, so only the other dimensions are compared there.

`autopar.compile` runs the check on every multi-process launch, exchanging the lists
(plain tuples, a few KB) with one all_gather_object; `autopar check` builds every rank's
program in one process, without launching any (cli.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from autopar.compiler.ir.program import MESH_TAG_PREFIX


class CollectiveMismatch(RuntimeError):
    """Two ranks of one group would run different collectives; the message names them."""


class Collective(NamedTuple):
    """One collective of a program, as the check compares it (plain data: picklable)."""

    op: str  # "all_reduce", "all_gather_into_tensor", ...
    group: str  # the mesh dimension ("dp", "tp")
    shape: tuple[int, ...]  # of its input
    dtype: str
    detail: tuple  # its other arguments (reduce op, group size)
    node: str  # the node's name, for the message
    where: str  # its module and source line, for the message

    def describe(self) -> str:
        extra = ", ".join(map(str, self.detail))
        return (f"{self.op}({self.dtype}{list(self.shape)}{', ' + extra if extra else ''}) "
                f"over '{self.group}'")

    def key(self) -> tuple:
        """What must agree across the group."""
        return (self.op, self.group, self.shape, self.dtype, self.detail)


def collectives_of(gm: fx.GraphModule) -> list[Collective]:
    """The collectives of `gm`, in the order it runs them: each call whose arguments name
    a mesh dimension (`mesh_group_tag`)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        tags = [a for a in node.args if isinstance(a, str) and a.startswith(MESH_TAG_PREFIX)]
        if not tags:
            continue
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        val = tensors[0].meta.get("val") if tensors else None
        detail = tuple(a for a in node.args if not isinstance(a, fx.Node) and a not in tags)
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
        dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "?"
        out.append(Collective(_op_name(node.target), tags[0][len(MESH_TAG_PREFIX):], shape,
                              dtype, detail, node.name, _where(node)))
    return out


def _op_name(target: Any) -> str:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    module = list(stack.values())[-1][0] if stack else None
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    # the innermost frame outside torch itself: the model's (or the loss's) own line
    frames = [t.strip() for t in trace if t.strip().startswith("File ")]
    line = next((f for f in reversed(frames) if "/torch/" not in f), frames[-1] if frames else "")
    return ", ".join(p for p in (module, line) if p) or "no source recorded"


def program_collectives(program: Any) -> dict[str, list[Collective]]:
    """A rank's program's collectives per part: {"step": ...} for a Program; for a
    PipelineProgram, "stage <s> forward" / "backward" (and zero-bubble's "input grad" /
    "weight grad") of each stage this program holds."""
    if hasattr(program, "gm"):
        return {"step": collectives_of(program.gm)}
    out = {}
    for stage in program.stages:
        out[f"stage {stage.stage} forward"] = collectives_of(stage.forward)
        out[f"stage {stage.stage} backward"] = collectives_of(stage.backward)
        for name, part in (("input grad", stage.input_grad), ("weight grad", stage.weight_grad)):
            if part is not None:
                out[f"stage {stage.stage} {name}"] = collectives_of(part[0])
    return out


def group_members(mesh: Sequence[tuple[str, int]], dim: str) -> list[list[int]]:
    """The ranks of each group of mesh dimension `dim` (ranks numbered row-major over
    `mesh`, its last dimension innermost, as the runtime's DeviceMesh numbers them)."""
    names = [name for name, _ in mesh]
    sizes = [size for _, size in mesh]
    axis = names.index(dim)
    groups: dict[tuple, list[int]] = {}
    for rank, coords in enumerate(itertools.product(*(range(s) for s in sizes))):
        groups.setdefault(coords[:axis] + coords[axis + 1:], []).append(rank)
    return list(groups.values())


def node_split_members(mesh: Sequence[tuple[str, int]], local: int) -> dict[str, list[list[int]]]:
    """The groups of a hierarchical all-reduce's two levels (Program.node_split = `local`):
    "dp.local", each dp group's runs of `local` ranks; "dp.node", the ranks at the same
    place in each run (the runtime's Mesh.split_dp makes the same)."""
    rows = group_members(mesh, "dp")
    return {"dp.local": [row[k:k + local] for row in rows for k in range(0, len(row), local)],
            "dp.node": [row[j::local] for row in rows for j in range(local)]}


def check_collectives(by_rank: Mapping[int, Mapping[str, Sequence[Collective]]],
                      mesh: Sequence[tuple[str, int]], node_split: int = 1) -> int:
    """Raise CollectiveMismatch at the first collective two ranks of one group would run
    differently (order, kind, shape, dtype, arguments, or one rank running more); the
    number of collectives compared otherwise. `by_rank`: program_collectives of every
    rank (all_gather_object sends them as they are: plain named tuples). `node_split`:
    the hierarchical all-reduce's two levels are compared as groups of their own."""
    compared = 0
    groups = {dim: group_members(mesh, dim) for dim, size in mesh if size > 1 and dim != "pp"}
    if node_split > 1:
        groups.update(node_split_members(mesh, node_split))
    for dim, all_members in groups.items():
        for members in all_members:
            first = members[0]
            for rank in members[1:]:
                compared += _compare(first, by_rank[first], rank, by_rank[rank], dim)
    return compared


def _compare(a_rank: int, a_parts: Mapping[str, Sequence], b_rank: int,
             b_parts: Mapping[str, Sequence], dim: str) -> int:
    if set(a_parts) != set(b_parts):
        raise CollectiveMismatch(
            f"ranks {a_rank} and {b_rank} of a '{dim}' group hold different programs: "
            f"{sorted(a_parts)} against {sorted(b_parts)}")
    compared = 0
    for part in a_parts:
        mine = [c for c in a_parts[part] if c.group == dim]
        theirs = [c for c in b_parts[part] if c.group == dim]
        for i, (x, y) in enumerate(itertools.zip_longest(mine, theirs)):
            if x is not None and y is not None and x.key() == y.key():
                continue
            raise CollectiveMismatch(
                f"ranks {a_rank} and {b_rank} of one '{dim}' group disagree at their "
                f"collective {i + 1} over '{dim}' in {part}: rank {a_rank} runs {_said(x)}; "
                f"rank {b_rank} runs {_said(y)}")
        compared += len(mine)
    return compared


def _said(c: Collective | None) -> str:
    if c is None:
        return "nothing (its program has no more collectives there)"
    return f"{c.describe()} at node {c.node} ({c.where})"


__all__ = ["Collective", "CollectiveMismatch", "check_collectives", "collectives_of",
           "group_members", "node_split_members", "program_collectives"]
