"""The TrainGraph's validity, as a checked spec.

A valid TrainGraph:
- passes `fx.Graph.lint()` (every use after its definition, names unique, ...);
- has exactly `signature.num_placeholders` placeholders, in the order
  params, buffers, inputs, and `signature.num_outputs` outputs;
- carries on every call_function node the keys of `meta.REQUIRED_CALL_KEYS`, with
  a known Role;
- gives each gradient output the shape and dtype of its parameter, and a scalar loss;
- pairs every functional collective with exactly one `wait_tensor`.

Tests corrupt graphs on purpose to see each rule fire (tests/unit/test_verify.py).
"""

from __future__ import annotations

import torch

from autopar.compiler.ir import comm_ops
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph


class VerificationError(AssertionError):
    """A pass produced an invalid TrainGraph; the message names the node and the rule."""


_c10d = torch.ops._c10d_functional
COLLECTIVES = frozenset({
    _c10d.all_reduce.default, _c10d.all_gather_into_tensor.default,
    _c10d.reduce_scatter_tensor.default, _c10d.all_to_all_single.default,
    _c10d.broadcast.default, comm_ops.reduce,
})
WAIT = _c10d.wait_tensor.default


def verify(tg: TrainGraph) -> None:
    """Raise VerificationError on the first rule a graph breaks."""
    try:
        tg.graph.lint()
    except Exception as exc:
        raise VerificationError(f"graph lint failed: {exc}") from exc
    _check_signature(tg)
    _check_metadata(tg)
    _check_outputs(tg)
    _check_collectives(tg)


def _check_signature(tg: TrainGraph) -> None:
    sig = tg.signature
    placeholders = tg.placeholders()
    if len(placeholders) != sig.num_placeholders:
        raise VerificationError(
            f"{len(placeholders)} placeholders, but the signature has {len(sig.params)} params + "
            f"{len(sig.buffers)} buffers + {len(sig.inputs)} inputs")
    out = tg.output_node().args[0]
    if not isinstance(out, (tuple, list)) or len(out) != sig.num_outputs:
        n = len(out) if isinstance(out, (tuple, list)) else 1
        raise VerificationError(f"{n} outputs, but the signature needs {sig.num_outputs} "
                                "(loss, one gradient per parameter, mutated buffers)")


def _check_metadata(tg: TrainGraph) -> None:
    for node in tg.call_nodes():
        missing = [k for k in M.REQUIRED_CALL_KEYS if k not in node.meta]
        if missing:
            by = node.meta.get(M.CREATED_BY, "tracing")
            raise VerificationError(f"node {node.name} ({node.target}) created by {by} lacks "
                                    f"metadata {missing}")
        if not isinstance(node.meta[M.ROLE], M.Role):
            raise VerificationError(f"node {node.name}: {M.ROLE} is {node.meta[M.ROLE]!r}, "
                                    "not a meta.Role")


def _check_outputs(tg: TrainGraph) -> None:
    loss_val = tg.loss_node().meta.get(M.VAL)
    if not (isinstance(loss_val, torch.Tensor) and loss_val.dim() == 0):
        raise VerificationError(f"output 0 (the loss) must be a scalar, got {_describe(loss_val)}")
    for i, (param, grad) in enumerate(zip(tg.signature.params, tg.grad_nodes())):
        val = grad.meta.get(M.VAL)
        want = tg.signature.grad_shape(i)
        if not isinstance(val, torch.Tensor) or tuple(val.shape) != want \
                or val.dtype != param.dtype:
            raise VerificationError(
                f"gradient of {param.name} ({grad.name}) is {_describe(val)}, but the parameter "
                f"is {param.dtype} {list(param.shape)}"
                + (f" and the step returns its block {list(want)}" if want != param.shape else ""))


def _check_collectives(tg: TrainGraph) -> None:
    for node in tg.call_nodes():
        if node.target in COLLECTIVES:
            waits = [u for u in node.users if u.target == WAIT]
            if len(waits) != 1 or len(node.users) != 1:
                raise VerificationError(
                    f"collective {node.name} must feed exactly one wait_tensor and nothing "
                    f"else, has users {[u.name for u in node.users]}")


def _describe(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{val.dtype} {list(val.shape)}"
    return repr(val)
