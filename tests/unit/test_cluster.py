"""ClusterSpec: presets hold the datasheet numbers, YAML round-trips, units parse, errors
name the file and the field path."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from autopar.cluster import (ClusterSpec, ClusterSpecError, DeviceSpec, LinkSpec, format_quantity,
                             parse_quantity)

PRESETS = ("dgx-a100-80gb", "dgx-h100", "dgx-h200")


# ---------------------------------------------------------------------------- presets

def test_a100_preset_has_published_numbers() -> None:
    spec = ClusterSpec.preset("dgx-a100-80gb")
    assert spec.device.peak_flops == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
    assert spec.device.memory_bytes == 80 * 10**9
    assert spec.device.memory_bandwidth == pytest.approx(2.039e12)
    assert spec.intra_node.bandwidth == 300e9  # NVLink3: 600 GB/s both directions
    assert spec.inter_node.bandwidth == 25e9   # one 200 Gb/s HDR port per GPU
    assert (spec.devices_per_node, spec.device.kind, spec.backend) == (8, "gpu", "nccl")


@pytest.mark.parametrize("name, memory, memory_bandwidth", [
    ("dgx-h100", 80 * 10**9, 3.35e12),
    ("dgx-h200", 141 * 10**9, 4.8e12),
])
def test_hopper_presets_have_published_numbers(name: str, memory: int, memory_bandwidth: float) -> None:
    spec = ClusterSpec.preset(name)
    assert spec.device.peak_flops == pytest.approx(
        {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1979e12})
    assert spec.device.memory_bytes == memory
    assert spec.device.memory_bandwidth == pytest.approx(memory_bandwidth)
    assert spec.intra_node.bandwidth == 450e9  # NVLink4: 900 GB/s both directions
    assert spec.inter_node.bandwidth == 50e9   # one 400 Gb/s NDR port per GPU
    assert (spec.devices_per_node, spec.device.kind, spec.backend) == (8, "gpu", "nccl")


@pytest.mark.parametrize("name", PRESETS)
def test_preset_latencies_are_plausible(name: str) -> None:
    spec = ClusterSpec.preset(name)
    assert 1e-6 <= spec.intra_node.latency_s < spec.inter_node.latency_s <= 10e-6


def test_world_size_is_nodes_times_devices() -> None:
    assert ClusterSpec.preset("dgx-h100").world_size == 8
    assert ClusterSpec.preset("dgx-h100", nodes=4).world_size == 32


def test_preset_name_ignores_case() -> None:
    assert ClusterSpec.preset("DGX-H100") == ClusterSpec.preset("dgx-h100")


def test_unknown_preset_lists_known_names_and_suggests() -> None:
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec.preset("dgx-h10")
    message = str(info.value)
    assert "did you mean 'dgx-h100'?" in message
    assert all(name in message for name in PRESETS)


def test_preset_with_zero_nodes_names_the_field() -> None:
    with pytest.raises(ClusterSpecError, match="nodes: must be >= 1, got 0"):
        ClusterSpec.preset("dgx-h100", nodes=0)


def test_peak_flops_for() -> None:
    spec = ClusterSpec.preset("dgx-a100-80gb")
    assert spec.peak_flops_for("bf16") == 312e12
    with pytest.raises(ClusterSpecError) as info:
        spec.peak_flops_for("fp8")  # the A100 has no fp8 tensor cores
    assert "'fp8'" in str(info.value) and "fp32, tf32, bf16, fp16" in str(info.value)
    with pytest.raises(ClusterSpecError, match="did you mean 'bf16'"):
        spec.peak_flops_for("bf61")


def test_describe() -> None:
    assert ClusterSpec.preset("dgx-h100", nodes=4).describe() == \
        "4 x dgx-h100 nodes = 32 GPUs, 989 TFLOP/s bf16 each, 80 GB"
    assert ClusterSpec.preset("dgx-h200").describe() == \
        "1 x dgx-h200 node = 8 GPUs, 989 TFLOP/s bf16 each, 141 GB"
    assert ClusterSpec.local(2).describe().startswith(
        "1 x local node = 2 CPU processes, 50 GFLOP/s fp32 each, ")


# ------------------------------------------------------------------------------ local

def test_local_two_processes() -> None:
    spec = ClusterSpec.local(2)
    assert (spec.world_size, spec.nodes, spec.backend, spec.device.kind) == (2, 1, "gloo", "cpu")
    assert spec.device.memory_bytes == ClusterSpec.local(1).device.memory_bytes // 2
    assert spec == ClusterSpec.local(2)


def test_local_defaults_to_one_process_per_core() -> None:
    assert ClusterSpec.local().world_size == (os.cpu_count() or 1)


@pytest.mark.parametrize("nprocs", [0, -1, 1.5, True])
def test_local_rejects_bad_nprocs(nprocs: Any) -> None:
    with pytest.raises(ClusterSpecError, match="nprocs: must be an integer >= 1"):
        ClusterSpec.local(nprocs)


# -------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("spec", [*(ClusterSpec.preset(name, nodes=3) for name in PRESETS),
                                  ClusterSpec.local(3)], ids=[*PRESETS, "local"])
def test_yaml_round_trip(spec: ClusterSpec, tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    spec.to_yaml(path)
    assert ClusterSpec.from_yaml(path) == spec
    assert ClusterSpec.from_dict(spec.to_dict()) == spec


def test_to_yaml_writes_human_units(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    ClusterSpec.preset("dgx-a100-80gb").to_yaml(path)
    device = yaml.safe_load(path.read_text())["device"]
    assert device["memory_bytes"] == "80GB"
    assert device["memory_bandwidth"] == "2.039TB/s"
    assert device["peak_flops"]["bf16"] == "312TFLOPS"


def test_handwritten_yaml_with_units_matches_preset(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("""
name: dgx-a100-80gb
nodes: 2
devices_per_node: 8
device:
  name: A100-SXM4-80GB
  kind: gpu
  peak_flops: {fp32: 19.5TFLOPS, tf32: 156 TFLOP/s, bf16: 312TFLOPS, fp16: 3.12e14}
  memory_bytes: 80GB
  memory_bandwidth: 2039 GB/s
intra_node: {bandwidth: 300GB/s, latency_s: 3us}
inter_node: {bandwidth: 200Gb/s, latency_s: 0.008ms}
backend: nccl
""")
    assert ClusterSpec.from_yaml(path) == ClusterSpec.preset("dgx-a100-80gb", nodes=2)


def test_specs_are_frozen() -> None:
    spec = ClusterSpec.preset("dgx-h100")
    with pytest.raises(ValueError):
        spec.nodes = 2  # type: ignore[misc]


# ------------------------------------------------------------------------------- units

@pytest.mark.parametrize("text, kind, expected", [
    ("80GB", "bytes", 80 * 10**9),
    ("80GiB", "bytes", 80 * 2**30),
    ("1.5KiB", "bytes", 1536),
    ("512 MiB", "bytes", 512 * 2**20),
    ("2kB", "bytes", 2000),
    ("8e10", "bytes", 80 * 10**9),
    ("42", "bytes", 42),
    ("300GB/s", "bandwidth", 300e9),
    ("300 GBps", "bandwidth", 300e9),
    ("200Gb/s", "bandwidth", 25e9),  # bits: InfiniBand ports are sold in Gb/s
    ("1GiB/s", "bandwidth", 2**30),
    ("2.039TB/s", "bandwidth", 2.039e12),
    ("312TFLOPS", "flops", 312e12),
    ("312 TFLOP/s", "flops", 312e12),
    ("19.5TFLOPs", "flops", 19.5e12),
    ("50GFLOPS", "flops", 50e9),
    ("1e12", "flops", 1e12),
    ("5us", "seconds", 5e-6),
    ("5\u00b5s", "seconds", 5e-6),
    ("2.5ms", "seconds", 2.5e-3),
    ("100ns", "seconds", 100e-9),
    ("1s", "seconds", 1.0),
    ("5e-6", "seconds", 5e-6),
])
def test_parse_quantity(text: str, kind: Any, expected: float) -> None:
    assert parse_quantity(text, kind) == pytest.approx(expected, rel=1e-15)


def test_parsed_bytes_are_ints() -> None:
    assert isinstance(parse_quantity("80GB", "bytes"), int)
    assert parse_quantity(str(2**60 + 1), "bytes") == 2**60 + 1  # exact past float precision


def test_numbers_pass_through() -> None:
    assert parse_quantity(123, "bytes") == 123
    assert parse_quantity(2.5e-6, "seconds") == 2.5e-6


@pytest.mark.parametrize("value, kind", [
    ("80G", "bytes"),        # a prefix needs its unit: bytes or bits would differ 8x
    ("80GB/s", "bytes"),
    ("80kiB", "bytes"),
    ("300GB", "bandwidth"),
    ("1TB", "flops"),
    ("1KiFLOPS", "flops"),
    ("5 parsecs", "seconds"),
    ("fast", "bandwidth"),
    ("", "bytes"),
    (True, "bytes"),
    (None, "seconds"),
])
def test_parse_quantity_rejects(value: Any, kind: Any) -> None:
    with pytest.raises(ValueError, match="expected"):
        parse_quantity(value, kind)


@pytest.mark.parametrize("value, kind, text", [
    (80 * 10**9, "bytes", "80GB"),
    (80 * 2**30, "bytes", "80GiB"),
    (2.039e12, "bandwidth", "2.039TB/s"),
    (312e12, "flops", "312TFLOPS"),
    (3e-6, "seconds", "3us"),
    (20e-6, "seconds", "20us"),
])
def test_format_quantity_reads_like_a_datasheet(value: float, kind: Any, text: str) -> None:
    assert format_quantity(value, kind) == text


@given(st.integers(min_value=1, max_value=2**62))
def test_format_then_parse_bytes_is_identity(value: int) -> None:
    assert parse_quantity(format_quantity(value, "bytes"), "bytes") == value


@given(st.floats(min_value=1e-12, max_value=1e21, allow_nan=False, allow_infinity=False),
       st.sampled_from(["bandwidth", "flops", "seconds"]))
def test_format_then_parse_is_identity(value: float, kind: Any) -> None:
    assert parse_quantity(format_quantity(value, kind), kind) == value


# ---------------------------------------------------------------------- error messages

def _error_for(tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> str:
    """Write the dgx-h100 preset as YAML after `edit`, load it and return the error message."""
    data = ClusterSpec.preset("dgx-h100").to_dict()
    edit(data)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec.from_yaml(path)
    message = str(info.value)
    assert "For further information" not in message  # no raw pydantic dump
    assert all(line.startswith(str(path)) for line in message.splitlines())
    return message


def test_negative_memory(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d["device"].update(memory_bytes=-1))
    assert message == f"{tmp_path / 'cluster.yaml'}: device.memory_bytes: must be > 0, got -1"


def test_typo_in_field_suggests_the_right_name(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["intra_node"]["bandwith"] = data["intra_node"].pop("bandwidth")

    message = _error_for(tmp_path, edit)
    assert "intra_node.bandwith: unknown field (did you mean 'bandwidth'?)" in message
    assert "intra_node.bandwidth: required field missing" in message


def test_unknown_field_without_a_close_match_lists_fields(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d.update(colour="green"))
    assert "colour: unknown field; expected one of name, nodes, devices_per_node" in message


def test_wrong_type(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d.update(nodes="two"))
    assert message.endswith("cluster.yaml: nodes: must be an integer, got 'two'")


def test_missing_required_field(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d["device"].pop("memory_bandwidth"))
    assert message.endswith("cluster.yaml: device.memory_bandwidth: required field missing")


def test_unparseable_unit(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d["device"].update(memory_bytes="80 gigs"))
    assert "device.memory_bytes: cannot parse '80 gigs' as bytes; expected e.g. 80GB" in message


def test_infinite_latency(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d["inter_node"].update(latency_s=float("inf")))
    assert "inter_node.latency_s: must be a finite number, got inf" in message


def test_unknown_dtype_suggests(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d["device"]["peak_flops"].update(bf61=1.0))
    assert "device.peak_flops.bf61: must be one of" in message and "did you mean 'bf16'?" in message


def test_bad_choice_suggests(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d.update(backend="ncl"))
    assert "backend: must be one of nccl, gloo, got 'ncl' (did you mean 'nccl'?)" in message


def test_nccl_needs_gpus(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d["device"].update(kind="cpu"))
    assert "backend: 'nccl' needs GPUs" in message


def test_section_of_wrong_shape(tmp_path: Path) -> None:
    message = _error_for(tmp_path, lambda d: d.update(device="h100"))
    assert "device: must be a mapping, got str" in message


def test_every_problem_is_reported(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data.update(nodes=0, devices_per_node="8")
        data["device"].update(memory_bytes=-1)

    assert len(_error_for(tmp_path, edit).splitlines()) == 3


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: x\nnodes: 1\n  devices_per_node: 8\n")
    with pytest.raises(ClusterSpecError, match=rf"^{path}:3:\d+: invalid YAML: "):
        ClusterSpec.from_yaml(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(ClusterSpecError, match=f"^{path}: no such file$"):
        ClusterSpec.from_yaml(path)


@pytest.mark.parametrize("text, problem", [("", "file is empty"), ("- a\n- b\n", "got list")])
def test_yaml_that_is_not_a_mapping(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ClusterSpecError, match=problem):
        ClusterSpec.from_yaml(path)


def test_direct_construction_converts_errors() -> None:
    with pytest.raises(ClusterSpecError) as info:
        DeviceSpec(name="d", kind="gpu", peak_flops={"fp32": "1TFLOPS"}, memory_bytes="-1GB",
                   memory_bandwidth="1TB/s")
    assert str(info.value) == "DeviceSpec: memory_bytes: must be > 0, got '-1GB'"
    assert info.value.problems == (("memory_bytes", "must be > 0, got '-1GB'"),)
    with pytest.raises(ClusterSpecError, match="LinkSpec: bandwith: unknown field"):
        LinkSpec(bandwith=1, latency_s="5us")


def test_error_survives_pickling() -> None:
    error = ClusterSpecError("cluster.yaml", [("nodes", "must be >= 1, got 0")])
    assert str(pickle.loads(pickle.dumps(error))) == str(error)
