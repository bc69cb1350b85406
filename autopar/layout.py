"""Layout: how one training step is parallelised.

A Layout is plain data: every field has a default, `validate` checks it on its own
and `check_world_size` checks it against a number of processes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zero-bubble")
RECOMPUTE = ("none", "full", "selective", "auto")
AMP = ("off", "bf16", "fp16")
COMM_DTYPES = (None, "fp32", "bf16", "fp16")
ALLREDUCE = ("flat", "hierarchical")
DGC_TOPK = ("exact", "sampled")
PS_MODES = ("sync", "async", "half-async", "geo")
PS_DENSE = ("allreduce", "servers")


class LayoutError(ValueError):
    """A Layout that cannot be used: the message names the field and what would work."""


@dataclass(frozen=True)
class PSLayout:
    """Parameter-server training (docs/parameter_server.md): `servers` processes hold
    the embedding tables, sharded by row id; the other `Layout.dp` processes train.

    mode: "sync" (a server applies once every trainer has pushed), "async" (on each
    push), "half-async" (once `fraction` of the trainers have pushed) or "geo" (trainers
    train their rows locally and push the change every `geo_k` steps). dense: where the
    other parameters live: "allreduce" (on every trainer, gradients averaged every step)
    or "servers" (held and updated there too, so no trainer waits for another); None
    chooses "allreduce" in sync mode and "servers" otherwise. tables: the parameters the
    servers hold; None: every parameter read only by embedding lookups.
    """

    servers: int = 1
    mode: str = "sync"
    fraction: float | None = None
    geo_k: int | None = None
    dense: str | None = None
    tables: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tables, list):
            object.__setattr__(self, "tables", tuple(self.tables))
        self.validate()

    @property
    def dense_policy(self) -> str:
        if self.dense is not None:
            return self.dense
        return "allreduce" if self.mode == "sync" else "servers"

    def validate(self) -> None:
        if not isinstance(self.servers, int) or isinstance(self.servers, bool) or self.servers < 1:
            raise LayoutError(f"Layout.ps.servers must be a positive integer, got {self.servers!r}")
        if self.mode not in PS_MODES:
            raise LayoutError(f"Layout.ps.mode must be one of {list(PS_MODES)}, got {self.mode!r}")
        if self.dense is not None and self.dense not in PS_DENSE:
            raise LayoutError(f"Layout.ps.dense must be one of {list(PS_DENSE)} or None, got "
                              f"{self.dense!r}")
        if self.mode == "half-async":
            f = self.fraction
            if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1):
                raise LayoutError(f"Layout.ps.mode='half-async' waits for a fraction of the "
                                  f"trainers: Layout.ps.fraction must be a number in (0, 1], "
                                  f"got {f!r}")
        elif self.fraction is not None:
            raise LayoutError(f"Layout.ps.fraction is for mode='half-async', not {self.mode!r}")
        if self.mode == "geo":
            k = self.geo_k
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise LayoutError(f"Layout.ps.mode='geo' pushes every k steps: Layout.ps.geo_k "
                                  f"must be an integer >= 1, got {k!r}")
        elif self.geo_k is not None:
            raise LayoutError(f"Layout.ps.geo_k is for mode='geo', not {self.mode!r}")
        if self.mode != "sync" and self.dense == "allreduce":
            raise LayoutError(f"Layout.ps.dense='allreduce' makes every trainer wait for every "
                              f"other each step, which mode={self.mode!r} exists to avoid; use "
                              f"dense='servers' (or mode='sync')")


@dataclass(frozen=True)
class Layout:
    """How to parallelise one training step (see docs/concepts.md).

    dp, tp, pp: data-, tensor- and pipeline-parallel degrees; their product is the
    number of processes. microbatches: micro-batches per step (gradient accumulation
    when pp == 1). bucket_mb: size of a gradient all-reduce bucket in MiB (0: one
    all-reduce per gradient). allreduce: "flat" sums gradients over the whole dp group at
    once; "hierarchical" inside each node first, then among the nodes, then back inside
    each node (docs/communication.md; needs the cluster's devices per node).
    local_sgd*: Local SGD's averaging period, synchronous warm-up, adaptive period, and
    the local steps each average runs under before it is applied (local_sgd_overlap, 0:
    at once).
    dgc*: Deep Gradient Compression's final sparsity, dense steps before its ramp-up,
    ramp-up length, clipping norm and top-k selection (docs/communication.md).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    recompute: str = "none"
    amp: str = "off"
    sequence_parallel: bool = False
    fusion: bool = True
    # communication options
    bucket_mb: float = 25.0
    overlap_comm: bool = True
    grad_comm_dtype: str | None = None
    allreduce: str = "flat"
    local_sgd: int | None = None
    local_sgd_warmup: int = 0
    local_sgd_adaptive: bool = False
    local_sgd_overlap: int = 0
    dgc: float | None = None
    dgc_warmup: int = 0
    dgc_rampup: int = 0
    dgc_clip: float | None = None
    dgc_topk: str = "exact"
    # parameter-server training: the servers and how trainers use them (None: no servers)
    ps: PSLayout | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ps, dict):
            object.__setattr__(self, "ps", PSLayout(**self.ps))
        self.validate()

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp + (self.ps.servers if self.ps else 0)

    def validate(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"Layout.{name} must be a positive integer, got {value!r}")
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("recompute", self.recompute, RECOMPUTE)
        _check_choice("amp", self.amp, AMP)
        _check_choice("grad_comm_dtype", self.grad_comm_dtype, COMM_DTYPES)
        _check_choice("allreduce", self.allreduce, ALLREDUCE)
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"Layout.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb >= 0
                and math.isfinite(self.bucket_mb)):
            raise LayoutError(f"Layout.bucket_mb must be a finite number >= 0, got {self.bucket_mb!r}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise LayoutError(
                f"Layout.virtual_stages={self.virtual_stages} needs schedule='interleaved', "
                f"got schedule={self.schedule!r}")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("Layout.sequence_parallel=True needs tp > 1")
        if self.zero and self.dp == 1:
            raise LayoutError(f"Layout.zero={self.zero} shards over data-parallel ranks and needs dp > 1")
        if self.allreduce == "hierarchical" and self.dp == 1:
            raise LayoutError("Layout.allreduce='hierarchical' sums gradients over data-parallel "
                              "ranks and needs dp > 1")
        self._validate_local_sgd()
        self._validate_dgc()
        self._validate_ps()

    def _validate_ps(self) -> None:
        if self.ps is None:
            return
        if not isinstance(self.ps, PSLayout):
            raise LayoutError(f"Layout.ps must be a PSLayout (or its fields as a dict), got "
                              f"{self.ps!r}")
        others = {name: getattr(self, name) for name in
                  ("tp", "pp", "zero", "microbatches", "local_sgd", "dgc", "amp", "recompute")
                  if getattr(self, name) != _DEFAULTS[name]}
        if others:
            raise LayoutError(f"Layout.ps trains data-parallel trainers against parameter "
                              f"servers; it does not combine with {others} yet: leave those "
                              f"at their defaults")

    def _validate_local_sgd(self) -> None:
        period, warmup = self.local_sgd, self.local_sgd_warmup
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise LayoutError(f"Layout.local_sgd_warmup (synchronous steps before Local SGD) "
                              f"must be an integer >= 0, got {warmup!r}")
        if not isinstance(self.local_sgd_adaptive, bool):
            raise LayoutError(f"Layout.local_sgd_adaptive must be True or False, got "
                              f"{self.local_sgd_adaptive!r}")
        overlap = self.local_sgd_overlap
        if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 0:
            raise LayoutError(f"Layout.local_sgd_overlap (local steps an average runs under "
                              f"before it is applied; 0: at once) must be an integer >= 0, "
                              f"got {overlap!r}")
        if period is None:
            given = [n for n in ("local_sgd_warmup", "local_sgd_adaptive", "local_sgd_overlap")
                     if getattr(self, n)]
            if given:
                raise LayoutError(f"{_fields_named(given)} only with Layout.local_sgd (the "
                                  f"averaging period), which is not set")
            return
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise LayoutError(f"Layout.local_sgd (the averaging period H, in steps) must be an "
                              f"integer >= 1, or None to sum gradients every step; got "
                              f"{period!r}")
        if self.dp == 1:
            raise LayoutError("Layout.local_sgd averages parameters over data-parallel ranks "
                              "and needs dp > 1")
        if self.zero:
            raise LayoutError(f"Layout.local_sgd with zero={self.zero}: each rank steps its "
                              f"whole parameters on its own gradients, which ZeRO shards over "
                              f"dp; use zero=0")

    def _validate_dgc(self) -> None:
        _check_choice("dgc_topk", self.dgc_topk, DGC_TOPK)
        for name in ("dgc_warmup", "dgc_rampup"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise LayoutError(f"Layout.{name} must be an integer >= 0 (steps), got {value!r}")
        clip = self.dgc_clip
        if clip is not None and not (isinstance(clip, (int, float)) and not isinstance(clip, bool)
                                     and math.isfinite(clip) and clip > 0):
            raise LayoutError(f"Layout.dgc_clip (the gradient norm DGC clips to) must be a "
                              f"number > 0 or None, got {clip!r}")
        sparsity = self.dgc
        if sparsity is None:
            given = [n for n, set_ in (("dgc_warmup", self.dgc_warmup),
                                       ("dgc_rampup", self.dgc_rampup),
                                       ("dgc_clip", clip is not None),
                                       ("dgc_topk", self.dgc_topk != "exact")) if set_]
            if given:
                raise LayoutError(f"{_fields_named(given)} only with Layout.dgc (the final "
                                  f"sparsity, e.g. 0.999), which is not set")
            return
        if not (isinstance(sparsity, (int, float)) and not isinstance(sparsity, bool)
                and 0 < sparsity < 1):
            raise LayoutError(f"Layout.dgc (the fraction of each gradient DGC leaves unsent, "
                              f"e.g. 0.999) must be a number in (0, 1), or None to send "
                              f"gradients whole; got {sparsity!r}")
        if self.dp == 1:
            raise LayoutError("Layout.dgc compresses the gradient exchange over data-parallel "
                              "ranks and needs dp > 1")
        if self.local_sgd is not None:
            raise LayoutError("Layout.dgc and Layout.local_sgd both replace the per-step "
                              "gradient sum: choose one")
        if self.zero:
            raise LayoutError(f"Layout.dgc with zero={self.zero}: DGC's momentum and residual "
                              f"are per-rank state of whole gradients; use zero=0")
        if self.allreduce != "flat":
            raise LayoutError("Layout.dgc exchanges sparse gradients with an all-gather over "
                              "dp; use allreduce='flat'")
        if self.amp == "fp16":
            raise LayoutError("Layout.dgc with amp='fp16': the loss scaler's overflow check "
                              "would see only this rank's gradients; use amp='bf16' or 'off'")
        if clip is not None and (self.tp > 1 or self.pp > 1):
            raise LayoutError(f"Layout.dgc_clip clips each rank's whole gradient, which "
                              f"tp={self.tp} / pp={self.pp} split over ranks (its norm is "
                              f"not built there); use dgc_clip=None, or tp=pp=1")

    def check_world_size(self, world_size: int) -> None:
        """Refuse a layout whose dp*tp*pp (+ servers) is not the number of processes."""
        if self.ps is not None and self.world_size != world_size:
            raise LayoutError(
                f"{self} needs {self.ps.servers} server(s) + dp={self.dp} trainer(s) = "
                f"{self.world_size} processes, but the world size is {world_size}: start it "
                f"with `torchrun --nproc-per-node {self.world_size}` or use "
                f"dp={world_size - self.ps.servers}")
        if self.world_size != world_size:
            raise LayoutError(
                f"{self} needs dp*tp*pp = {self.world_size} processes, but the world size is "
                f"{world_size}: start it with `torchrun --nproc-per-node {self.world_size}` "
                f"or choose a layout whose product is {world_size}")

    def check_batch(self, batch_size: int) -> None:
        """Refuse a global batch that does not split evenly over dp ranks and micro-batches."""
        parts = self.dp * self.microbatches
        if batch_size % parts:
            fits = [d for d in range(1, batch_size + 1) if batch_size % (d * self.microbatches) == 0]
            raise LayoutError(
                f"the global batch of {batch_size} does not split evenly into dp={self.dp} x "
                f"microbatches={self.microbatches} = {parts} parts; use a batch that is a multiple "
                f"of {parts}, or dp in {fits}")

    def replace(self, **changes: Any) -> Layout:
        """dataclasses.replace, validated the same, in a third of its time (the planner
        derives tens of thousands of layouts per search)."""
        unknown = changes.keys() - _FIELD_NAMES
        if unknown:
            raise TypeError(f"Layout has no field {sorted(unknown)[0]!r}")
        # Construction, not mutation: the new instance's fields are written into its
        # __dict__ before anyone holds it, as the frozen dataclass's __init__ writes them
        # with object.__setattr__ (neither goes through the frozen __setattr__). Safe
        # because a Layout is nothing but its fields (no __slots__, no derived or cached
        # attribute to fill) and `validate` is all __post_init__ does, run here too;
        # fast because it skips __init__'s per-field setattr calls and
        # dataclasses.replace's field introspection.
        new = object.__new__(Layout)
        fields = new.__dict__
        fields.update({name: self.__dict__[name] for name in _FIELD_NAMES})
        fields.update(changes)
        new.validate()
        return new

    def synchronous(self) -> Layout:
        """This layout with gradients summed over dp every step: without Local SGD or DGC
        (the program of their warm-up steps)."""
        return self.replace(local_sgd=None, local_sgd_warmup=0, local_sgd_adaptive=False,
                            local_sgd_overlap=0, dgc=None, dgc_warmup=0, dgc_rampup=0,
                            dgc_clip=None, dgc_topk="exact")

    def non_default_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    def __str__(self) -> str:
        fields = self.non_default_fields() or {"dp": 1}
        return "Layout(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LayoutError(f"unknown Layout field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)


def _fields_named(names: list[str]) -> str:
    """'Layout.a', 'Layout.a and Layout.b', 'Layout.a, Layout.b and Layout.c': every field
    named with its class, so that the CLI can name each by its flag instead."""
    named = [f"Layout.{n}" for n in names]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise LayoutError(f"Layout.{name} must be one of {list(choices)}, got {value!r}")


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Layout))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Layout)}
