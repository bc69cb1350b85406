"""Export's metadata assertions under forward hooks: `.float()` / `.to(dtype)` leave an
`_assert_tensor_metadata` of the traced dtype, which AMP's casts (and tensor parallelism's
shards) make false; the re-trace skips exactly those, and the hook-free trace still runs
every one. Also: HiGHS prints nothing to stdout unless the passes log asks for it,
nor from inside autopar.plan."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.passes.defaults import run_passes
from autopar.compiler.ir import trace as trace_mod
from autopar.compiler.ir.trace import _changed_by_hooks
from autopar.compiler.passes import amp_policy
from autopar.compiler.passes.amp_policy import GRAY, HALF_DTYPES, probe
from autopar.examples import hf_tiny, llama
from autopar.compiler.ir.program import LOSS_SCALE_INPUT
from tests.unit.test_amp import _weights_err
from tests.unit.test_trace import eager_grads, run_graph

ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
REPO = Path(__file__).resolve().parents[2]

# dtype changes as users write them: name -> (there, back); `like` is what type_as follows
# (the model's input: fp32 under AMP too; or the last linear's output: half under AMP).
# A round trip ("back" not None) may run an activation in the dtype it went to.
CASTS = {
    "float": (lambda h, like: h.float(), None),
    "to": (lambda h, like: h.to(torch.float32), None),
    "to_dtype_kw": (lambda h, like: h.to(dtype=torch.float32), None),
    "type_as_input": (lambda h, like: h.type_as(like[0]), None),
    "type_as_output": (lambda h, like: h.type_as(like[1]), None),
    "bf16_back": (lambda h, like: h.to(torch.bfloat16), torch.Tensor.float),
    "double_back": (lambda h, like: h.double(), torch.Tensor.float),
    "half_back": (lambda h, like: h.half(), torch.Tensor.float),
}
ACTIVATIONS = {None: lambda h: h, "tanh": torch.tanh, "relu": torch.relu}


def _cast_chain(h, chain, like):
    for name, act in chain:
        there, back = CASTS[name]
        h = there(h, like)
        h = ACTIVATIONS[act](h) if back is None else back(ACTIVATIONS[act](h))
    return h


class CastChains(torch.nn.Module):
    """Linear layers with a chain of dtype changes after each but the last."""

    def __init__(self, chains):
        super().__init__()
        self.chains = chains
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in chains)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = x
        for layer, chain in zip(self.layers, self.chains):
            h = layer(h)
            h = _cast_chain(h, chain, (x, h))
        return self.head(h)


def _loss_of(chain):
    def loss_fn(out, x):
        return F.mse_loss(_cast_chain(out, chain, (x, out)), x[:, :4])
    return loss_fn


@contextlib.contextmanager
def _kept_asserts():
    """Per joint-graph trace inside, the `_assert_tensor_metadata` nodes it kept (before
    _drop_shape_asserts erases them): (asserted dtype, dtype of the value checked)."""
    seen: list[list[tuple[torch.dtype, torch.dtype]]] = []
    drop = trace_mod._drop_shape_asserts

    def spy(gm):
        seen.append(_assert_dtypes(gm.graph))
        drop(gm)
    with mock.patch.object(trace_mod, "_drop_shape_asserts", spy):
        yield seen


def _assert_dtypes(graph) -> list[tuple[torch.dtype, torch.dtype]]:
    return [(_bound(n)["dtype"], n.args[0].meta["val"].dtype) for n in graph.nodes
            if n.target is ASSERT_METADATA and _bound(n).get("dtype") is not None]


def _bound(node) -> dict:
    """A node's arguments by name (export passes dtype by keyword, make_fx by position)."""
    names = [a.name for a in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _exported_asserts(tg):
    return [n for n in tg.source.exported.graph_module.graph.nodes if n.target is ASSERT_METADATA]


def _amp_outputs(tg, model, x):
    """Loss and gradients (by parameter name) of a TrainGraph's gm on real tensors."""
    scale = (torch.ones(()),) if tg.signature.inputs[-1].name == LOSS_SCALE_INPUT else ()
    outs = run_graph(tg, model, (x, *scale))
    grads = {spec.name: outs[tg.signature.grad_output_index(i)]
             for i, spec in enumerate(tg.signature.params)}
    return outs[0], grads


def _autocast_outputs(model, x, loss_fn, amp):
    with torch.autocast("cpu", dtype=HALF_DTYPES[amp]):
        loss, grads = eager_grads(model, (x,), loss_fn)
    return loss, grads


def _to_calls(chains) -> int:
    """How many .float() / .to() the chains make (type_as is an op of its own: no assertion)."""
    return sum(0 if name.startswith("type_as") else 1 + (CASTS[name][1] is not None)
               for chain in chains for name, _ in chain)


chain_strategy = st.lists(st.tuples(st.sampled_from(sorted(CASTS)),
                                    st.sampled_from(sorted(ACTIVATIONS, key=str))), max_size=3)


# no shrinking: each example traces twice (seconds); the failing one is printed as found
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate])
@given(chains=st.lists(chain_strategy, min_size=1, max_size=2), loss_chain=chain_strategy,
       amp=st.sampled_from(["bf16", "fp16"]))
def test_amp_traces_user_dtype_changes_like_autocast(chains, loss_chain, amp):
    torch.manual_seed(0)
    model, x, loss_fn = CastChains(chains), torch.randn(6, 8), _loss_of(loss_chain)
    with _kept_asserts() as seen:
        tg = autopar.trace(model, (x,), loss_fn)
        out, _ = run_passes(tg, autopar.Layout(amp=amp))  # (a): no "Tensor dtype mismatch"
    plain, *amped = seen
    # (b) every assertion a trace kept describes its value; none is left in the graphs
    assert amped and all(a == v for kept in seen for a, v in kept), seen
    assert not _assert_dtypes(tg.graph) and not _assert_dtypes(out.graph)
    # the hook-free trace ran all of export's; AMP's skipped those on a linear's output
    # (now half), at least the first of a chain that starts with .float() / .to()
    chains_and_loss = [*chains, loss_chain]
    assert len(plain) == len(_exported_asserts(tg)) == _to_calls(chains_and_loss)
    on_half = any(c and not c[0][0].startswith("type_as") for c in chains_and_loss)
    assert all(len(kept) < len(plain) if on_half else len(kept) <= len(plain) for kept in amped)
    # (c) loss and gradients within the half dtype's epsilon of eager autocast
    loss, grads = _amp_outputs(out, model, x)
    ref_loss, ref_grads = _autocast_outputs(model, x, loss_fn, amp)
    eps = torch.finfo(HALF_DTYPES[amp]).eps
    assert abs(loss.item() - ref_loss.item()) <= eps * abs(ref_loss.item()), (loss, ref_loss)
    assert _weights_err(grads, ref_grads) <= eps, _weights_err(grads, ref_grads)


def test_to_is_on_no_amp_list_whatever_dtype_it_was_first_probed_with():
    """`x.to(torch.bfloat16)` comes out half because its argument says so, not autocast:
    on the white list (the probe caches per op, for the process) it would send every
    later `.float()` of an fp32 value through bf16 (gradients 0.9% off)."""
    x = torch.randn(6, 8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for device_type in ("cpu", "cuda"):
            assert probe(torch.ops.aten.to.dtype, (x, dtype), {}, device_type,
                         torch.bfloat16) == GRAY, (dtype, device_type)
    with mock.patch.dict(amp_policy._PROBED, clear=True):  # .to(bf16) probed first
        model = CastChains([[("bf16_back", None), ("float", "relu")]])
        tg, _ = run_passes(autopar.trace(model, (x,), _loss_of([])), autopar.Layout(amp="bf16"))
    rows = [r for r in tg.attrs["amp"]["ops"] if r["op"] == "aten.to"]
    assert len(rows) == 3 and all(r["list"] == GRAY for r in rows), rows


class _PassThrough:
    """A forward hook that changes nothing."""

    def call_function(self, node, args, kwargs, run):
        return run(args, kwargs)


def test_unchanged_values_are_still_asserted():
    """_changed_by_hooks on the exported graph's own assertions: False for the traced
    metadata, True for another dtype or a shard; and a false assertion on a value no hook
    changed still fails the trace, hooks or not."""
    tg = autopar.trace(CastChains([[("bf16_back", None)]]), (torch.randn(6, 8),),
                       _loss_of([("float", None)]))
    nodes = _exported_asserts(tg)
    assert len(nodes) == 3
    for node in nodes:
        val = node.args[0].meta["val"]
        traced = torch.empty(val.shape, dtype=val.dtype)
        other = torch.float16 if val.dtype == torch.bfloat16 else torch.bfloat16
        for value, changed in ((traced, False), (traced.to(other), True), (traced[:3], True)):
            assert _changed_by_hooks(node, (value,), dict(node.kwargs)) is changed
    nodes[0].kwargs = {**nodes[0].kwargs, "dtype": torch.float16}  # false of the fp32 value
    tg.source.exported.graph_module.recompile()
    for source in (tg.source, dataclasses.replace(tg.source, hooks=(_PassThrough(),))):
        with pytest.raises(AssertionError, match="Tensor dtype mismatch"):
            trace_mod._trace_from(source)


def _logits_loss(out, ids):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), ids.flatten())


def _local_with_bf16(nprocs: int) -> autopar.ClusterSpec:
    """ClusterSpec.local, whose CPU lists an fp32 rate only (plan refuses amp="bf16" on
    it: no peak FLOP/s for bf16), with a bf16 rate as well."""
    spec = autopar.ClusterSpec.local(nprocs).to_dict()
    spec["device"]["peak_flops"]["bf16"] = spec["device"]["peak_flops"]["fp32"]
    return autopar.ClusterSpec.from_dict(spec)


@pytest.mark.parametrize("factory", [
    lambda: llama(layers=1, hidden=32, heads=2, kv_heads=1, vocab=64, batch=2, seq=8),
    lambda: hf_tiny("qwen2", batch=2, seq=8),
], ids=["llama", "qwen2"])
def test_float_logits_loss_under_bf16(factory):
    """The loss `cross_entropy(logits.flatten(0, 1).float(), ...)` under bf16: export
    asserts the `.float()`'s input is fp32, which AMP changes ("Tensor dtype mismatch"
    if the assertion stayed), and tp=2 must read the flatten."""
    ex = factory()
    tg, _ = run_passes(autopar.trace(ex.model, ex.batch, _logits_loss), autopar.Layout(amp="bf16"))
    ops = {(r["op"], r["module"]): r for r in tg.attrs["amp"]["ops"]}  # "": the loss's
    assert ops["aten.to", ""]["inputs"] == ["bfloat16"] and ops["aten.to", ""]["dtype"] == "float32"
    assert ops["aten.cross_entropy_loss", ""]["inputs"] == ["float32"]
    cluster = _local_with_bf16(2)
    plan = autopar.plan(ex.model, cluster, ex.batch, _logits_loss, amp="bf16", workers=0)
    assert plan.layout.amp == "bf16"
    plan = autopar.plan(ex.model, cluster, ex.batch, _logits_loss, amp="bf16", tp=2, workers=0)
    assert (plan.layout.tp, plan.layout.amp) == (2, "bf16")


_HIGHS_CHILD = """
import autopar
from autopar.compiler.passes.defaults import run_passes
from autopar.examples import mlp
autopar.logs.configure_from_env()
ex = mlp()
tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
run_passes(tg, autopar.Layout(tp=2), autopar.ClusterSpec.local(2))  # tp_solver: HiGHS
"""


def test_highs_prints_nothing_unless_the_passes_log_asks():
    """Fresh processes: HiGHS prints its banner once per process, from its first model."""
    children = {logs: subprocess.Popen(
        [sys.executable, "-c", _HIGHS_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "AUTOPAR_LOGS": logs}, cwd=REPO)
        for logs in ("", "+passes")}
    out = {logs: child.communicate(timeout=300) for logs, child in children.items()}
    assert all(child.returncode == 0 for child in children.values()), out
    assert "HiGHS" not in out[""][0], out[""][0]
    assert "Running HiGHS" in out["+passes"][0], out["+passes"]


_PLAN_CHILD = """
import autopar
from autopar.examples import gpt2
autopar.logs.configure_from_env()
ex = gpt2(layers=2, hidden=64, heads=4, vocab=256, batch=8, seq=32)
plan = autopar.plan(ex.model, autopar.ClusterSpec.local(2), ex.batch, ex.loss_fn, tp=2,
                    workers=0)  # tp_solver: HiGHS, in this process
print("chosen", plan.layout)
"""


def test_plan_prints_nothing_from_highs():
    """A fresh process (HiGHS's banner prints once per process) plans a layout whose
    tensor-parallel placement HiGHS solves: its stdout holds only what the script prints."""
    child = subprocess.run([sys.executable, "-c", _PLAN_CHILD], capture_output=True, text=True,
                           env={**os.environ, "AUTOPAR_LOGS": ""}, cwd=REPO, timeout=300,
                           check=False)
    assert child.returncode == 0, child.stderr
    for word in ("HiGHS", "Copyright", "THIRD_PARTY_NOTICES", "MIP", "Coefficient ranges"):
        assert word not in child.stdout, child.stdout
    assert child.stdout == "chosen Layout(tp=2)\n"
