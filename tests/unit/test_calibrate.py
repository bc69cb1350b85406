"""Calibration: the alpha-beta fit by hand, the launch overhead in the cost model,
the written spec read back, and the measurements themselves on this machine."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar import calibrate as cal
from autopar import costs
from autopar.compiler.planner import cost_model as cm
from autopar.compiler.analysis.summary import GraphSummary, OpRecord
from tests.unit.test_cost_model import EXACT, cluster


def test_ring_fit_recovers_bandwidth_and_latency():
    bw, alpha, p = 2e9, 50e-6, 4
    samples = [(n, 2 * (p - 1) / p * n / bw + 2 * (p - 1) * alpha) for n in (1e4, 1e6, 1e8)]
    fitted = cal.fit_ring(samples, p)
    assert fitted == pytest.approx((bw, alpha), rel=1e-9)
    with pytest.raises(RuntimeError, match="did not grow with size"):
        cal.fit_ring([(1e4, 2.0), (1e8, 1.0)], 2)


def test_launch_overhead_is_added_to_every_op_but_inputs():
    base = cluster().to_dict()
    slow = autopar.ClusterSpec.from_dict(
        {**base, "device": {**base["device"], "launch_overhead_s": "10us"}})
    ops = (OpRecord("x", "input"), OpRecord("view", "forward"),
           OpRecord("mm", "forward", flops=int(1e12), dtype="fp32"))
    summary = GraphSummary(ops, (), (), 0, frozenset())
    layout = autopar.Layout()
    fast_compute = cm.simulate_streams(summary, cluster(), layout, EXACT)[0]
    slow_compute = cm.simulate_streams(summary, slow, layout, EXACT)[0]
    assert fast_compute == pytest.approx(1.0) and slow_compute == pytest.approx(1.0 + 2 * 10e-6)


def test_measured_spec_reproduces_the_measurements_with_default_efficiency(tmp_path):
    m = cal.Measurements(matmul_flops=7e10, memory_bandwidth=2e10, launch_overhead_s=2e-6,
                         link_bandwidth=1e9, link_latency_s=1e-4, all_reduce=())
    spec = m.cluster(2)
    spec.to_yaml(tmp_path / "c.yaml")
    again = autopar.ClusterSpec.from_yaml(tmp_path / "c.yaml")
    assert again == spec and again.world_size == 2
    eff = costs.DEFAULT_EFFICIENCY
    assert again.device.peak_flops["fp32"] * eff.compute == pytest.approx(7e10)
    assert again.intra_node.bandwidth * eff.link == pytest.approx(1e9)
    assert again.device.launch_overhead_s == pytest.approx(2e-6)


def test_measurements_on_this_machine():
    assert cal.measure_matmul(256, 3) > 1e8  # a 2026 CPU core does more than 0.1 GFLOP/s
    assert cal.measure_memory_bandwidth(2**24, 3) > 1e8
    assert 0 < cal.measure_launch_overhead(200, 3) < 1e-3
    samples = cal.measure_all_reduce(2, sizes=(2**12, 2**20), repeats=3)
    assert [n for n, _ in samples] == [2**12, 2**20] and all(t > 0 for _, t in samples)


# -- what the roofline misses on a CPU, and fitting it to a model -------------------------------

def _device(c: autopar.ClusterSpec, **fields) -> autopar.ClusterSpec:
    data = c.to_dict()
    return autopar.ClusterSpec.from_dict({**data, "device": {**data["device"], **fields}})


def test_large_fresh_allocations_pay_first_touch_small_ones_do_not():
    c = _device(cluster(), first_touch_bandwidth=1e9)
    big, small = 64 * 2**20, 2**20
    assert costs.MMAP_THRESHOLD < big
    plain = costs.kernel_time("clone", 0, big, 0, "fp32", c, EXACT)
    assert plain == pytest.approx(big / 1e11)
    assert costs.kernel_time("clone", 0, big, big, "fp32", c, EXACT) == pytest.approx(plain + big / 1e9)
    assert costs.kernel_time("clone", 0, small, small, "fp32", c, EXACT) == pytest.approx(small / 1e11)
    assert costs.kernel_time("clone", 0, big, big, "fp32", cluster(), EXACT) == pytest.approx(plain)


def test_fitted_factors_scale_their_op_and_the_optimizer_step():
    c = _device(cluster(), op_time_factors={"mm": 3.0, "optimizer.adamw": 2.0})
    assert costs.kernel_time("mm", 1e12, 0, 0, "fp32", c, EXACT) == pytest.approx(3.0)
    assert costs.kernel_time("addmm", 1e12, 0, 0, "fp32", c, EXACT) == pytest.approx(1.0)
    base = costs.optimizer_time(10**9, "adamw", cluster(), EXACT)
    assert base == pytest.approx(21e9 / 1e11)  # torch's default: one pass per op
    assert costs.optimizer_time(10**9, "adamw", c, EXACT) == pytest.approx(2 * base)
    assert costs.optimizer_time(10**9, "sgd", c, EXACT) == pytest.approx(3e9 / 1e11)


def test_the_optimizer_step_streams_what_torchs_implementation_reads_and_writes():
    """The default implementations run one pass per op; the fused kernels read parameter,
    gradient and states once and write parameter and states once."""
    traffic = {kind: costs.optimizer_traffic(1, kind) for kind in costs.OPTIMIZER_STATES}
    assert traffic == {"adamw": 21, "adam": 19, "sgd-momentum": 8, "sgd": 3,
                       "adamw-fused": 7, "adam-fused": 7, "sgd-momentum-fused": 5,
                       "sgd-fused": 3}
    # AdamW's default op sequence, counted from the foreach ops it runs on a tensor of
    # one element: the count above is the number of tensor reads and writes they make
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Accesses(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            schema = func._schema
            given = dict(zip((a.name for a in schema.arguments), args)) | kwargs

            def sized(x):  # the parameter-sized tensors in an argument or result
                return sum(1 for t in torch.utils._pytree.tree_leaves(x)
                           if isinstance(t, torch.Tensor) and t.numel() == 1000)
            # reads: every parameter-sized input; writes: those an op writes in place
            # (schema Tensor(a!)) and those it returns new
            self.count += sized(list(given.values()))
            # (the fused kernels' schemas mark the gradients written: they unscale them
            # in place when given a grad_scale, which this step is not)
            self.count += sum(sized(given.get(a.name)) for a in schema.arguments
                              if a.alias_info is not None and a.alias_info.is_write
                              and not (a.name == "grads" and given.get("grad_scale") is None))
            fresh = [r for r, ret in zip(out if isinstance(out, tuple) else (out,),
                                         schema.returns) if ret.alias_info is None]
            self.count += sized(fresh)
            return out
    # foreach=True is the implementation torch picks on CUDA, False the CPU's;
    # fused=True one kernel
    for kind, make in [(kind, make) for foreach in (False, True) for kind, make in (
            ("adamw", lambda p, f=foreach: torch.optim.AdamW(p, foreach=f)),
            ("adam", lambda p, f=foreach: torch.optim.Adam(p, foreach=f)),
            ("sgd-momentum", lambda p, f=foreach: torch.optim.SGD(p, lr=0.1, momentum=0.9,
                                                                  foreach=f)),
            ("sgd", lambda p, f=foreach: torch.optim.SGD(p, lr=0.1, foreach=f)))] + [
            ("adamw-fused", lambda p: torch.optim.AdamW(p, fused=True)),
            ("adam-fused", lambda p: torch.optim.Adam(p, fused=True)),
            ("sgd-momentum-fused", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9,
                                                             fused=True)),
            ("sgd-fused", lambda p: torch.optim.SGD(p, lr=0.1, fused=True))]:
        p = torch.nn.Parameter(torch.ones(1000))
        p.grad = torch.ones(1000)
        opt = make([p])
        opt.step()  # the first step makes the states
        with Accesses() as seen:
            opt.step()
        assert seen.count == traffic[kind], kind


def test_a_view_launches_nothing_on_a_gpu():
    gpu = _device(cluster(), kind="gpu", launch_overhead_s=5e-6)
    cpu = _device(cluster(), launch_overhead_s=5e-6)
    assert costs.kernel_time("view", 0, 0, 0, "fp32", gpu, EXACT) == 0
    assert costs.kernel_time("view", 0, 0, 0, "fp32", cpu, EXACT) == 5e-6
    assert costs.kernel_time("add", 0, 10**6, 0, "fp32", gpu, EXACT) == pytest.approx(
        5e-6 + 1e6 / 1e11)


def test_fused_region_costs_its_members_on_a_cpu_and_one_kernel_on_a_gpu():
    members = (("mul", 0, 4 * 10**8, 0), ("add", 0, 4 * 10**8, 0), ("tanh", 0, 4 * 10**8, 0))
    fused = OpRecord("fused", "forward", bytes=2 * 10**8, dtype="fp32", target="fused",
                     members=members)
    summary = GraphSummary((fused,), (), (), 0, frozenset())
    cpu = _device(cluster(), launch_overhead_s=1e-6)
    compute = cm.simulate_streams(summary, cpu, autopar.Layout(), EXACT)[0]
    assert compute == pytest.approx(3 * (1e-6 + 4e8 / 1e11))
    gpu = _device(cluster(), kind="gpu", launch_overhead_s=1e-6)
    compute = cm.simulate_streams(summary, gpu, autopar.Layout(), EXACT)[0]
    assert compute == pytest.approx(1e-6 + 2e8 / 1e11)
    # the fallback's fresh allocations pay first touch like any op's
    big = OpRecord("fused", "forward", bytes=1, dtype="fp32", target="fused",
                   members=(("exp", 0, 2 * 10**8, 10**8),))
    touch = _device(cpu, first_touch_bandwidth=1e9)
    compute = cm.simulate_streams(GraphSummary((big,), (), (), 0, frozenset()), touch,
                                  autopar.Layout(), EXACT)[0]
    assert compute == pytest.approx(1e-6 + 2e8 / 1e11 + 1e8 / 1e9)


def test_op_factors_are_measured_over_modelled_per_op():
    from autopar.compiler.analysis.summary import summarize
    from autopar.examples import load_example

    ex = load_example("mlp")
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    summary = summarize(tg)
    c = cluster(flops=1e9, bandwidth=1e9)
    records = dict(zip(tg.call_nodes(), summary.ops[len(summary.ops) - len(tg.call_nodes()):]))
    # pretend every mm ran 2x and every other op with work 5x its modelled time
    measured = {n: costs.kernel_time(op.target, op.flops, op.bytes, op.allocates, op.dtype, c)
                * (2.0 if op.target == "mm" else 5.0) for n, op in records.items()}
    factors = cal._op_factors(tg, summary, measured, c, min_seconds=0.0)
    assert factors["mm"] == pytest.approx(2.0)
    assert factors and all(v == pytest.approx(5.0) for k, v in factors.items() if k != "mm")
    assert "view" not in factors and "t" not in factors  # no work: the plain model stays
    few = cal._op_factors(tg, summary, measured, c, min_seconds=1e9)
    assert few == {}  # nothing measured long enough to fit


def test_fit_model_on_this_machine_and_the_spec_reads_back(tmp_path):
    from autopar.examples import load_example

    ex = load_example("mlp")
    c = _device(cluster(flops=5e10, bandwidth=2e10), first_touch_bandwidth=2e9)
    factors = cal.fit_model(ex.model, ex.batch, ex.loss_fn, c, repeats=2, min_seconds=0.0)
    assert "addmm" in factors or "mm" in factors
    assert {f"optimizer.{k}" for k in costs.OPTIMIZER_STATES} <= set(factors)
    assert all(v > 0 for v in factors.values())
    fitted = _device(c, op_time_factors=factors)
    fitted.to_yaml(tmp_path / "c.yaml")
    assert autopar.ClusterSpec.from_yaml(tmp_path / "c.yaml") == fitted
    # a timing, so no speed is asserted: beside the suite's torchrun jobs a fresh tensor can
    # fill no slower than a mapped one, and the measurement then says the machine is busy
    try:
        touch = cal.measure_first_touch(2**26, 3)
    except RuntimeError as busy:
        assert "too busy to calibrate" in str(busy)
    else:
        assert touch > 0


# -- GPUs: the spec a GPU calibration writes (on this CPU), the measurements on a GPU ------------

def test_a_gpu_calibration_writes_gpus_over_nccl_with_a_peak_per_dtype(tmp_path):
    m = cal.Measurements(matmul_flops=5e13, memory_bandwidth=3e12, launch_overhead_s=5e-6,
                         link_bandwidth=2e11, link_latency_s=8e-6, all_reduce=(),
                         gpu="NVIDIA H100 80GB HBM3", gpu_memory_bytes=85 * 10**9,
                         gpu_flops=(("fp32", 5e13), ("bf16", 7e14), ("fp16", 7.2e14)))
    spec = m.cluster(4)
    spec.to_yaml(tmp_path / "gpu.yaml")
    again = autopar.ClusterSpec.from_yaml(tmp_path / "gpu.yaml")
    assert again == spec
    assert (spec.device.kind, spec.backend, spec.world_size) == ("gpu", "nccl", 4)
    eff = costs.DEFAULT_EFFICIENCY
    assert {d: f * eff.compute for d, f in spec.device.peak_flops.items()} == pytest.approx(
        {"fp32": 5e13, "bf16": 7e14, "fp16": 7.2e14})
    assert spec.device.memory_bytes == 85 * 10**9 and spec.device.first_touch_bandwidth is None
    assert spec.intra_node.bandwidth * eff.link == pytest.approx(2e11)
    # the planner reads it as any preset: bf16 steps are costed at the bf16 peak
    assert spec.peak_flops_for("bf16") > spec.peak_flops_for("fp32")


def test_calibrating_gpus_without_enough_of_them_says_how_many_there_are(capsys):
    import torch

    from autopar.cli import main

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(RuntimeError, match=f"2 GPUs needs 2 on this machine .* it has {count}"):
        cal.calibrate(2, "cuda")
    if count == 0:
        with pytest.raises(SystemExit, match="--device cpu"):
            main(["calibrate", "--device", "cuda", "--output", "unused.yaml"])
    with pytest.raises(SystemExit, match="not built yet"):
        main(["calibrate", "--device", "cuda", "--model", "gpt2-small4"])
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        cal.calibrate(2, "tpu")


def test_one_gpu_is_calibrated_onto_the_cluster_it_belongs_to(tmp_path):
    """One GPU measures the device and the fused attention kernel, not a link: the spec is
    the named cluster (its nodes, links, backend) with the measured device."""
    m = cal.Measurements(matmul_flops=5e13, memory_bandwidth=3e12, launch_overhead_s=5e-6,
                         link_bandwidth=None, link_latency_s=None, all_reduce=(),
                         gpu="NVIDIA H100 80GB HBM3", gpu_memory_bytes=85 * 10**9,
                         gpu_flops=(("fp32", 5e13), ("bf16", 7e14), ("fp16", 7.2e14)),
                         attention_flops=4e14, attention_dtype="bf16")
    with pytest.raises(ValueError, match="--cluster with a preset"):
        m.cluster(1)
    base = autopar.ClusterSpec.preset("dgx-h100", nodes=4)
    spec = m.cluster(1, base=base)
    eff = costs.DEFAULT_EFFICIENCY
    assert (spec.nodes, spec.devices_per_node, spec.backend) == (4, 8, "nccl")
    assert spec.intra_node == base.intra_node and spec.inter_node == base.inter_node
    assert spec.device.peak_flops["bf16"] * eff.compute == pytest.approx(7e14)
    assert spec.device.launch_overhead_s == 5e-6 and spec.device.memory_bytes == 85 * 10**9
    # the kernel's rate over the spec's bf16 peak: 4e14 / (7e14 / 0.7)
    assert spec.device.attention_efficiency == pytest.approx(4e14 * eff.compute / 7e14)
    spec.to_yaml(tmp_path / "h100.yaml")
    assert autopar.ClusterSpec.from_yaml(tmp_path / "h100.yaml") == spec
    # with a measured node link the node's link is it; the network stays the base's
    two = dataclasses.replace(m, link_bandwidth=2e11, link_latency_s=8e-6).cluster(2, base=base)
    assert two.intra_node.bandwidth * eff.link == pytest.approx(2e11)
    assert two.inter_node == base.inter_node
    # a kernel faster than the spec's peak is capped at the peak
    fast = dataclasses.replace(m, attention_flops=2e15).cluster(1, base=base)
    assert fast.device.attention_efficiency == 1.0
    with pytest.raises(ValueError, match="--device cuda"):
        cal.Measurements(1e9, 1e9, 1e-6, 1e9, 1e-5, ()).cluster(2, base=base)


def test_calibrate_cli_names_the_cluster_a_single_gpu_needs():
    from autopar.cli import main

    with pytest.raises(SystemExit, match="--cluster dgx-h100"):
        main(["calibrate", "--device", "cuda", "--nproc", "1", "--output", "unused.yaml"])
    with pytest.raises(SystemExit, match="--device cuda"):
        main(["calibrate", "--device", "cpu", "--cluster", "dgx-h100", "--output", "x.yaml"])
    with pytest.raises(SystemExit, match="this machine's CPU"):
        main(["calibrate", "--device", "cuda", "--cluster", "local", "--output", "x.yaml"])


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a GPU")
def test_one_gpus_measurements(tmp_path):
    m = cal.calibrate_gpu(1)
    assert m.link_bandwidth is None and m.attention_flops > 1e12
    spec = m.cluster(1, base=autopar.ClusterSpec.preset("dgx-h100"))
    assert 0 < spec.device.attention_efficiency <= 1


@pytest.mark.skipif("not __import__('torch').cuda.is_available() or "
                    "__import__('torch').cuda.device_count() < 2", reason="needs two GPUs")
def test_measurements_on_this_machines_gpus():
    m = cal.calibrate_gpu(2)
    peaks = dict(m.gpu_flops)
    assert peaks["fp32"] > 1e12 and peaks.get("bf16", peaks["fp16"]) > peaks["fp32"]
    assert m.memory_bandwidth > 1e11 and 0 < m.launch_overhead_s < 1e-3
    assert m.link_bandwidth > 1e9 and m.gpu_memory_bytes > 0
    assert m.cluster(2).backend == "nccl"
