"""Text forms of a TrainGraph: the IR listing (dumps, golden tests) and a summary table."""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import tensor_bytes
from autopar.compiler.ir.graph import TrainGraph


def _type_of(val) -> str:
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}{list(val.shape)}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_type_of(v) for v in val) + ")"
    return "" if val is None else type(val).__name__


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        base = target._schema.name.split("::")[-1]
        overload = target._overloadname
        name = base if overload == "default" else f"{base}.{overload}"
        return name if ns == "aten" else f"{ns}.{name}"
    return getattr(target, "__name__", str(target))


def node_line(node: fx.Node) -> str:
    """One node in the IR's text form: `name: type = op(args)  # role @module`."""
    args = fx.node.map_arg((node.args, node.kwargs), lambda n: n.name)
    arg_text = ", ".join([repr(a) if not isinstance(a, str) else a for a in args[0]]
                         + [f"{k}={v!r}" for k, v in args[1].items()])
    arg_text = arg_text.replace("'", "")
    head = f"{node.name}: {_type_of(node.meta.get(M.VAL))}"
    if node.op == "placeholder":
        return f"{head} = input"
    if node.op == "output":
        return f"return {arg_text}"
    note = [node.meta[M.ROLE].value] if M.ROLE in node.meta else []
    if node.meta.get(M.MODULE_PATH):
        note.append("@" + node.meta[M.MODULE_PATH])
    return f"{head} = {_target_name(node)}({arg_text})" + (f"  # {' '.join(note)}" if note else "")


def graph_text(tg: TrainGraph) -> str:
    return "\n".join(node_line(n) for n in tg.graph.nodes) + "\n"


def summary(tg: TrainGraph, top: int = 5) -> dict:
    """Counts a user reads first: nodes by role, parameters, FLOPs, largest activations."""
    calls = tg.call_nodes()
    roles = Counter(n.meta[M.ROLE].value for n in calls)
    params = sum(p.numel for p in tg.signature.params)
    acts = sorted(((tensor_bytes(n.meta.get(M.VAL)), n) for n in calls
                   if n.meta[M.ROLE] in (M.Role.FORWARD, M.Role.LOSS)
                   and not (isinstance(n.target, torch._ops.OpOverload) and n.target.is_view)),
                  key=lambda t: -t[0])[:top]
    return {
        "nodes": len(calls),
        "nodes_by_role": dict(roles),
        "parameters": params,
        "parameter_tensors": len(tg.signature.params),
        "buffers": len(tg.signature.buffers),
        "flops_per_step": tg.total_flops(),
        "largest_activations": [
            {"node": n.name, "op": _target_name(n), "module": n.meta.get(M.MODULE_PATH),
             "type": _type_of(n.meta.get(M.VAL)), "bytes": b} for b, n in acts],
    }
