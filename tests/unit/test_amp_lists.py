"""AMP op lists: properties of the casts, user overrides, errors, wiring, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.trace import trace_train_step
from autopar.compiler.ir.verify import verify
from autopar.compiler.passes.amp import AutoMixedPrecision
from autopar.compiler.passes.amp_policy import HALF_DTYPES, AmpListError, op_key, parse_amp_lists
from autopar.compiler.passes.base import PassContext
from autopar.compiler.passes.defaults import default_passes
from autopar.examples import mlp
from autopar.layout import Layout, LayoutError

HALVES = {torch.bfloat16, torch.float16}
ACTIVATIONS = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU, "gelu": torch.nn.GELU,
               "softmax": lambda: torch.nn.Softmax(-1), "layer_norm": lambda: torch.nn.LayerNorm(8)}
# ops a user might move; "linear"/"addmm" are white by default, "mse_loss" black
MOVABLE = ["linear", "addmm", "mse_loss", "tanh", "relu", "gelu", "softmax", "layer_norm"]


def _model(acts):
    layers = []
    for name in acts:
        layers += [torch.nn.Linear(8, 8), ACTIVATIONS[name]()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 4))


def _amp(model, amp, lists=None):
    x = torch.randn(6, 8)
    tg = trace_train_step(model, (x,), lambda out, x: torch.nn.functional.mse_loss(out, x[:, :4]))
    out, result = AutoMixedPrecision(amp_lists=lists).run(tg, PassContext(Layout(amp=amp)))
    verify(out)
    return out, result


def _tensors(value):
    return [t for t in torch.utils._pytree.tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _forward_nodes(tg):
    return [n for n in tg.call_nodes() if n.meta[M.ROLE] in (M.Role.FORWARD, M.Role.LOSS)]


lists_strategy = st.dictionaries(st.sampled_from(MOVABLE), st.sampled_from(["white", "black", "gray"]),
                                 max_size=4)


@settings(max_examples=12, deadline=None)
@given(acts=st.lists(st.sampled_from(sorted(ACTIVATIONS)), min_size=1, max_size=3),
       amp=st.sampled_from(["bf16", "fp16"]), moves=lists_strategy)
def test_no_black_op_runs_in_half_precision(acts, amp, moves):
    lists: dict[str, list[str]] = {}
    for op, where in moves.items():
        lists.setdefault(where, []).append(op)
    tg, _ = _amp(_model(acts), amp, lists)
    rows = tg.attrs["amp"]["ops"]
    black = {r["op"] for r in rows if r["list"] == "black"}
    for r in rows:  # at the level the pass decides (the exported forward's ops)
        if r["list"] == "black":
            assert r["dtype"] == "float32" and set(r["inputs"]) <= {"float32"}, r
        assert r["reason"] == ("user" if r["op"].removeprefix("aten.") in moves else r["list"])
    for n in tg.call_nodes():  # and in the joint graph, backward included
        if isinstance(n.target, torch._ops.OpOverload) and op_key(n.target) in black:
            dtypes = {t.dtype for t in _tensors(n.meta[M.VAL])}
            dtypes |= {a.meta[M.VAL].dtype for a in n.all_input_nodes
                       if isinstance(a.meta.get(M.VAL), torch.Tensor)}
            assert not dtypes & HALVES, (n.format_node(), dtypes)


@settings(max_examples=12, deadline=None)
@given(acts=st.lists(st.sampled_from(sorted(ACTIVATIONS)), min_size=1, max_size=3),
       amp=st.sampled_from(["bf16", "fp16"]), moves=lists_strategy)
def test_no_leaf_is_cast_twice_and_no_cast_is_a_no_op(acts, amp, moves):
    """Weights and inputs (placeholders) are cast at most once per dtype; no cast keeps
    the dtype, and no weight is cast back from its own half copy."""
    lists: dict[str, list[str]] = {}
    for op, where in moves.items():
        lists.setdefault(where, []).append(op)
    tg, _ = _amp(_model(acts), amp, lists)
    seen = set()
    for n in _forward_nodes(tg):
        if n.target != torch.ops.aten._to_copy.default:
            continue
        (src,), dtype = n.args, n.meta[M.VAL].dtype
        assert dtype != src.meta[M.VAL].dtype, n.format_node()
        if src.op == "placeholder":
            assert (src, dtype) not in seen, f"{src.name} cast to {dtype} twice"
            seen.add((src, dtype))
        if src.target == torch.ops.aten._to_copy.default and src.args[0].op == "placeholder":
            assert src.args[0].meta[M.VAL].dtype != dtype, f"{n.name} casts a weight back"


def test_weight_used_twice_is_cast_once():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(self.fc(x))[:, :4]

    tg, result = _amp(Twice(), "bf16")
    casts = [n for n in _forward_nodes(tg) if n.target == torch.ops.aten._to_copy.default
             and n.args[0].name == "p_fc_weight"]
    assert len(casts) == 1 and result.stats["white"] == 2


def test_golden_linear_then_black_loss():
    """The pass's docstring example: weights and input cast to bf16 once, the loss in fp32."""
    tg, result = _amp(torch.nn.Linear(8, 4), "bf16")
    fwd = [(n.target.__name__.split(".")[0], n.meta[M.VAL].dtype) for n in _forward_nodes(tg)
           if n.target in (torch.ops.aten._to_copy.default, torch.ops.aten.addmm.default,
                           torch.ops.aten.mse_loss.default)]
    bf, f32 = torch.bfloat16, torch.float32
    assert fwd == [("_to_copy", bf), ("_to_copy", bf), ("_to_copy", bf), ("addmm", bf),
                   ("_to_copy", f32), ("mse_loss", f32)], fwd
    # gray: slicing the target and mse_loss's broadcast_tensors (bf16 output, as in eager)
    assert result.stats == {"white": 1, "gray": 2, "black": 1, "casts": 4, "half_ops": 2}
    assert all(tg.signature.params[i].dtype == f32 and g.meta[M.VAL].dtype == f32
               for i, g in enumerate(tg.grad_nodes()))  # master weights and gradients fp32


def test_user_override_moves_an_op_and_the_report_shows_it():
    model = _model(["tanh"])
    default, _ = _amp(model, "bf16")
    moved, result = _amp(model, "bf16", {"black": ["aten.linear"], "white": ["mse_loss"]})
    rows = {r["node"]: r for r in moved.attrs["amp"]["ops"]}
    before = {r["node"]: r for r in default.attrs["amp"]["ops"]}
    assert before["linear"]["list"] == "white" and before["linear"]["dtype"] == "bfloat16"
    assert rows["linear"] == {**before["linear"], "list": "black", "reason": "user",
                              "inputs": ["float32"], "dtype": "float32"}
    assert before["mse_loss"]["list"] == "black"
    assert rows["mse_loss"]["list"] == "white" and rows["mse_loss"]["dtype"] == "bfloat16"
    assert result.stats["user"] == 3  # two linears and the loss


def test_unknown_op_and_list_names_suggest_a_fix():
    with pytest.raises(AmpListError, match="did you mean 'linear'"):
        parse_amp_lists({"white": ["lineer"]})
    with pytest.raises(AmpListError, match="the lists are"):
        parse_amp_lists({"grey": ["mm"]})
    with pytest.raises(AmpListError, match="both"):
        parse_amp_lists({"white": ["mm"], "black": ["aten::mm"]})
    assert parse_amp_lists({"white": ["aten.mm.default", "bmm"]}) == {"aten.mm": "white",
                                                                     "aten.bmm": "white"}
    example = mlp()
    with pytest.raises(AmpListError, match="softmx"):
        autopar.compile(example.model, None, example.batch, example.loss_fn,
                        layout=Layout(amp="bf16"), amp_lists={"black": ["softmx"]})


def test_wiring_amp_after_tensor_parallel_and_fp16_micro_batches():
    assert [p.name for p in default_passes(Layout(amp="bf16", dp=2, fusion=False))] == [
        "amp", "global_loss_mean", "sync_batch_norm", "insert_allreduce"]
    assert [p.name for p in default_passes(Layout(amp="bf16", dp=2, tp=2, fusion=False))] == [
        "tensor_parallel", "amp", "global_loss_mean", "sync_batch_norm",
        "insert_allreduce"]  # AMP wraps TP
    assert [p.name for p in default_passes(Layout(fusion=False))] == []
    example = mlp()
    accumulated = autopar.compile(copy.deepcopy(example.model), None, example.batch,
                                  example.loss_fn, layout=Layout(amp="fp16", microbatches=2))
    assert accumulated.program.grad_divisor == 2 and accumulated.loss_scaler is not None
    accumulated(*example.batch)
    assert accumulated.loss_scaler.get_scale() == 2.0 ** 16
    with pytest.raises(LayoutError, match="no 'amp' pass"):
        autopar.compile(example.model, None, example.batch, example.loss_fn,
                        layout=Layout(amp="bf16"), passes=[])
    step = autopar.compile(copy.deepcopy(example.model), None, example.batch, example.loss_fn,
                           layout=Layout(amp="bf16"), amp_lists={"black": ["linear"]})
    assert step.pass_results[0].stats["user"] == 3 and step.loss_scaler is None


def test_loss_scaler_state_is_checkpointed(tmp_path):
    example = mlp()
    step = autopar.compile(copy.deepcopy(example.model), None, example.batch, example.loss_fn,
                           layout=Layout(amp="fp16"))
    step(*example.batch)
    step.save(tmp_path / "ckpt")
    saved = step.loss_scaler.get_scale()
    huge = tuple(x * 1e6 for x in example.batch)  # overflows fp16: the scale halves
    step(*huge)
    assert step.loss_scaler.get_scale() == saved / 2 and step.loss_scaler.skipped_steps == 1
    step.load(tmp_path / "ckpt")
    assert step.loss_scaler.get_scale() == saved


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_policy_read_from_autocast_for_the_clusters_device(device_type):
    """CUDA's lists are read on this CPU-only machine too (fake CUDA tensors through the
    AutocastCUDA kernels); the entries are autocast's documented ones."""
    from autopar.compiler.passes.amp_policy import BLACK, GRAY, WHITE, probe

    x, ids = torch.randn(8, 16), torch.randint(0, 16, (8,))
    cases = [(torch.ops.aten.mm.default, (x, x.t()), WHITE),
             (torch.ops.aten.add.Tensor, (x, x), GRAY),
             # composite: its log_softmax is what autocast upcasts, on both devices
             (torch.ops.aten.cross_entropy_loss.default, (x, ids, None, 1, -100, 0.0), BLACK)]
    if device_type == "cuda":  # fp32 on CUDA's list, not on the CPU's
        cases += [(torch.ops.aten.exp.default, (x,), BLACK),
                  (torch.ops.aten.rsqrt.default, (x,), BLACK),
                  (torch.ops.aten.native_layer_norm.default, (x, [16], None, None, 1e-5), BLACK)]
    for op, args, want in cases:
        assert probe(op, args, {}, device_type, torch.float16) == want, (op, device_type)


def test_a_gpu_cluster_gets_the_cuda_policy_without_cuda():
    tg = trace_train_step(mlp().model, mlp().batch, mlp().loss_fn)
    out, result = AutoMixedPrecision().run(
        tg, PassContext(Layout(amp="bf16"), cluster=autopar.ClusterSpec.preset("dgx-h100")))
    assert out.attrs["amp"]["device_type"] == "cuda" and not result.declined
    assert torch.is_autocast_enabled("cuda") is False  # the probe put the switch back
