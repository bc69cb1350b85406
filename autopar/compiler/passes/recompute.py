"""Recompute: drop activations after the forward and compute them again in the backward.

`Layout.recompute` picks which forward values the backward reads again instead of
keeping them alive from the forward:

- "full": each layer of the model's repeated stack (nodes with `M.LAYER`) keeps only
  its input; everything else the layer's backward reads is recomputed. A model with
  no repeated stack is one layer.
- "selective": every op is recomputed except the contractions with a weight
  (matmuls whose operand comes from parameters alone, such as a linear layer's):
  attention scores and probabilities, softmax, norms, activations and masks are
  cheap to redo and large to keep.
- "auto": the per-layer choice among none / selective / full that meets a memory
  budget at the least recomputed FLOPs: a multiple-choice knapsack solved with
  HiGHS, whose answer the memory model then checks on the rewritten graph
  (`compiler/analysis/memory.py`); see `plan_auto`.

Under every policy a value another layer reads (a layer's input or output) is kept,
so recomputation never reaches across layers. Random ops (dropout masks) are kept:
recomputing them would draw new numbers; those, and any op that is not a pure aten
op, are listed in `PassResult.declined` with the reason. So are the outputs of a kept
op with several (attention whose dropout is drawn inside the kernel: its output and
log-sum-exp): a copy of their getitem would read the kept op's outputs in the
backward, which therefore stay alive from the forward all the same. A GPU's dropout
(`native_dropout`: its output and a bool mask) keeps its mask, and its output is
recomputed from it (`native_dropout_backward(input, mask, 1 / (1 - p))`, the same
product), so it keeps 1 byte an element, not its output.

The rewrite: for each backward node that reads a value chosen for recomputation, a
copy of the value's op (and of the chosen ops it needs, recursively) is inserted
right before the first backward node that needs it; backward nodes then read the
copy, so the forward value dies after its last forward use. The copies are
backward nodes (`M.RECOMPUTED` names the original); they compute the same ops on
the same inputs, so fp32 results are bit-identical to the step without recompute.

Before (selective):                    After:
    h = addmm(b, x, w)      # forward      h = addmm(b, x, w)
    g = gelu(h)             # forward      g = gelu(h)
    y = mm(g, w2)           # forward      y = mm(g, w2)
    dw2 = mm(t(g), dy)      # backward     g_r = gelu(h)          # recomputed
                                           dw2 = mm(t(g_r), dy)

Requires: "traced". Provides: "recomputed".
"""

from __future__ import annotations

from autopar.compiler.ir import meta as M
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult, writable
from autopar.compiler.passes.manager import register_pass
from autopar.compiler.passes.recompute_auto import plan_auto
from autopar.compiler.passes.recompute_rules import choose, layers_of, rewrite
from autopar.layout import Layout


@register_pass
class Recompute(GraphPass):
    name = "recompute"
    requires = frozenset({"traced"})
    provides = frozenset({"recomputed"})
    forward_level = True
    layout_fields = frozenset({"recompute"})  # and with "auto", the whole layout (`reads`)

    def reads(self, layout: Layout) -> tuple:
        """The policy; "auto" reads the whole layout (its memory budget is the step's
        peak under the layout) and the cluster (the budget's device)."""
        if layout.recompute == "auto":
            return (("layout", layout),)
        return super().reads(layout)

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        policy = ctx.layout.recompute
        if policy == "none":
            return tg, PassResult(self.name, changed=False, stats={"policy": "none"})
        if policy == "auto":
            per_layer = plan_auto(tg, ctx)
        else:
            per_layer = {layer: policy for layer in layers_of(tg)}
            if policy == "selective":  # also outside the stack: the loss's log-softmax
                per_layer[None] = policy
        tg = writable(tg, ctx)
        chosen, kept = choose(tg, per_layer)
        copies = rewrite(tg.graph, chosen)
        tg.gm.recompile()
        tg.attrs["recompute"] = {"policy": policy,
                                 "per_layer": {str(k): v for k, v in per_layer.items()}}
        stats = {"policy": policy, "recomputed_ops": copies,
                 "recompute_flops": sum(n.meta.get(M.FLOPS, 0) for n in tg.call_nodes()
                                        if n.meta.get(M.RECOMPUTED))}
        declined = [(n, why) for n, why in kept.items()]
        return tg, PassResult(self.name, changed=copies > 0, stats=stats, declined=declined)
