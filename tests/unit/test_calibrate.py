"""Calibration: the alpha-beta fit by hand, the launch overhead in the cost model,
the written spec read back, and the measurements themselves on this machine."""

from __future__ import annotations

import pytest

import autopar
from autopar import calibrate as cal
from autopar.compiler.planner import cost_model as cm
from autopar.compiler.planner.summary import GraphSummary, OpRecord
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
    eff = cm.DEFAULT_EFFICIENCY
    assert again.device.peak_flops["fp32"] * eff.compute == pytest.approx(7e10)
    assert again.intra_node.bandwidth * eff.link == pytest.approx(1e9)
    assert again.device.launch_overhead_s == pytest.approx(2e-6)


def test_measurements_on_this_machine():
    assert cal.measure_matmul(256, 3) > 1e8  # a 2026 CPU core does more than 0.1 GFLOP/s
    assert cal.measure_memory_bandwidth(2**24, 3) > 1e8
    assert 0 < cal.measure_launch_overhead(200, 3) < 1e-3
    samples = cal.measure_all_reduce(2, sizes=(2**12, 2**20), repeats=3)
    assert [n for n, _ in samples] == [2**12, 2**20] and all(t > 0 for _, t in samples)
