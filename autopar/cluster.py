"""ClusterSpec: the hardware a training job runs on, from a preset, a YAML file or this machine.

The planner's cost model reads only these numbers: peak dense FLOP/s per dtype, memory
size and bandwidth per device, and an alpha-beta model (latency, bandwidth) of the links
inside a node and between nodes. Presets hold published vendor figures; YAML files
describe anything else and accept human units (see `parse_quantity`).

Units follow vendor datasheets: decimal prefixes are powers of 1000 (1 GB = 1e9 bytes,
1 TFLOPS = 1e12 FLOP/s), binary prefixes powers of 1024 (1 GiB = 2**30 bytes). In a
bandwidth `B` is bytes and `b` bits (`200Gb/s` = 25e9 bytes/s). Link bandwidths are per
direction, per device.

    cluster = ClusterSpec.preset("dgx-h100", nodes=4)
    cluster.describe()   # '4 x dgx-h100 nodes = 32 GPUs, 989 TFLOP/s bf16 each, 80 GB'
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

Kind = Literal["bytes", "bandwidth", "flops", "seconds"]
Dtype = Literal["fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8"]
DTYPES: tuple[str, ...] = get_args(Dtype)


class ClusterSpecError(ValueError):
    """A cluster spec that cannot be used. Each problem is (field path, what is wrong);
    the message prefixes every one with `source` (the file name, preset or constructor)."""

    def __init__(self, source: str, problems: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__("\n".join(f"{source}: {path}: {problem}" if path else f"{source}: {problem}"
                                   for path, problem in self.problems))

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: keeps the exception picklable across processes despite the custom __init__.
        return type(self), (self.source, self.problems)


# ---------------------------------------------------------------------------------- units

_DECIMAL = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_PER_SECOND = {"": 1, "s": 1, "ms": 10**3, "us": 10**6, "\u00b5s": 10**6, "\u03bcs": 10**6, "ns": 10**9}
_QUANTITY = re.compile(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(\S*)\s*")
# The whole unit is optional (a plain number is in base units), but a prefix needs one.
_PREFIX = r"(?P<prefix>[KMGTPE]i|[kKMGTPE])"
_UNIT = {
    "bytes": re.compile(rf"(?:{_PREFIX}?(?P<unit>B))?"),
    "bandwidth": re.compile(rf"(?:{_PREFIX}?(?P<unit>[Bb])(?:/s|ps))?"),
    "flops": re.compile(r"(?:(?P<prefix>[kKMGTPE])?(?P<unit>(?i:flops|flop/s)))?"),
}
_EXAMPLES = {"bytes": "80GB, 80GiB or 8e10", "bandwidth": "300GB/s, 200Gb/s or 3e11",
             "flops": "312TFLOPS or 3.12e14", "seconds": "5us, 2ms or 5e-6"}


def _unit_size(unit: str, kind: Kind) -> Fraction | None:
    """One `unit` in base units (bytes, bytes/s, FLOP/s, seconds), or None if it is not one."""
    if kind == "seconds":
        return Fraction(1, _PER_SECOND[unit]) if unit in _PER_SECOND else None
    match = _UNIT[kind].fullmatch(unit)
    if match is None:
        return None
    prefix = match.group("prefix") or ""
    size = Fraction(_BINARY[prefix] if prefix in _BINARY else _DECIMAL[prefix])
    return size / 8 if match.group("unit") == "b" else size


def parse_quantity(value: Any, kind: Kind) -> float | int:
    """Read a number or a string with units ("80GiB", "300GB/s", "312TFLOPS", "5us").

    Returns base units: bytes (an int when whole), bytes/s, FLOP/s or seconds.
    Numbers pass through unchanged, so range checks stay with the caller.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number or a string like {_EXAMPLES[kind]}, got {value!r}")
    if not isinstance(value, str):
        return value
    match = _QUANTITY.fullmatch(value)
    size = _unit_size(match.group(2), kind) if match else None
    if match is None or size is None:
        raise ValueError(f"cannot parse {value!r} as {kind}; expected e.g. {_EXAMPLES[kind]}")
    # Exact arithmetic, rounded once: "2.039TB/s" gives the same float as 2.039e12 and
    # "20us" the same as 20e-6, which float multiplication does not promise.
    exact = Fraction(match.group(1)) * size
    if kind == "bytes" and exact.denominator == 1:
        return int(exact)
    return float(exact)


def _format_units(kind: Kind) -> list[tuple[str, float]]:
    """(unit, size of one unit) that `format_quantity` may write, preferred first on ties."""
    if kind == "seconds":
        return [(unit, 1 / _PER_SECOND[unit]) for unit in ("s", "ms", "us", "ns")]
    suffix = {"bytes": "B", "bandwidth": "B/s", "flops": "FLOPS"}[kind]
    prefixes = [(p, s) for p, s in reversed(_DECIMAL.items()) if p not in ("", "K")]
    prefixes += list(reversed(_BINARY.items())) if kind == "bytes" else []
    return [(prefix + suffix, size) for prefix, size in prefixes]


def format_quantity(value: float, kind: Kind) -> str:
    """The shortest human form of `value` that `parse_quantity` reads back exactly,
    with a mantissa in [1, 1024): 80e9 bytes -> "80GB", 2**30 -> "1GiB", 3e-6 s -> "3us"."""
    candidates = []
    for unit, size in _format_units(kind):
        mantissa = value / size
        if not 1 <= abs(mantissa) < 1024:
            continue
        for digits in range(1, 18):
            number = f"{mantissa:.{digits}g}"
            if "e" not in number and parse_quantity(number + unit, kind) == value:
                candidates.append(number + unit)
                break
    # A plain number always reads back exactly; it wins only when strictly shorter.
    candidates.append(repr(value))
    return min(candidates, key=len)


def _short(value: float, unit: str) -> str:
    """Three significant digits with a decimal prefix, for messages: '989 TFLOP/s'."""
    for prefix in ("E", "P", "T", "G", "M", "k"):
        if abs(value) >= _DECIMAL[prefix]:
            return f"{value / _DECIMAL[prefix]:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _quantity(kind: Kind) -> BeforeValidator:
    return BeforeValidator(lambda value: parse_quantity(value, kind))


Bytes = Annotated[int, _quantity("bytes"), Field(gt=0)]
Bandwidth = Annotated[float, _quantity("bandwidth"), Field(gt=0, allow_inf_nan=False)]
Flops = Annotated[float, _quantity("flops"), Field(gt=0, allow_inf_nan=False)]
Seconds = Annotated[float, _quantity("seconds"), Field(gt=0, allow_inf_nan=False)]


# ------------------------------------------------------------------------------- models

class _Spec(BaseModel):
    """Frozen, unknown fields refused; construction errors come out as ClusterSpecError."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise _convert(error, type(self), data, type(self).__name__) from None


class DeviceSpec(_Spec):
    """One accelerator (or one CPU process): dense peak FLOP/s per dtype (no sparsity),
    memory size in bytes and memory bandwidth in bytes/s."""

    name: str = Field(min_length=1)
    kind: Literal["gpu", "cpu"]
    peak_flops: dict[Dtype, Flops] = Field(min_length=1)
    memory_bytes: Bytes
    memory_bandwidth: Bandwidth
    # fixed cost of running one op (kernel launch on a GPU, eager dispatch on a CPU);
    # 0 in the presets, measured by `autopar calibrate`
    launch_overhead_s: Annotated[float, _quantity("seconds"), Field(ge=0, allow_inf_nan=False)] = 0.0
    # bytes/s at which a CPU process maps fresh pages: allocations above the C
    # allocator's mmap threshold come from the OS and are zeroed on first touch each
    # time; None on GPUs (the caching allocator reuses memory). `autopar calibrate`.
    first_touch_bandwidth: Bandwidth | None = None
    # measured / modelled time of ops by aten name ("mm", "_log_softmax") and of the
    # optimizer step ("optimizer.adamw"), fitted by `autopar calibrate --model`
    op_time_factors: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = {}
    # the attention kernels the cluster runs: "fused" (FlashAttention or the memory-
    # efficient kernel: torch's sdpa on a GPU; attention a model writes out op by op,
    # transformers' "eager", is costed as it too) or "unfused" (matmul, softmax, matmul
    # with the scores materialised in the model's dtype, for sdpa and written-out
    # attention alike: Megatron-LM of 2021). GPUs only: a CPU runs its own kernels
    attention: Literal["fused", "unfused"] = "fused"
    # the fraction of peak FLOP/s the fused attention kernel reaches (FlashAttention-2's
    # forward reaches about half of an A100's dense peak, its backward less); None: the
    # GEMM efficiency (Efficiency.compute). Read for the fused kernels only
    attention_efficiency: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None


class LinkSpec(_Spec):
    """Alpha-beta model of a link: sending n bytes takes latency_s + n / bandwidth.
    bandwidth is bytes/s per direction, per device."""

    bandwidth: Bandwidth
    latency_s: Seconds


class ClusterSpec(_Spec):
    """`nodes` identical nodes of `devices_per_node` devices each."""

    name: str = Field(min_length=1)
    nodes: int = Field(default=1, ge=1, strict=True)
    devices_per_node: int = Field(ge=1, strict=True)
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    backend: Literal["nccl", "gloo"]

    @field_validator("backend")
    @classmethod
    def _backend_fits_device(cls, backend: str, info: ValidationInfo) -> str:
        device = info.data.get("device")
        if backend == "nccl" and device is not None and device.kind == "cpu":
            raise ValueError("'nccl' needs GPUs; use 'gloo' with device.kind 'cpu'")
        return backend

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def peak_flops_for(self, dtype: str) -> float:
        """Dense peak FLOP/s of one device at `dtype` ("fp32", "bf16", ...)."""
        if dtype in self.device.peak_flops:
            return self.device.peak_flops[dtype]
        listed = ", ".join(self.device.peak_flops)
        problem = (f"no peak FLOP/s listed for dtype {dtype!r} (listed: {listed})"
                   f"{_did_you_mean(dtype, self.device.peak_flops)}")
        raise ClusterSpecError(self.name, [("device.peak_flops", problem)])

    def describe(self) -> str:
        """One line for humans: '4 x dgx-h100 nodes = 32 GPUs, 989 TFLOP/s bf16 each, 80 GB'."""
        flops = self.device.peak_flops
        dtype = next((d for d in ("bf16", "fp32") if d in flops), next(iter(flops)))
        one, many = ("GPU", "GPUs") if self.device.kind == "gpu" else ("CPU process", "CPU processes")
        memory = _short(self.device.memory_bytes, "B")
        return (f"{self.nodes} x {self.name} node{'s' * (self.nodes != 1)} = {self.world_size} "
                f"{one if self.world_size == 1 else many}, "
                f"{_short(flops[dtype], 'FLOP/s')} {dtype} each, {memory}")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_dict(cls, data: Any, source: str = "cluster spec") -> ClusterSpec:
        """Validate plain data (numbers or unit strings); errors name `source` and the field path."""
        if not isinstance(data, Mapping):
            raise ClusterSpecError(source, [("", f"expected a mapping of cluster fields, "
                                                 f"got {type(data).__name__}")])
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise _convert(error, cls, data, source) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ClusterSpec:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ClusterSpecError(source, [("", "no such file")]) from None
        except (OSError, UnicodeDecodeError) as error:
            raise ClusterSpecError(source, [("", f"cannot read: {error}")]) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
            problem = getattr(error, "problem", None) or str(error)
            raise ClusterSpecError(where, [("", f"invalid YAML: {problem}")]) from None
        if data is None:
            raise ClusterSpecError(source, [("", "file is empty; expected cluster fields")])
        return cls.from_dict(data, source=source)

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers in base units (bytes, bytes/s, FLOP/s, seconds)."""
        return self.model_dump()

    def to_yaml(self, path: str | os.PathLike[str]) -> None:
        """Write human units that `from_yaml` reads back to an equal spec."""
        header = ("# autopar ClusterSpec. kB/MB/GB = powers of 1000, KiB/MiB/GiB = powers of 1024;\n"
                  "# link bandwidths are per direction, per device.\n")
        body = yaml.safe_dump(_with_units(self.to_dict()), sort_keys=False, allow_unicode=True)
        Path(path).write_text(header + body, encoding="utf-8")

    @classmethod
    def preset(cls, name: str, nodes: int = 1) -> ClusterSpec:
        """A published machine type, e.g. "dgx-h100", times `nodes`."""
        key = name.strip().lower()
        if key not in _PRESETS:
            raise ClusterSpecError("ClusterSpec.preset", [("", (
                f"unknown preset {name!r}{_did_you_mean(name, _PRESETS)}; "
                f"known presets: {', '.join(_PRESETS)}"))])
        return cls.from_dict({**_PRESETS[key], "name": key, "nodes": nodes}, source=f"preset {key!r}")

    @classmethod
    def local(cls, nprocs: int | None = None) -> ClusterSpec:
        """This machine as `nprocs` CPU processes over gloo (default: one per core)."""
        nprocs = (os.cpu_count() or 1) if nprocs is None else nprocs
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            problem = f"must be an integer >= 1, got {nprocs!r}"
            raise ClusterSpecError("ClusterSpec.local", [("nprocs", problem)])
        # Rough defaults until `autopar calibrate` measures this machine: ~50 GFLOP/s fp32
        # per core (AVX2 FMA at a few GHz, well below peak in practice), ~10 GB/s of DRAM
        # bandwidth per process, and gloo over loopback as `autopar calibrate` fits it on a
        # small host (2 cores, one thread per process): ~1 GB/s after the link efficiency
        # and ~0.4 ms per ring step. gloo copies through TCP sockets on the cores that also
        # compute; priced faster, the tensor-parallel solver trades collectives for
        # elementwise work that gloo does not repay (docs/tensor_parallel.md).
        loopback = {"bandwidth": 1.3e9, "latency_s": 400e-6}
        return cls.from_dict({
            "name": "local", "nodes": 1, "devices_per_node": nprocs, "backend": "gloo",
            "device": {"name": "cpu", "kind": "cpu", "peak_flops": {"fp32": 50e9},
                       "memory_bytes": _total_ram_bytes() // nprocs, "memory_bandwidth": 10e9},
            "intra_node": loopback,
            "inter_node": loopback,  # NOTE: unused with one node; loopback keeps it plausible.
        }, source="ClusterSpec.local")


def _total_ram_bytes() -> int:
    """Physical RAM (the host's, even inside a container with a lower memory limit)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        total = -1
    return total if total > 0 else 8 * 2**30  # unknown: assume a small machine, plans stay safe


_FIELD_KIND: dict[str, Kind] = {"memory_bytes": "bytes", "memory_bandwidth": "bandwidth",
                                "bandwidth": "bandwidth", "latency_s": "seconds",
                                "launch_overhead_s": "seconds",
                                "first_touch_bandwidth": "bandwidth"}


def _human(value: float, kind: Kind) -> float | str:
    text = format_quantity(value, kind)
    return value if text == repr(value) else text  # a plain number stays a YAML number


def _with_units(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "peak_flops":
            out[key] = {dtype: _human(flops, "flops") for dtype, flops in value.items()}
        elif isinstance(value, dict):
            out[key] = _with_units(value)
        elif key in _FIELD_KIND and value is not None:
            out[key] = _human(value, _FIELD_KIND[key])
        else:
            out[key] = value
    return out


# ----------------------------------------------------------------------------- presets

# Latencies are typical per-message figures (NVLink ~2-3 us, InfiniBand ~5-10 us through
# NCCL), not datasheet values; `autopar calibrate` (future) measures them on the machine.
_NVLINK_LATENCY_S = 3e-6
_IB_LATENCY_S = 8e-6

# Sources: "NVIDIA A100 Tensor Core GPU" datasheet (SXM 80GB column, dense figures; the
# sparsity figures are twice these) and "NVIDIA DGX A100" datasheet (8x ConnectX-6
# 200 Gb/s HDR InfiniBand for compute, one per GPU). Memory is the datasheet's 80 GB
# (decimal); the driver reserves part of the 80 GiB anyway, so this errs low.
_A100_80GB = {"name": "A100-SXM4-80GB", "kind": "gpu",
              "peak_flops": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
              "memory_bytes": 80 * 10**9, "memory_bandwidth": 2.039e12}
# Sources: "NVIDIA H100 Tensor Core GPU" datasheet (H100 SXM column; its tf32/bf16/fp16/
# fp8 figures are with sparsity, halved here) and "NVIDIA DGX H100" datasheet (8x
# ConnectX-7 400 Gb/s NDR InfiniBand, one per GPU).
_H100_SXM = {"name": "H100-SXM5-80GB", "kind": "gpu",
             "peak_flops": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12,
                            "fp8": 1979e12},
             "memory_bytes": 80 * 10**9, "memory_bandwidth": 3.35e12}
# Source: "NVIDIA H200 Tensor Core GPU" datasheet (H200 SXM: H100's compute, 141 GB HBM3e
# at 4.8 TB/s) and "NVIDIA DGX H200" datasheet (same NVLink4 and NDR network as DGX H100).
_H200_SXM = {**_H100_SXM, "name": "H200-SXM5-141GB",
             "memory_bytes": 141 * 10**9, "memory_bandwidth": 4.8e12}


def _dgx(device: dict[str, Any], nvlink_total: float, ib_bits_per_gpu: float) -> dict[str, Any]:
    """An 8-GPU DGX node: NVLink totals on datasheets count both directions, IB is in bits/s."""
    return {"devices_per_node": 8, "device": device, "backend": "nccl",
            "intra_node": {"bandwidth": nvlink_total / 2, "latency_s": _NVLINK_LATENCY_S},
            "inter_node": {"bandwidth": ib_bits_per_gpu / 8, "latency_s": _IB_LATENCY_S}}


_PRESETS: dict[str, dict[str, Any]] = {
    "dgx-a100-80gb": _dgx(_A100_80GB, nvlink_total=600e9, ib_bits_per_gpu=200e9),  # NVLink3
    "dgx-h100": _dgx(_H100_SXM, nvlink_total=900e9, ib_bits_per_gpu=400e9),        # NVLink4
    "dgx-h200": _dgx(_H200_SXM, nvlink_total=900e9, ib_bits_per_gpu=400e9),        # NVLink4
}


# ------------------------------------------------------------------------ error messages

_MISSING = object()


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    by_lower = {str(choice).lower(): str(choice) for choice in choices}
    close = difflib.get_close_matches(str(word).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def _raw_at(raw: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if not (isinstance(raw, Mapping) and part in raw):
            return _MISSING
        raw = raw[part]
    return raw


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, ...]:
    """The fields of the model found at `loc` below `model`, or () if none is there."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        inner = field.annotation if field else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return ()
        model = inner
    return tuple(model.model_fields)


def _problem(error: Any, model: type[BaseModel], raw: Any) -> str:
    """One pydantic error as a sentence about the user's value."""
    kind, loc, ctx = error["type"], error["loc"], error.get("ctx", {})
    value = _raw_at(raw, loc)
    value = error.get("input") if value is _MISSING else value
    got = f"got {value!r}"
    if kind == "extra_forbidden":
        fields = _field_names(model, loc[:-1])
        listed = f"; expected one of {', '.join(fields)}" if fields else ""
        hint = _did_you_mean(loc[-1], fields) or listed
        return f"unknown field{hint}"
    if kind == "missing":
        return "required field missing"
    if kind in ("greater_than", "greater_than_equal"):
        op, bound = (">", ctx.get("gt")) if kind == "greater_than" else (">=", ctx.get("ge"))
        return f"must be {op} {bound}, {got}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        return f"must be one of {', '.join(choices)}, {got}{_did_you_mean(str(value), choices)}"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping, got {type(value).__name__}"
    simple = {"finite_number": "must be a finite number", "too_short": "must not be empty",
              "string_type": "must be a string", "string_too_short": "must not be empty"}
    if kind in simple:
        return f"{simple[kind]}, {got}"
    if kind.startswith("int_"):
        return f"must be an integer, {got}"
    if kind.startswith("float_"):
        return f"must be a number, {got}"
    return f"{error['msg']}, {got}"


def _convert(error: ValidationError, model: type[BaseModel], raw: Any, source: str) -> ClusterSpecError:
    problems: list[tuple[str, str]] = []
    for e in error.errors():
        path = ".".join(str(p) for p in e["loc"] if p != "[key]")
        cause = e.get("ctx", {}).get("error")
        # NOTE: pydantic validates nested specs through _Spec.__init__, which already
        # converted their errors; re-root those under this field's path.
        if isinstance(cause, ClusterSpecError):
            problems += [(".".join(filter(None, (path, p))), m) for p, m in cause.problems]
        else:
            problems.append((path, _problem(e, model, raw)))
    return ClusterSpecError(source, problems)
