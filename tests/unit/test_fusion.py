"""The fusion pass: golden rewrite, fallback bit-identity, what fuses on GPT-2, visible
declines, and whole-model parity with the Triton kernels (interpreter) against eager."""

from __future__ import annotations

import copy
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.codegen.kernels import FUSED_OP, backend, launch_region, region
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.printing import graph_text
from autopar.compiler.ir.program import runnable
from autopar.compiler.passes.defaults import run_passes
from autopar.compiler.passes.fuse_regions import FUSED_OPS, FuseRegions
from autopar.examples import causal_lm_loss, gpt2, llama
from autopar.testing import compare, reference_train

aten = torch.ops.aten


class Block(torch.nn.Module):
    """Linear -> tanh-GELU -> residual add + layer norm: two fusable chains around a matmul."""

    def __init__(self, width=8):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(F.gelu(self.fc(x), approximate="tanh") + x)


def _mse(out, x):
    return (out * out).mean()


def _fused(tg):
    return [n for n in tg.call_nodes() if n.target == FUSED_OP]


def _fuse(model, batch, loss_fn, **layout):
    tg = autopar.trace(model, batch, loss_fn)
    out, results = run_passes(tg, autopar.Layout(fusion=True, **layout))
    return tg, out, results[-1]


def _ops(node):
    return [str(n.target).removeprefix("aten.").removesuffix(".default").replace(
        "<built-in function getitem>", "getitem")
        for n in region(node.args[0]).gm.graph.nodes if n.op == "call_function"]


def test_golden_block():
    """Forward: GELU + residual add + layer norm + the loss's square, one kernel after the
    matmul; backward: the loss gradient, layer-norm and GELU backwards and the bias
    gradient, one kernel."""
    tg, out, result = _fuse(Block(), (torch.randn(4, 8),), _mse)
    ops = [n.target for n in out.call_nodes() if n.target is not operator.getitem]
    assert ops[:3] == [aten.t.default, aten.addmm.default, FUSED_OP], ops
    forward, backward = _fused(out)
    assert _ops(forward) == ["gelu", "add.Tensor", "native_layer_norm", "getitem", "getitem",
                             "getitem", "mul.Tensor"]
    # ... from the mean's backward (the loss gradient expanded over the rows, divided)
    # to the bias gradient of fc (a column sum over the rows, then a reshape)
    assert _ops(backward) == ["expand", "div.Scalar", "mul.Tensor", "mul.Tensor", "add.Tensor",
                              "native_layer_norm_backward", "getitem", "getitem", "getitem",
                              "gelu_backward", "sum.dim_IntList", "view"]
    assert result.stats["kernels"] == 2 and result.stats["ops_fused"] == 13
    assert result.declined == []


def test_fallback_is_bit_identical_and_graph_verifies():
    x = torch.randn(4, 8)
    tg, out, _ = _fuse(Block(), (x,), _mse)
    params = [p.detach() for p in Block().parameters()]
    with backend("eager"):
        got = out.gm(*params, x)
    want = tg.gm(*params, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert "fused" in out.provides and out.history[-1] == "fusion"


def test_fusion_is_on_by_default_and_last():
    assert autopar.Layout().fusion
    assert [p.name for p in autopar.default_passes(autopar.Layout(dp=2, tp=2))][-1] == "fusion"


def test_fusion_off_changes_nothing():
    tg = autopar.trace(Block(), (torch.randn(4, 8),), _mse)
    ctx = autopar.compiler.passes.base.PassContext(layout=autopar.Layout(fusion=False))
    out, result = FuseRegions().run(tg, ctx)
    assert out is tg and not result.changed and result.declined == [("fusion", "Layout.fusion=False")]


def test_gpt2_norms_and_gelu_are_one_kernel_forward_and_backward():
    ex = gpt2(layers=2, batch=2, seq=8)
    tg, out, _ = _fuse(ex.model, ex.batch, ex.loss_fn)
    before = {n.name: n for n in tg.call_nodes()}
    kernels_of: dict[tuple[str, bool], set[str]] = {}
    for node in _fused(out):
        for name in node.meta[FUSED_OPS]:
            old = before[name]
            key = (old.meta[M.MODULE_PATH], old.meta[M.ROLE] == M.Role.BACKWARD)
            kernels_of.setdefault(key, set()).add(node.name)
    chains = [p for p in {n.meta[M.MODULE_PATH] for n in tg.call_nodes()}
              if p and (p.endswith(("ln_1", "ln_2", "ln_f")) or p.endswith("mlp.act"))]
    assert len(chains) == 2 * 3 + 1
    for path in chains:
        for backward in (False, True):
            assert len(kernels_of.get((path, backward), ())) == 1, (path, backward, kernels_of)
    left = [n for n in out.call_nodes() if n.meta[M.MODULE_PATH] in chains
            and n.target in (aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
                             aten.tanh.default, aten.tanh_backward.default, aten.pow.Tensor_Scalar)]
    assert left == []


def test_llama_rotary_embedding_is_one_kernel_forward_and_backward():
    """The rotary embedding (slices, neg, cat, the multiplies by cos and sin) and its
    backward (the slices' gradients placed in zeros by slice_backward, added) fuse: no
    float neg or cat is left, and the one slice_backward left is the loss's shift, after
    the log-softmax backward (a row value, which a remap cannot read elsewhere)."""
    ex = llama(layers=2, batch=2, seq=8)
    tg, out, result = _fuse(ex.model, ex.batch, ex.loss_fn)
    rotary = {aten.neg.default, aten.cat.default, aten.slice_backward.default}
    assert sum(n.target in rotary for n in tg.call_nodes()) >= 2 * (2 * 2 + 2 * 2)
    left = [n for n in out.call_nodes() if n.target in rotary and n.meta[M.VAL].is_floating_point()]
    assert [n.target for n in left] == [aten.slice_backward.default]
    assert left[0].args[0].args[0].target == aten._log_softmax_backward_data.default  # a view of
    fused_ops = [op for node in _fused(out) for op in _ops(node)]
    assert fused_ops.count("cat") >= 4 and fused_ops.count("slice_backward") >= 8
    # grouped-query attention takes its grouped k and v (ir/grouped_kv.py): its kernel's
    # backward gives each key-value head's gradient, none is summed over query heads
    assert tg.attrs["grouped_kv"] == 2
    both = [n for n in _fused(out) if {"sum.dim_IntList", "slice_backward"} <= set(_ops(n))]
    assert both == [], [_ops(n) for n in both]
    assert not any("other indices" in why for _, why in result.declined), result.declined


def test_unsupported_ops_are_declined_visibly():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 6)

        def forward(self, x):  # pow 5 has no lowering; a mean over rows is not emitted
            y = self.fc(x)
            return torch.pow(y, 5).sum(0) * 2.0 + y.exp().mean(0)

    _, out, result = _fuse(Odd(), (torch.randn(3, 6),), lambda o, x: o.sum())
    reasons = " ".join(why for _, why in result.declined)
    assert "exponent 5" in reasons and "reduces dims [0]" in reasons, result.declined
    assert all(n.target != aten.pow.Tensor_Scalar or n.args[1] == 5 for n in out.call_nodes())


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("factory", [gpt2, llama], ids=["gpt2", "llama"])
def test_parity_with_triton_kernels(factory):
    """transformers models unmodified, kernels run by Triton's interpreter, 2 steps of SGD
    against eager PyTorch: loss and every weight."""
    ex = factory(layers=1, batch=2, seq=8)
    init = {k: v.clone() for k, v in ex.model.state_dict().items()}
    batches = ex.batches(2)
    step = autopar.compile(copy.deepcopy(ex.model), None, ex.batch, ex.loss_fn, optimizer=_sgd,
                           layout=autopar.Layout(fusion=True))
    assert step.pass_results[-1].stats["kernels"] >= 5
    with backend("triton"):
        losses = [float(step(*b)) for b in batches]
    keys = [n.args[0] for n in step.program.gm.graph.nodes if n.target == FUSED_OP]
    assert keys and all(region(k)._kernels for k in keys)  # the Triton kernels did run
    ref_losses, ref_state = reference_train(ex.model, batches, ex.loss_fn, _sgd)
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)
    assert losses != [float(step(*b)) for b in batches[:1]] * 2  # the weights did move


# NOTE: the interpreter takes 5-25 s per model; these five were picked for their variety
# (the 14 other architectures of tests/unit/test_trace.py pass too, checked by hand)
@pytest.mark.parametrize("model_type", ["gpt_neox", "bloom", "bert", "opt", "phi"])
def test_parity_with_triton_kernels_on_architectures_no_code_names(model_type):
    """Tiny configs of other transformers architectures (partial rotary with parallel
    attention, ALiBi, bidirectional attention, learned positions, partial rotary with a
    parallel block): 2 SGD steps with every kernel run by Triton's interpreter against
    eager PyTorch."""
    from autopar.examples import hf_tiny

    ex = hf_tiny(model_type, batch=2, seq=8)
    init = {k: v.clone() for k, v in ex.model.state_dict().items()}
    batches = ex.batches(2)
    step = autopar.compile(copy.deepcopy(ex.model), None, ex.batch, ex.loss_fn, optimizer=_sgd,
                           layout=autopar.Layout(fusion=True))
    with backend("triton"):
        losses = [float(step(*b)) for b in batches]
    keys = [n.args[0] for n in step.program.gm.graph.nodes if n.target == FUSED_OP]
    assert len(keys) >= 10 and all(region(k)._kernels for k in keys)
    ref_losses, ref_state = reference_train(ex.model, batches, ex.loss_fn, _sgd)
    report = compare(losses, ref_losses, step.full_state_dict(), ref_state, init, adam=False)
    assert report.ok, str(report)


def test_getitem_of_an_unfused_op_is_not_fused():
    ex = gpt2(layers=1, batch=2, seq=8)
    _, out, _ = _fuse(ex.model, ex.batch, ex.loss_fn)
    for node in _fused(out):
        for inp in node.args[1]:
            if inp.target is operator.getitem:
                assert inp.args[0].target != FUSED_OP or inp.args[0] is not node


def _train(ex, layout, mode="eager"):
    step = autopar.compile(copy.deepcopy(ex.model), None, ex.batch, ex.loss_fn, optimizer=_sgd,
                           layout=layout)
    with backend(mode):
        losses = [float(step(*b)) for b in ex.batches(2)]
    return losses, step.full_state_dict(), step


@pytest.mark.parametrize("mode", ["eager", "auto"], ids=["per-region", "inline"])
@pytest.mark.parametrize("layout", [dict(), dict(amp="bf16"), dict(microbatches=2)],
                         ids=["fp32", "amp-bf16", "accumulation"])
def test_fused_step_on_cpu_is_bit_identical_to_unfused(layout, mode):
    """Without a GPU the fused graph runs the regions' own aten ops: nothing changes,
    whether each region runs its fallback ("eager") or the runtime runs the regions'
    ops inline ("auto" on a CPU)."""
    ex = llama(layers=1, batch=4, seq=8)
    plain_losses, plain_state, plain = _train(ex, autopar.Layout(fusion=False, **layout))
    losses, state, step = _train(ex, autopar.Layout(fusion=True, **layout), mode)
    assert [r for r in step.pass_results if r.name == "fusion"][0].stats["kernels"] > 0
    assert "fusion" not in [r.name for r in plain.pass_results]  # the reference is unfused
    assert losses == plain_losses
    assert all(torch.equal(state[k], plain_state[k]) for k in plain_state)


@pytest.mark.parametrize("factory, layout", [
    (gpt2, autopar.Layout()), (llama, autopar.Layout()),
    (llama, autopar.Layout(amp="bf16")), (gpt2, autopar.Layout(recompute="full"))],
    ids=["gpt2", "llama", "llama-amp", "gpt2-recompute"])
def test_each_region_output_is_its_own_storage(factory, layout):
    """No two outputs of a region are (views of) one value and none views an input: a
    view that only the rest of the graph reads is left outside, viewing the one output
    (a kernel would write the elements twice; inline, the memory model would count one
    storage twice)."""
    from autopar.compiler.codegen.ops import moves_no_data

    ex = factory(layers=2, batch=2, seq=16)
    tg, _ = run_passes(autopar.trace(ex.model, ex.batch, ex.loss_fn), layout)
    fused = [n for n in tg.graph.nodes if n.target is FUSED_OP]
    assert fused
    for node in fused:
        body = region(node.args[0]).gm.graph
        outs = body.output_node().args[0]
        roots = []
        for out in outs if isinstance(outs, (list, tuple)) else [outs]:
            while out.op == "call_function" and moves_no_data(out) and not (
                    out.target is operator.getitem and not moves_no_data(out.args[0])):
                out = out.all_input_nodes[0]  # to the op that made it (a getitem's own)
            assert out.op != "placeholder", f"{node.name} returns a view of its input {out}"
            roots.append(out)
        assert len(roots) == len(set(roots)), f"{node.name}: outputs share storage {roots}"


def test_regions_run_inline_on_cpu_under_auto_and_compute_the_same():
    """On CPU tensors under the backend "auto" the runtime runs the fused graph with each
    region's ops inline (no region call keeps its inputs alive to its end); "eager" keeps
    the region calls, and "triton" calls the kernels without the custom op. The inline
    graph's values are the fallback's, bit for bit."""
    ex = gpt2(layers=2, batch=4, seq=16)
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    out, _ = FuseRegions().run(tg, autopar.compiler.passes.base.PassContext())
    params = [dict(ex.model.named_parameters())[p.name].detach() for p in tg.signature.params]
    inputs = [*params, *ex.batch]
    inline = runnable(out.gm, inputs)
    assert inline is not out.gm and runnable(out.gm, inputs) is inline  # made once
    assert FUSED_OP in {n.target for n in out.gm.graph.nodes}
    assert FUSED_OP not in {n.target for n in inline.graph.nodes}
    with backend("eager"):
        assert runnable(out.gm, inputs) is out.gm
        want = out.gm(*inputs)
    with backend("triton"):
        direct = runnable(out.gm, inputs)
    assert direct is not out.gm and direct is not inline
    got = inline(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_regions_call_their_kernels_directly_where_kernels_run():
    """Where the Triton kernels run (here "triton" under the interpreter; CUDA tensors
    under "auto") the runtime's module calls each region's kernel without the custom op
    (`launch_region`), made once per graph, and computes what the op's path computes, bit
    for bit."""
    ex = gpt2(layers=1, batch=2, seq=8)
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    out, _ = FuseRegions().run(tg, autopar.compiler.passes.base.PassContext())
    params = [dict(ex.model.named_parameters())[p.name].detach() for p in tg.signature.params]
    inputs = [*params, *ex.batch]
    with backend("triton"):
        direct = runnable(out.gm, inputs)
        assert runnable(out.gm, inputs) is direct
        targets = [n.target for n in direct.graph.nodes]
        assert FUSED_OP not in targets
        assert targets.count(launch_region) == [n.target for n in out.gm.graph.nodes].count(
            FUSED_OP) > 0
        got, want = direct(*inputs), out.gm(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_dropout_draws_its_mask_in_the_kernel_that_applies_it():
    """GPT-2 with dropout: each dropout's draw (empty_like + bernoulli_), scale (div_) and
    multiply run in one kernel, with the residual add and layer norm after it where there
    is one; nothing of a dropout is left as an aten op. (With dropout, CPU attention traces
    as its math decomposition: the attention probabilities' dropout is in the graph too,
    fused with their `_safe_softmax`.)"""
    ex = gpt2(layers=2, batch=2, seq=8, dropout=0.1)
    tg, out, _ = _fuse(ex.model, ex.batch, ex.loss_fn)
    draws = [n for n in tg.call_nodes() if n.target == aten.bernoulli_.float]
    assert len(draws) == 1 + 3 * 2  # the embeddings', and per block the attention's and two
    assert not [n for n in out.call_nodes() if n.target in (
        aten.bernoulli_.float, aten.empty_like.default, aten.div_.Scalar)]
    kernels = [_ops(n) for n in _fused(out) if "bernoulli_.float" in _ops(n)]
    assert len(kernels) == len(draws) and all(
        {"empty_like", "div_.Scalar", "mul.Tensor"} <= set(ops) for ops in kernels), kernels
    # the embeddings' and the residual dropouts with the add and layer norm after them, the
    # attention's with the softmax before it
    assert sum("native_layer_norm" in ops for ops in kernels) == 1 + 2 * 2, kernels
    assert sum("_safe_softmax" in ops for ops in kernels) == 2, kernels


def _train_seeded(ex, layout, mode):
    step = autopar.compile(copy.deepcopy(ex.model), None, ex.batch, ex.loss_fn, optimizer=_sgd,
                           layout=layout)
    torch.manual_seed(1)
    with backend(mode):
        losses = [float(step(*b)) for b in ex.batches(2)]
    return losses, step.full_state_dict()


def test_dropout_on_cpu_is_bit_identical_and_triton_draws_are_seeded():
    """On CPU the fused regions draw with eager's bernoulli_ in graph order: the same masks,
    losses and weights as the unfused step. The kernels draw their own (Philox) masks:
    reproducible under torch.manual_seed, and training with them moves the loss."""
    ex = gpt2(layers=1, batch=2, seq=8, dropout=0.1)
    plain = _train_seeded(ex, autopar.Layout(fusion=False), "eager")
    fused = _train_seeded(ex, autopar.Layout(fusion=True), "auto")
    assert fused[0] == plain[0]
    assert all(torch.equal(fused[1][k], plain[1][k]) for k in plain[1])
    first, again = (_train_seeded(ex, autopar.Layout(fusion=True), "triton") for _ in range(2))
    assert first[0] == again[0] and first[0] != plain[0]
    assert all(torch.isfinite(torch.tensor(first[0])))


def test_amp_bf16_with_triton_kernels_within_bf16_eps():
    """bf16 AMP graphs: kernels load and store bf16, compute in fp32 (eager rounds every
    op to bf16), so losses agree to bf16's epsilon, not bit for bit."""
    ex = gpt2(layers=1, batch=2, seq=8)
    plain, _, _ = _train(ex, autopar.Layout(amp="bf16", fusion=False))
    fused, _, _ = _train(ex, autopar.Layout(amp="bf16", fusion=True), mode="triton")
    eps = torch.finfo(torch.bfloat16).eps
    assert all(abs(a - b) <= eps * abs(b) for a, b in zip(fused, plain)), (fused, plain)


_STEPS = {
    "tanh": torch.tanh, "gelu": F.gelu, "scale": lambda h: h * 1.5, "relu": torch.relu,
    "softmax": lambda h: torch.softmax(h, -1), "norm": lambda h: F.layer_norm(h, h.shape[-1:]),
    "rms": lambda h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6),
    "reshape": lambda h: h.reshape(-1, h.shape[-1]) if h.dim() == 3 else h.reshape(2, -1, h.shape[-1]),
}


class _Chain(torch.nn.Module):
    def __init__(self, steps):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.steps = steps

    def forward(self, x):
        h = self.fc(x)
        for step in self.steps:
            h = _STEPS[step](h) + h if step != "reshape" else _STEPS[step](h)
        return h


@settings(max_examples=6, deadline=None, derandomize=True)
@given(steps=st.lists(st.sampled_from(sorted(_STEPS)), min_size=1, max_size=5))
def test_property_every_op_in_at_most_one_kernel_and_values_kept(steps):
    model, x = _Chain(steps), torch.randn(2, 3, 6)
    tg, out, _ = _fuse(model, (x,), lambda o, x: (o * o).sum())
    names = [name for n in _fused(out) for name in n.meta[FUSED_OPS]]
    assert len(names) == len(set(names))
    params = [p.detach() for p in model.parameters()]
    want = tg.gm(*params, x)
    with backend("eager"):
        assert all(torch.equal(a, b) for a, b in zip(out.gm(*params, x), want))
    with backend("triton"):
        got = out.gm(*params, x)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, want))


# a random graph's nodes: (op, role, stage); the roles without a program (COMM,
# OPTIMIZER) make values outside the programs that programs may read back
_OPS = [aten.add.Tensor, aten.mul.Tensor, aten.neg.default, aten.exp.default, aten.mm.default,
        aten.clone.default]
_PLACES = [(M.Role.FORWARD, 0), (M.Role.FORWARD, 1), (M.Role.BACKWARD, 1),
           (M.Role.BACKWARD, 0), (M.Role.COMM, None), (M.Role.OPTIMIZER, None)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, len(_OPS) - 1), st.integers(0, len(_PLACES) - 1),
                          st.integers(0, 99), st.integers(0, 99)), min_size=2, max_size=40))
# a forward's neg read by its exp and by two comm-side clones in a row, the exp and the
# second clone read by one add: neg, exp and add fused would wait on the clones, which
# wait on them
@example([(2, 0, 0, 0), (5, 4, 2, 0), (5, 4, 3, 0), (3, 0, 2, 0), (0, 0, 5, 4)])
def test_program_partitions_are_those_of_the_whole_graph(spec):
    """The pass partitions each program on the nodes that can matter to it (its own, the
    values it reads, and the outside nodes on a path from it back into it); torch's
    partitioner on the whole graph, once per program, must propose the same regions,
    also where paths leave a program and come back (random graphs over two stages'
    forward and backward and outside values between them)."""
    from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

    from autopar.compiler.passes import fuse_regions

    graph = torch.fx.Graph()
    values = [graph.placeholder("x"), graph.placeholder("y")]
    for node, t in zip(values, (torch.randn(4, 4), torch.randn(4, 4))):
        node.meta = {M.VAL: t}
    for op, place, a, b in spec:
        args = (values[a % len(values)], values[b % len(values)])[:1 if op in (2, 3, 5) else 2]
        node = graph.call_function(_OPS[op], args)
        role, stage = _PLACES[place]
        node.meta = {M.VAL: _OPS[op](*(x.meta[M.VAL] for x in args)), M.ROLE: role,
                     M.STAGE: stage}
        values.append(node)
    graph.output([n for n in values if not n.users])
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    order = {n: i for i, n in enumerate(graph.nodes)}

    want, want_rejected = [], {}
    for program in dict.fromkeys(p for n in graph.nodes if n.op == "call_function"
                                 and (p := fuse_regions.program_of(n)) is not None):
        support = fuse_regions._Fusable(program)
        whole = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True,
                                           skip_horizontal_fusion=True)
        want += [sorted(p.nodes, key=order.__getitem__) for p in whole.propose_partitions()]
        want_rejected.update(support.rejected)
    rejected = {}
    got = fuse_regions._candidates(SimpleNamespace(graph=graph), rejected)  # reads .graph
    assert got == sorted(want, key=lambda nodes: order[nodes[0]])
    assert rejected == want_rejected


def test_cli_kernels_writes_every_kernel(tmp_path):
    import json

    from autopar.cli import main

    assert main(["kernels", "gpt2-tiny", "--out", str(tmp_path)]) == 0
    index = json.loads((tmp_path / "kernels.json").read_text())
    assert len(index) >= 10 and {row["kind"] for row in index} == {"pointwise", "row"}
    for row in index:
        text = (tmp_path / f"{row['kernel']}.py").read_text()
        assert "@triton.jit" in text and f"def {row['kernel']}(" in text


_MEMO_PAIRS = {  # (layout, a sibling whose comm passes differ) per model
    "gpt2": [(autopar.Layout(dp=8, zero=1), autopar.Layout(dp=8, bucket_mb=5)),
             (autopar.Layout(dp=4, tp=2, zero=2), autopar.Layout(dp=4, tp=2)),
             # ZeRO-3 reads each weight from its gather, which ZeRO-2 does not; under
             # recomputation both recompute the weights' transposes in the backward
             (autopar.Layout(dp=8, zero=3, recompute="selective"),
              autopar.Layout(dp=8, zero=2, recompute="selective")),
             (autopar.Layout(dp=4, pp=2, microbatches=2, zero=1),
              autopar.Layout(dp=4, pp=2, microbatches=2))],
    # Llama's rotary tables are peeled off a first region and fused in later rounds
    "llama": [(autopar.Layout(dp=8, zero=1), autopar.Layout(dp=8, bucket_mb=5))],
}


@pytest.mark.parametrize("model", sorted(_MEMO_PAIRS))
def test_memo_replays_what_a_fresh_run_fuses(model):
    """The planner runs the pass on the same forward and backward under many layouts; a
    layout whose ops were fused before replays those regions. The result must be what a
    fresh run gives: the same graph, stats and declines, for layouts whose comm passes
    differ from the one that filled the memo (buckets, ZeRO-1/2/3, tp, a pipeline's
    stages)."""
    from autopar.compiler.passes import fuse_regions

    ex = {"gpt2": gpt2, "llama": llama}[model]()
    tg = autopar.trace(ex.model, ex.batch, ex.loss_fn)
    cluster = autopar.ClusterSpec.preset("dgx-h100", nodes=1)
    for layout, sibling in _MEMO_PAIRS[model]:
        fuse_regions.clear_memo()
        fresh, fresh_results = run_passes(tg, layout, cluster)
        fuse_regions.clear_memo()
        run_passes(tg, sibling, cluster)
        assert len(fuse_regions._RECIPES) == 1
        recipe = next(iter(fuse_regions._RECIPES.values()))
        again, results = run_passes(tg, layout, cluster)
        assert len(fuse_regions._RECIPES) == 1, f"{layout}: not replayed"
        assert graph_text(again) == graph_text(fresh), layout
        first, second = fresh_results[-1], results[-1]
        assert first.name == second.name == "fusion"
        assert (first.stats, first.declined) == (second.stats, second.declined)
        assert first.stats["kernels"] > 10
        if model == "llama":
            assert len(recipe.rounds) > 1
    fuse_regions.clear_memo()


def test_memo_is_not_used_when_a_path_leaves_the_programs_and_returns():
    """If a value outside the forward and backward programs is computed from them and
    read back by them, the partition could depend on it: no fingerprint, a fresh run."""
    from autopar.compiler.passes import fuse_regions

    ex = gpt2()
    tg = run_passes(autopar.trace(ex.model, ex.batch, ex.loss_fn), autopar.Layout(fusion=False),
                    autopar.ClusterSpec.local())[0].copy()
    assert fuse_regions._fingerprint(tg) is not None
    backward = [n for n in tg.call_nodes() if n.meta.get(M.ROLE) == M.Role.BACKWARD]
    source, reader = backward[0], backward[-1]
    with tg.graph.inserting_after(source):  # an optimizer-side value made from the backward
        outside = tg.graph.call_function(aten.clone.default, (source,))
    outside.meta = {**source.meta, M.ROLE: M.Role.OPTIMIZER}
    with tg.graph.inserting_before(reader):  # and a backward op reading it
        back = tg.graph.call_function(aten.add.Tensor, (outside, outside))
    back.meta = {**reader.meta}
    assert fuse_regions._fingerprint(tg) is None


def test_fusion_keeps_the_schedule_of_zero3_gathers():
    """Each fusion round ends in a stable topological sort. It used to key the fused
    nodes by their place when the round began and the others by their place after the
    erasures. Each fused node then fell hundreds of places late; the ops waiting for it
    stalled, and the sort pulled every ready node ahead meanwhile. A ZeRO-3 step issued
    its backward gathers blocks early and held those weights. Fused, no more gathers are
    in flight at once than unfused, and the step's predicted peak is no higher."""
    from autopar.compiler.analysis.memory import step_memory
    from autopar.compiler.analysis.summary import summarize
    from tests.unit.test_cost_model import meta_gpt2
    model, batch = meta_gpt2(layers=4, hidden=256, heads=8, vocab=1000, batch=16, seq=64)
    tg = autopar.trace(model, batch, causal_lm_loss)
    peaks, in_flight = {}, {}
    for fusion in (False, True):
        layout = autopar.Layout(dp=8, zero=3, fusion=fusion)
        out, _ = run_passes(tg, layout)
        issued, most = set(), 0
        for n in out.call_nodes():
            if n.target == torch.ops._c10d_functional.all_gather_into_tensor.default:
                issued.add(n)
            elif n.target == torch.ops._c10d_functional.wait_tensor.default:
                issued.discard(n.args[0])
            most = max(most, len(issued))
        in_flight[fusion] = most
        peaks[fusion] = step_memory(summarize(out), layout).peak_bytes
    assert in_flight[True] == in_flight[False]
    assert peaks[True] <= peaks[False]
