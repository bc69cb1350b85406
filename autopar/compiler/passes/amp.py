"""AutoMixedPrecision: run each forward op in half or full precision, as autocast would.

A forward-level pass: it re-traces the step (`retrace`) with a ForwardHook that
casts each op's floating inputs by the op's list (amp_policy.py: white -> the half
dtype, black -> fp32, gray -> unchanged, or promoted to the widest input for ops
autocast handles). Autograd then differentiates the cast forward, so the backward
runs in the matching precision and each cast's backward returns an fp32 gradient
to the fp32 master weight: parameters, gradients and optimizer state stay fp32.

Casts: at most one per (weight or input, dtype) per step (a weight used twice is
cast once), never to the dtype a tensor already has, and a cast back to a weight's
or input's original dtype reuses the original instead of a second cast. An
activation is cast once per consumer, as autocast does, so that the gradients of
its consumers are summed in fp32 (see AmpHook.cast).

With fp16 the step also takes a loss scale (TraceSource.loss_scale): it
differentiates loss * scale, and the runtime's LossScaler unscales, checks for
inf/NaN and skips steps as torch.amp.GradScaler does.

Requires: "traced", "retraceable" (it must run before any joint-graph pass).
Provides: "amp". Options (PassOptions): amp_lists =
{"white": [...], "black": [...], "gray": [...]} moves ops between lists.

Before (fp32), nn.Linear(8, 4) + mse_loss:   After (Layout(amp="bf16"); printing.py's text):
    t: f32[8, 4] = t(p_weight)                    _to_copy: bf16[6, 8] = _to_copy(input_0, dtype=bf16)
    addmm: f32[6, 4] = addmm(p_bias, input_0, t)  _to_copy_1: bf16[4, 8] = _to_copy(p_weight, dtype=bf16)
    mse_loss: f32[] = mse_loss(addmm, slice_1)    _to_copy_2: bf16[4] = _to_copy(p_bias, dtype=bf16)
                                                  t: bf16[8, 4] = t(_to_copy_1)
                                                  addmm: bf16[6, 4] = addmm(_to_copy_2, _to_copy, t)
                                                  _to_copy_3: f32[6, 4] = _to_copy(addmm, dtype=f32)
                                                  mse_loss: f32[] = mse_loss(_to_copy_3, slice_1)
    (backward: mm in bf16; each gradient ends in _to_copy(..., dtype=f32) for the fp32 weight)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from autopar.compiler.ir.annotate import module_of
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.trace import retrace
from autopar.compiler.passes.amp_policy import (
    BLACK,
    GRAY,
    HALF_DTYPES,
    WHITE,
    AmpPolicy,
    device_type_for,
    is_castable,
    op_key,
    parse_amp_lists,
    widest,
)
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult
from autopar.compiler.passes.manager import register_pass
from autopar.layout import Layout


class AmpHook:
    """The ForwardHook that casts each op's inputs by its list and records why."""

    def __init__(self, policy: AmpPolicy):
        self.policy = policy
        # per exported node (re-tracing overwrites): a JSON-able row of the report
        self.decisions: dict[str, dict[str, Any]] = {}
        self.casts = 0
        self.opaque: dict[str, str] = {}  # higher-order ops whose inner ops are not seen
        self._cast_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # source -> {dtype: cast}
        self.source_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # cast -> source

    def call_function(self, node: fx.Node, args: tuple, kwargs: dict, run) -> Any:
        op = node.target
        if isinstance(op, torch._ops.HigherOrderOperator):
            self.opaque[node.name] = op.name()
        if not isinstance(op, torch._ops.OpOverload):
            return run(args, kwargs)
        # probed on the exported node's own values: an outer pass's hook (tensor
        # parallelism) may hand this one arguments that only its own rewrite makes agree
        probe_args, probe_kwargs = fx.node.map_arg((node.args, node.kwargs),
                                                   lambda a: a.meta.get("val", a))
        kind, reason = self.policy.classify(op, probe_args, probe_kwargs)
        target = self._target_dtype(kind, op, args, kwargs)
        if target is not None:
            args, kwargs = tree_map(lambda x: self.cast(x, target) if is_castable(x) else x,
                                    (args, kwargs))
        out = run(args, kwargs)
        self._record(node, op, kind, reason, args, kwargs, out)
        return out

    def _target_dtype(self, kind, op, args, kwargs) -> torch.dtype | None:
        if kind == WHITE:
            return self.policy.half
        if kind == BLACK:
            return torch.float32
        dtypes = list(dict.fromkeys(x.dtype for x in tree_flatten((args, kwargs))[0]
                                    if is_castable(x)))
        # autocast's "promote" ops cast mixed inputs to the widest; ops autocast does not
        # handle keep PyTorch's own type promotion (bf16 tensor + fp32 0-dim stays bf16)
        if len(dtypes) > 1 and self.policy.promotes(op):
            return widest(dtypes)
        return None

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x in `dtype`: at most one cast per (leaf tensor, dtype) per trace."""
        if x.dtype == dtype:
            return x
        source = self.source_of.get(x, x)
        if source.dtype == dtype:  # casting back: the original is still there
            return source
        # NOTE: only tensors without a grad_fn (weights, inputs, buffers) share one cast,
        # as autocast's cast cache does. An activation shared by several half-precision
        # consumers (Llama's q/k/v projections) would have their gradients summed in the
        # half dtype before the cast's backward; autocast casts per use and sums in fp32.
        # Measured: sharing moved Llama's bf16 loss by 1.2e-5 relative after two steps.
        if x.grad_fn is not None:
            self.casts += 1
            return x.to(dtype)
        done = self._cast_of.setdefault(source, {})
        if dtype not in done:
            done[dtype] = source.to(dtype)
            self.source_of[done[dtype]] = source
            self.casts += 1
        return done[dtype]

    def _record(self, node, op, kind, reason, args, kwargs, out) -> None:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        ins = [t for t in tree_flatten((args, kwargs))[0] if is_castable(t)]
        self.decisions[node.name] = {
            "node": node.name, "op": op_key(op), "module": module_of(node)[0],
            "list": kind, "reason": reason,
            "inputs": sorted({_short(t.dtype) for t in ins}),
            "dtype": _short(outs[0].dtype) if outs else None,
        }


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@register_pass
class AutoMixedPrecision(GraphPass):
    name = "amp"
    requires = frozenset({"traced", "retraceable"})
    provides = frozenset({"amp"})
    invalidates = frozenset()  # a forward-level rewrite: the graph stays retraceable
    retraces_from_source = True  # reads tg.source only: an earlier pass's trace can wait
    forward_level = True
    # it also reads the cluster: its device type picks the autocast policy
    layout_fields = frozenset({"amp"})

    def __init__(self, amp: str | None = None, amp_lists: dict | None = None):
        self.amp = amp  # None: Layout.amp
        self.amp_lists = amp_lists  # None: PassOptions.amp_lists
        if amp_lists is not None:
            parse_amp_lists(amp_lists)  # fail at construction, not mid-pipeline

    def reads(self, layout: Layout) -> tuple:
        """Layout.amp, unless this pass was given its own dtype."""
        return () if self.amp else super().reads(layout)

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        amp = self.amp or ctx.layout.amp
        if amp == "off":
            return tg, PassResult(self.name, changed=False, declined=[("amp", "Layout.amp='off'")])
        lists = self.amp_lists if self.amp_lists is not None else ctx.options.amp_lists
        device_type, fallback = device_type_for(ctx.cluster)
        hook = AmpHook(AmpPolicy(device_type, HALF_DTYPES[amp], parse_amp_lists(lists)))
        out = retrace(tg, hook, loss_scale=(amp == "fp16"))
        rows = list(hook.decisions.values())
        out.attrs["amp"] = {"dtype": amp, "device_type": device_type, "ops": rows,
                            "loss_scale": amp == "fp16"}
        stats = dict(Counter(r["reason"] for r in rows))
        stats.update(casts=hook.casts, half_ops=sum(r["dtype"] == _short(HALF_DTYPES[amp])
                                                   for r in rows))
        declined = [("CUDA autocast policy", fallback)] if fallback else []
        # NOTE: export wraps no_grad / autocast-disabled regions (Llama's rotary embedding)
        # in higher-order ops; the hook does not see inside, so their ops keep their dtypes
        declined += [(f"ops inside {name}", f"{kind} is a higher-order op: its ops keep their "
                      "dtypes (eager autocast would still cast them unless disabled there)")
                     for name, kind in hook.opaque.items()]
        return out, PassResult(self.name, changed=True, stats=stats, declined=declined)


__all__ = ["AmpHook", "AutoMixedPrecision", "BLACK", "GRAY", "WHITE"]
