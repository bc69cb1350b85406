"""AMP op lists (white / black / gray) derived from PyTorch's own autocast policy.

Nothing is copied by hand: the first time an op is seen (per op, device type and
half dtype) it is *probed*, outside any tracing, by running it under
`torch.autocast(device_type, dtype)` in a fresh FakeTensorMode on fake tensors of
the same shapes (nothing is computed):

- no autocast kernel for the device (`_dispatch_has_kernel_for_dispatch_key(op,
  "AutocastCPU")` is False) and the op does not decompose
  (CompositeImplicitAutograd) into ops that have one           -> gray (no cast)
- fp32 inputs come out in the half dtype, and do not without
  autocast (`x.to(torch.bfloat16)` does either way: gray)       -> white
- half inputs come out in fp32, and do not without autocast     -> black
- otherwise (autocast's "promote" ops such as cat)              -> gray, and mixed
  floating inputs are cast to the widest one, as autocast does.

Device type: the cluster's ("cuda" for a cluster of GPUs, else "cpu"). The probe
turns autocast on through the dispatcher's own switches (`torch.set_autocast_enabled`)
rather than `torch.autocast`, which refuses CUDA on a machine without it: the
AutocastCUDA kernels are in every build and run on fake CUDA tensors, so a CPU
machine reads the CUDA policy of the GPUs it plans for (tests/unit/test_amp_lists.py
checks known CUDA entries on this CPU-only machine).
"""

from __future__ import annotations

import contextlib
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


# op overload, device type, half dtype -> the list autocast puts it on: the same in every
# trace of this process (autocast's kernels are registered once), so probed once
_PROBED: dict[tuple[torch._ops.OpOverload, str, torch.dtype], str] = {}


@dataclass
class AmpPolicy:
    """Which list an op is on, for one device type and half dtype."""

    device_type: str
    half: torch.dtype
    user: dict[str, str] = field(default_factory=dict)  # op key -> list

    def classify(self, op, args: tuple, kwargs: dict) -> tuple[str, str]:
        """(list, reason): reason is the list name, or "user" for an override."""
        key = op_key(op)
        if key in self.user:
            return self.user[key], "user"
        if not any(is_castable(x) for x in tree_flatten((args, kwargs))[0]):
            return GRAY, GRAY  # nothing to cast here; the op's next call may have (not cached)
        cache_key = (op, self.device_type, self.half)
        if cache_key not in _PROBED:
            _PROBED[cache_key] = probe(op, args, kwargs, self.device_type, self.half)
        kind = _PROBED[cache_key]
        return kind, kind

    def promotes(self, op) -> bool:
        """An op autocast handles whose inputs may mix dtypes (autocast's "promote")."""
        return has_autocast_kernel(op, self.device_type)


def has_autocast_kernel(op, device_type: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), _DISPATCH_KEY[device_type])


def _composite(op) -> bool:
    """An op that decomposes before autocast sees it (CUDA's cross_entropy_loss: its
    log_softmax and nll_loss are what autocast casts), so probing it reads the policy of
    its parts."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def probe(op, args: tuple, kwargs: dict, device_type: str, half: torch.dtype) -> str:
    """The list autocast puts `op` on, found by running it (see the module doc)."""
    if not isinstance(op, torch._ops.OpOverload):
        return GRAY
    if not has_autocast_kernel(op, device_type) and not _composite(op):
        return GRAY
    if not any(is_castable(x) for x in tree_flatten((args, kwargs))[0]):
        return GRAY
    with disable_proxy_modes_tracing():
        try:
            out = {(dtype, auto): _probe_output_dtype(op, args, kwargs, device_type, half,
                                                      dtype, auto)
                   for dtype in (torch.float32, half) for auto in (True, False)}
        except Exception:  # noqa: BLE001 - an op the probe cannot run is left alone
            return GRAY
    # NOTE: a list is what autocast changes. An output dtype the op's own arguments fix
    # (x.to(torch.bfloat16): fp32 in, half out) is the same without autocast, and puts the
    # op on no list; read as white, it would be cached for the op and send every later
    # `.float()` in the process through the half dtype first.
    if out[torch.float32, True] == half != out[torch.float32, False]:
        return WHITE
    if out[half, True] == torch.float32 != out[half, False]:
        return BLACK
    return GRAY


def _probe_output_dtype(op, args, kwargs, device_type, half, input_dtype,
                        autocast: bool) -> torch.dtype | None:
    def fake(x):
        if not isinstance(x, torch.Tensor):
            return x
        dtype = input_dtype if is_castable(x) else x.dtype
        return torch.empty_strided(x.shape, x.stride(), dtype=dtype, device=device_type)

    with FakeTensorMode(allow_non_fake_inputs=True):
        fargs, fkwargs = tree_map(fake, (args, kwargs))
        with _autocast_state(device_type, half) if autocast else contextlib.nullcontext():
            out = op(*fargs, **fkwargs)
    floats = [t.dtype for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
              and t.is_floating_point()]
    return floats[0] if floats else None


@contextlib.contextmanager
def _autocast_state(device_type: str, half: torch.dtype):
    """Autocast on for `device_type`, set on the dispatcher directly: `torch.autocast`
    turns CUDA autocast off when CUDA is unavailable, but its kernels (AutocastCUDA)
    are in every build and run on fake CUDA tensors, so a CPU machine can read the
    CUDA policy of the cluster it plans for."""
    before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, half)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, before[0])
        torch.set_autocast_dtype(device_type, before[1])


def device_type_for(cluster) -> tuple[str, str | None]:
    """("cuda" | "cpu", a note on how the policy was read, or None): a cluster of GPUs
    gets CUDA's policy (probed on fake CUDA tensors, CUDA present or not)."""
    kind = getattr(getattr(cluster, "device", None), "kind", "cpu")
    return ("cuda", None) if kind == "gpu" else ("cpu", None)


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
