"""The kernels of a fused TrainGraph as files: `autopar kernels MODEL --out DIR`.

Each fused node's Triton source, specialised to the shapes and strides its inputs have
in the graph, goes to `DIR/<kernel>.py`; `DIR/kernels.json` lists every kernel with its
kind, the ops it replaced, its module, role and the bytes it moves.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from autopar.compiler.codegen.kernels import FUSED_OP, region
from autopar.compiler.codegen.triton_gen import TensorArg
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph


def kernel_rows(tg: TrainGraph) -> list[dict]:
    """One row per fused node: its generated source and what it stands for."""
    rows = []
    for node in tg.call_nodes():
        if node.target != FUSED_OP:
            continue
        fused = region(node.args[0])
        vals = [a.meta[M.VAL] for a in node.args[1]]
        src = fused.source([TensorArg(tuple(v.shape), tuple(v.stride()), v.dtype) for v in vals])
        ops = [str(n.target) for n in fused.gm.graph.nodes
               if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
        rows.append({"kernel": src.name, "node": node.name, "kind": src.kind, "grid": src.grid,
                     "block": src.block, "ops": ops, "module": node.meta.get(M.MODULE_PATH),
                     "role": node.meta[M.ROLE].value, "bytes": node.meta.get(M.BYTES, 0),
                     "source": src.text})
    return rows


def write_kernels(tg: TrainGraph, out_dir: str | Path) -> list[dict]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = kernel_rows(tg)
    for row in rows:
        (out / f"{row['kernel']}.py").write_text(row["source"])
    index = [{k: v for k, v in row.items() if k != "source"} for row in rows]
    (out / "kernels.json").write_text(json.dumps(index, indent=1))
    return index
