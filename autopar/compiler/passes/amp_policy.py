"""AMP op lists (white / black / gray) derived from PyTorch's own autocast policy.

Nothing is copied by hand: the first time an op is seen (per op, device type and
half dtype) it is *probed*, outside any tracing, by running it under
`torch.autocast(device_type, dtype)` in a fresh FakeTensorMode on fake tensors of
the same shapes (nothing is computed):

- no autocast kernel for the device (`_dispatch_has_kernel_for_dispatch_key(op,
  "AutocastCPU")` is False)                                     -> gray (no cast)
- fp32 inputs come out in the half dtype                        -> white
- half inputs come out in fp32                                  -> black
- otherwise (autocast's "promote" ops such as cat)              -> gray, and mixed
  floating inputs are cast to the widest one, as autocast does.

Device type: "cpu" is what runs and is tested here (fake CPU tensors go through
AutocastCPU). On a CUDA machine the same probe runs with device type "cuda" (fake
tensors on "cuda", dispatch key "AutocastCUDA"); PyTorch disables CUDA autocast
when CUDA is unavailable, so a planning machine without CUDA falls back to the CPU
policy and the pass says so in its result.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._pytree import tree_flatten, tree_map

WHITE, BLACK, GRAY = "white", "black", "gray"
LISTS = (WHITE, BLACK, GRAY)
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DISPATCH_KEY = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


class AmpListError(ValueError):
    """An `amp_lists` entry names no aten op or no list; the message suggests one."""


def is_castable(x) -> bool:
    """Autocast casts floating tensors except float64 (`is_eligible` in autocast_mode.h)."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def op_key(op) -> str:
    """"aten.mm" for aten.mm.default / aten.mm.out: lists name ops, not overloads."""
    return f"{op.namespace}.{op._opname}"


@dataclass
class AmpPolicy:
    """Which list an op is on, for one device type and half dtype."""

    device_type: str
    half: torch.dtype
    user: dict[str, str] = field(default_factory=dict)  # op key -> list
    _probed: dict[tuple[str, str, torch.dtype], str] = field(default_factory=dict)

    def classify(self, op, args: tuple, kwargs: dict) -> tuple[str, str]:
        """(list, reason): reason is the list name, or "user" for an override."""
        key = op_key(op)
        if key in self.user:
            return self.user[key], "user"
        cache_key = (str(op), self.device_type, self.half)
        if cache_key not in self._probed:
            self._probed[cache_key] = probe(op, args, kwargs, self.device_type, self.half)
        kind = self._probed[cache_key]
        return kind, kind

    def promotes(self, op) -> bool:
        """An op autocast handles whose inputs may mix dtypes (autocast's "promote")."""
        return has_autocast_kernel(op, self.device_type)


def has_autocast_kernel(op, device_type: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), _DISPATCH_KEY[device_type])


def probe(op, args: tuple, kwargs: dict, device_type: str, half: torch.dtype) -> str:
    """The list autocast puts `op` on, found by running it (see the module doc)."""
    if not isinstance(op, torch._ops.OpOverload) or not has_autocast_kernel(op, device_type):
        return GRAY
    if not any(is_castable(x) for x in tree_flatten((args, kwargs))[0]):
        return GRAY
    with disable_proxy_modes_tracing():
        try:
            from_fp32 = _probe_output_dtype(op, args, kwargs, device_type, half, torch.float32)
            from_half = _probe_output_dtype(op, args, kwargs, device_type, half, half)
        except Exception:  # noqa: BLE001 - an op the probe cannot run is left alone
            return GRAY
    if from_fp32 == half:
        return WHITE
    if from_half == torch.float32:
        return BLACK
    return GRAY


def _probe_output_dtype(op, args, kwargs, device_type, half, input_dtype) -> torch.dtype | None:
    def fake(x):
        if not isinstance(x, torch.Tensor):
            return x
        dtype = input_dtype if is_castable(x) else x.dtype
        return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=device_type)

    with FakeTensorMode(allow_non_fake_inputs=True):
        fargs, fkwargs = tree_map(fake, (args, kwargs))
        with torch.autocast(device_type, dtype=half):
            out = op(*fargs, **fkwargs)
    floats = [t.dtype for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
              and t.is_floating_point()]
    return floats[0] if floats else None


def device_type_for(cluster) -> tuple[str, str | None]:
    """("cuda" | "cpu", why the CPU policy stands in for CUDA, or None)."""
    kind = getattr(getattr(cluster, "device", None), "kind", "cpu")
    if kind != "gpu":
        return "cpu", None
    if torch.cuda.is_available():
        return "cuda", None
    return "cpu", "the cluster has GPUs but CUDA is unavailable here: used the CPU autocast policy"


def parse_amp_lists(amp_lists: Mapping[str, Iterable[str]] | None) -> dict[str, str]:
    """{"white": ["mm", "aten.bmm"], ...} -> {"aten.mm": "white", ...}; unknown ops or
    list names raise AmpListError with a suggestion."""
    out: dict[str, str] = {}
    for list_name, names in (amp_lists or {}).items():
        if list_name not in LISTS:
            raise AmpListError(f"amp_lists has no list {list_name!r}; the lists are {list(LISTS)}")
        if isinstance(names, str):
            raise AmpListError(f"amp_lists[{list_name!r}] must be a list of op names, got the "
                               f"string {names!r}; write [{names!r}]")
        for name in names:
            key = _resolve(name)
            if key in out and out[key] != list_name:
                raise AmpListError(f"amp_lists puts {key} on both {out[key]!r} and {list_name!r}")
            out[key] = list_name
    return out


def _resolve(name: str) -> str:
    """"mm" / "aten.mm" / "aten::mm" / "aten.mm.default" -> "aten.mm"."""
    parts = name.replace("::", ".").split(".")
    if parts[0] != "aten":
        parts = ["aten", *parts]
    packet = parts[1] if len(parts) > 1 else ""
    if packet and hasattr(torch.ops.aten, packet):
        return f"aten.{packet}"
    raise AmpListError(f"amp_lists: no aten op named {name!r}{_did_you_mean(packet)}")


def _did_you_mean(packet: str) -> str:
    known = sorted({n.split("::", 1)[1].split(".")[0]
                    for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")})
    close = difflib.get_close_matches(packet, known, n=3)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def widest(dtypes: Sequence[torch.dtype]) -> torch.dtype:
    return torch.float32 if torch.float32 in dtypes else dtypes[0]
