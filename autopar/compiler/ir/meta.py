"""Node metadata keys of the TrainGraph, declared once with their types.

Every `call_function` node of a verified TrainGraph carries VAL, ROLE and
MODULE_PATH (None where no module owns the op, e.g. the loss written outside the
model). Passes that create nodes fill them (see `ir.graph.new_node_meta`).
"""

from __future__ import annotations

import enum

# torch's own key: a FakeTensor (or a tuple of them) describing the node's output.
VAL = "val"  # FakeTensor | tuple[FakeTensor | None, ...] | SymInt | None


class Role(str, enum.Enum):
    """Which part of the training step a node belongs to."""

    FORWARD = "forward"
    LOSS = "loss"  # after the last op that reads a parameter, on the way to the loss
    BACKWARD = "backward"
    COMM = "comm"  # collectives and the packing around them, inserted by passes
    OPTIMIZER = "optimizer"


ROLE = "autopar.role"  # Role
MODULE_PATH = "autopar.module_path"  # str | None: "transformer.h.3.attn" (original model names)
MODULE_TYPE = "autopar.module_type"  # str | None: qualified class name of that module
LAYER = "autopar.layer"  # int | None: index inside the model's main stack of repeated blocks
SOURCE = "autopar.source"  # str | None: "file.py:123" of the user code that produced the op
FLOPS = "autopar.flops"  # int: floating-point operations of this node (0 for views)
BYTES = "autopar.bytes"  # int: bytes read + written, 0 for views and metadata ops
GRAD_OF = "autopar.grad_of"  # str: parameter name whose gradient this node produces
COMM_KIND = "autopar.comm_kind"  # str: "grad_bucket" | "loss" | ... for collective nodes
BUCKET = "autopar.bucket"  # int: gradient bucket index for the nodes of one bucket
STAGE = "autopar.stage"  # int: the pipeline stage that runs this node (assign_stages)
CREATED_BY = "autopar.created_by"  # str: the pass that inserted the node
# tuple[str, str]: the name and `op_key` of the node before fusion whose value this
# node holds (the outputs of a fused region)
COMPUTES = "autopar.computes"
# tuple[str, ...]: the passes that changed the node's op or constant arguments, in order
# (recorded when a PassManager is asked to, as `autopar.bisect` does); REWIRED_BY: the
# last pass that changed which nodes it reads
REWRITTEN_BY = "autopar.rewritten_by"
REWIRED_BY = "autopar.rewired_by"
# tuple[Provenance, ...]: on a fused node, where each op it replaced came from, in order
FUSED_PROVENANCE = "autopar.fused_provenance"
RECOMPUTED = "autopar.recomputed"  # str: the forward node a backward copy recomputes
# tuple[(op name, flops, bytes, bytes allocated)]: the ops a fused region's fallback runs
FUSED_MEMBERS = "autopar.fused_members"
FUSED_INLINE = "autopar.fused_inline"  # its ops run inline: fusion.inline_timeline's steps

REQUIRED_CALL_KEYS = (VAL, ROLE, MODULE_PATH)


def op_key(node) -> str:
    """The node's op as text, with the index of a getitem ("<built-in function
    getitem>[1]"): what tells two nodes of one op apart across graphs."""
    key = str(node.target)
    if key == "<built-in function getitem>" and len(node.args) > 1:
        key += f"[{node.args[1]}]"
    return key


class Provenance(tuple):
    """(name, op_key, exported forward op it was traced from or None, backward?, autograd
    seq_nr or None) of a joint-graph node: what tells where a node of one trace stands
    in another trace of the same forward."""

    __slots__ = ()

    def __new__(cls, node):
        sources = node.meta.get("from_node") or ()
        return super().__new__(cls, (node.name, op_key(node),
                                     sources[0].name if sources else None,
                                     bool(node.meta.get("autograd_backward")),
                                     node.meta.get("seq_nr")))
