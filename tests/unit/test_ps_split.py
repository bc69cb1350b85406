"""The parameter-server split (compiler/lowering/lower_ps.py) over the joint graph.

The trainer's graph reads rows through `autopar::ps_pull`; here a reader over the
model's own tables stands in for the servers (no process group is involved: the pull
op takes any callable), and the gradients the graph returns per pull, scattered back
onto the table, must equal autograd's dense gradient of the unmodified model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.compiler.ir import ps_ops
from autopar.compiler.ir.ps_ops import NoReaderError
from autopar.compiler.lowering.lower_ps import PSSplitError, split_for_ps
from autopar.layout import Layout, LayoutError, PSLayout
from autopar.runtime.ps import PSError, table_optimizer

ROWS, DIM = 40, 4


def _check_split(model: nn.Module, batch: tuple, loss_fn=None, tables=None):
    """Run the split graph with the model's tables as the servers and compare loss,
    dense gradients and every table's scattered row gradients with autograd's."""
    tg = autopar.trace(model, batch, loss_fn)
    prog = split_for_ps(tg, tables)
    params = dict(model.named_parameters())
    tabs = [params[t.name].detach() for t in prog.tables]
    assert not any(ph.target in {t.name for t in prog.tables}
                   for ph in prog.gm.graph.nodes if ph.op == "placeholder")
    ps_ops.bind_reader(lambda t, ids: tabs[t][ids])
    try:
        out = prog.gm(*[params[e.name].detach() for e in prog.dense],
                      *[b for _, b in model.named_buffers()], *batch)
    finally:
        ps_ops.bind_reader(None)
    model.zero_grad()
    out_ref = model(*batch)
    loss = loss_fn(out_ref, *batch) if loss_fn else out_ref
    loss.backward()
    torch.testing.assert_close(out[0], loss.detach())
    nd = len(prog.dense)
    for i, e in enumerate(prog.dense):
        torch.testing.assert_close(out[1 + i], params[e.name].grad, msg=e.name)
    scattered = [torch.zeros_like(t) for t in tabs]
    for k, pull in enumerate(prog.pulls):
        grad, ids = out[1 + nd + 2 * k], out[2 + nd + 2 * k]
        n = int((ids >= 0).sum())
        assert grad.shape == (pull.capacity + 1, DIM) and ids.shape == (pull.capacity,)
        assert torch.all(ids[n:] == -1) and torch.all(grad[n:pull.capacity] == 0)
        scattered[pull.table].index_add_(0, ids[:n], grad[:n])
    for t, spec in enumerate(prog.tables):
        torch.testing.assert_close(scattered[t], params[spec.name].grad, msg=spec.name)
    # the prefetch graph gives each pull's ids before the step runs
    flat = prog.prefetch(*[params[e.name].detach() for e in prog.dense],
                         *[b for _, b in model.named_buffers()], *batch)
    assert len(flat) == len(prog.pulls)
    for k, (pull, ids) in enumerate(zip(prog.pulls, flat)):
        pad = prog.tables[pull.table].padding_idx
        got = out[2 + nd + 2 * k]
        assert torch.equal(ids[ids != pad].unique(), got[got >= 0]) and ids.numel() == pull.capacity
    return prog


class Lookups(nn.Module):
    """One table looked up in a way a test picks, then a small MLP."""

    def __init__(self, kind: str, mode: str = "sum", padding_idx: int | None = None,
                 per_sample: bool = False):
        super().__init__()
        self.kind, self.per_sample = kind, per_sample
        if kind == "bag":
            self.table = nn.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=padding_idx)
        else:
            self.table = nn.Embedding(ROWS, DIM, padding_idx=padding_idx)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, w):
        if self.kind == "bag":
            x = self.table(ids, per_sample_weights=w if self.per_sample else None)
        elif self.kind == "functional":  # F.embedding on a reshaped, offset id tensor
            x = F.embedding((ids.reshape(-1) + 3) % ROWS, self.table.weight).view(
                ids.shape[0], -1, DIM).sum(1)
        else:
            x = self.table(ids).mean(1)
        return self.head(torch.tanh(x)).pow(2).mean()


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(["embedding", "bag", "functional"]),
       mode=st.sampled_from(["sum", "mean", "max"]),
       padding=st.sampled_from([None, 0, 7]),
       per_sample=st.booleans(), batch=st.integers(1, 5), hot=st.integers(1, 4),
       seed=st.integers(0, 1000))
def test_split_gradients_equal_autograd_for_each_lookup_form(kind, mode, padding, per_sample,
                                                             batch, hot, seed):
    if kind != "bag":
        mode, per_sample = "sum", False
    if per_sample and mode != "sum":
        per_sample = False  # EmbeddingBag takes per-sample weights only with mode="sum"
    if kind == "functional":
        padding = None
    torch.manual_seed(seed)
    model = Lookups(kind, mode, padding, per_sample)
    ids = torch.randint(0, 10, (batch, hot))  # few distinct ids: repeats and the padding id
    w = torch.rand(batch, hot)
    prog = _check_split(model, (ids, w))
    assert [t.name for t in prog.tables] == ["table.weight"]
    assert prog.tables[0].padding_idx == (-1 if padding is None else padding)


class LearnedWeights(nn.Module):
    """Per-sample weights that depend on a parameter: their gradient reads the table
    (aten._embedding_bag_per_sample_weights_backward), which must read pulled rows."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=padding_idx)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, w):
        return self.head(self.table(ids, per_sample_weights=torch.sigmoid(self.scale * w))
                         ).pow(2).mean()


@pytest.mark.parametrize("padding", [None, 3])
def test_learned_per_sample_weights_read_the_pulled_rows(padding):
    torch.manual_seed(0)
    model = LearnedWeights(padding)
    ids = torch.tensor([[1, 3, 3], [5, 1, 9]])
    tg = autopar.trace(model, (ids, torch.randn(2, 3)))
    assert any(n.target is torch.ops.aten._embedding_bag_per_sample_weights_backward.default
               for n in tg.graph.nodes)
    prog = _check_split(model, (ids, torch.randn(2, 3)))
    assert [e.name for e in prog.dense] == ["scale", "head.weight", "head.bias"]


class TwoFields(nn.Module):
    """One table shared by two fields (two index tensors, so two pulls) and a second
    table looked up twice with the same ids (one pull)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(ROWS, DIM)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="mean")
        self.head = nn.Linear(4 * DIM + 2, 1)

    def forward(self, user, item, dense, labels):
        x = torch.cat([self.shared(user), self.shared(item).sum(1), self.bag(item),
                       self.bag(item) * 2,
                       dense], 1)
        return self.head(x).squeeze(1)


def test_a_table_shared_by_two_fields_gets_a_pull_per_field():
    torch.manual_seed(0)
    model = TwoFields()
    user, item = torch.randint(0, ROWS, (6,)), torch.randint(0, ROWS, (6, 3))
    batch = (user, item, torch.randn(6, 2), torch.rand(6))
    loss = lambda out, user, item, dense, labels: F.binary_cross_entropy_with_logits(out, labels)  # noqa: E731
    prog = _check_split(model, batch, loss)
    # the two bag calls flatten `item` anew each: views of one tensor, so one pull
    assert [(p.table, p.capacity) for p in prog.pulls] == [(0, 6), (0, 18), (1, 18)]
    assert [e.name for e in prog.dense] == ["head.weight", "head.bias"]


def test_named_tables_leave_the_others_dense():
    torch.manual_seed(0)
    model = TwoFields()
    batch = (torch.randint(0, ROWS, (4,)), torch.randint(0, ROWS, (4, 2)), torch.randn(4, 2),
             torch.rand(4))
    loss = lambda out, user, item, dense, labels: F.binary_cross_entropy_with_logits(out, labels)  # noqa: E731
    prog = _check_split(model, batch, loss, tables=["bag.weight"])
    assert [t.name for t in prog.tables] == ["bag.weight"]
    assert "shared.weight" in [e.name for e in prog.dense]


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)

    def forward(self, ids):
        return (self.emb(ids) @ self.emb.weight.t()).logsumexp(-1).mean()


def test_a_table_read_whole_is_refused_with_the_op_and_module():
    tg = autopar.trace(Tied(), (torch.randint(0, ROWS, (2, 3)),))
    # read by a matmul too, so it is no candidate; naming it is the error
    with pytest.raises(PSSplitError, match="no parameter that is read only by embedding"):
        split_for_ps(tg)
    with pytest.raises(PSSplitError, match=r"emb.weight.*read by aten\.(t|permute|transpose)"):
        split_for_ps(tg, ["emb.weight"])


def test_a_model_without_an_embedding_is_told_what_ps_mode_is_for():
    tg = autopar.trace(nn.Sequential(nn.Linear(3, 1)), (torch.randn(2, 3),),
                       lambda out, x: out.sum())
    with pytest.raises(PSSplitError, match="no parameter that is read only by embedding "
                                           "lookups.*mostly untouched"):
        split_for_ps(tg)
    with pytest.raises(PSSplitError, match="not a parameter of the model"):
        split_for_ps(autopar.trace(Lookups("embedding"), (torch.zeros(1, 1, dtype=torch.long),
                                                          torch.ones(1, 1))), ["nope"])


def test_the_pull_without_servers_says_so():
    prog = split_for_ps(autopar.trace(Lookups("embedding"),
                                      (torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))))
    with pytest.raises(NoReaderError, match="no server client is bound"):
        prog.gm(*[torch.zeros(e.shape) for e in prog.dense],
                torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))


@pytest.mark.parametrize("bad, match", [
    (dict(mode="semi"), r"Layout.ps.mode must be one of \['sync', 'async', 'half-async', 'geo'\]"),
    (dict(mode="half-async", fraction=1.5), "fraction must be a number in"),
    (dict(mode="geo"), "geo_k must be an integer"),
    (dict(servers=0), "servers must be a positive integer"),
    (dict(mode="async", dense="allreduce"), "use dense='servers'"),
])
def test_bad_ps_layouts_name_the_field(bad, match):
    with pytest.raises(LayoutError, match=match):
        PSLayout(**bad)


def test_ps_layout_world_size_counts_the_servers():
    layout = Layout(dp=3, ps=PSLayout(servers=2, mode="async"))
    assert layout.world_size == 5 and layout.ps.dense_policy == "servers"
    assert Layout.from_dict(layout.to_dict()) == layout
    with pytest.raises(LayoutError, match="2 server.*3 trainer.*5 processes.*dp=2"):
        layout.check_world_size(4)
    with pytest.raises(LayoutError, match="does not combine with.*'tp': 2"):
        Layout(dp=2, tp=2, ps=PSLayout())


@pytest.mark.parametrize("factory, match", [
    (lambda p: torch.optim.RMSprop(p), "implement SGD, Adagrad and Adam.*built RMSprop"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), "weight_decay=0.01.*pass weight_decay=0"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "momentum=0.9"),
])
def test_an_optimizer_the_servers_lack_is_refused(factory, match):
    with pytest.raises(PSError, match=match):
        table_optimizer(factory)


def test_more_servers_than_rows_is_refused_before_any_process_connects(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(ROWS + 1 + 1))
    monkeypatch.setenv("RANK", "0")
    model = Lookups("embedding")
    with pytest.raises(LayoutError, match=f"servers={ROWS + 1} is more than the {ROWS} rows "
                                          f"of table 'table.weight'"):
        autopar.compile(model, None, (torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)),
                        lambda out, ids, w: out, lambda p: torch.optim.SGD(p, lr=0.1),
                        Layout(dp=1, ps=PSLayout(servers=ROWS + 1)))


def test_the_cost_model_prices_pull_and_push_against_all_reducing_the_table():
    from autopar.api import _unique_per_pull
    from autopar.cluster import ClusterSpec
    from autopar.compiler.planner.ps_cost import compare_ps
    from autopar.costs import DEFAULT_EFFICIENCY, ring_all_reduce

    model = Lookups("embedding")
    ids = torch.tensor([[1, 2, 2], [1, 5, 9]])  # 4 distinct ids of 6
    batch = (ids, torch.ones(2, 3))
    prog = split_for_ps(autopar.trace(model, batch))
    assert _unique_per_pull(prog, model, batch) == [4]
    cluster = ClusterSpec.local(4)
    link, eff = cluster.intra_node, DEFAULT_EFFICIENCY.link  # the links' efficiency
    cmp = compare_ps(prog, [4], Layout(dp=2, ps=PSLayout(servers=2)), cluster)
    row = DIM * 4
    assert cmp.pull_bytes == cmp.push_bytes == 4 * (8 + row)
    # each trainer's port carries its pull and push; each server's 1/2 of both trainers'
    port = max(2 * 4 * (8 + row), 2 * 2 * 4 * (8 + row) / 2)
    assert cmp.ps_seconds == pytest.approx(port / (link.bandwidth * eff) + 2 * link.latency_s)
    assert cmp.dense_bytes == ROWS * DIM * 4
    assert cmp.allreduce_seconds == pytest.approx(ring_all_reduce(ROWS * DIM * 4, 2, link, eff))
    assert cmp.faster == ("parameter servers" if cmp.ps_seconds <= cmp.allreduce_seconds
                          else "all-reduce")
    assert "4 unique rows of 6 ids" in str(cmp) and cmp.faster in str(cmp)
    # a table of a million rows: pulling 4 rows beats all-reducing 16 MB
    big = compare_ps(prog, [4], Layout(dp=2, ps=PSLayout(servers=2)), cluster)
    big = type(big)(**{**big.__dict__, "dense_bytes": 10**6 * row,
                       "allreduce_seconds": ring_all_reduce(10**6 * row, 2, link)})
    assert big.faster == "parameter servers"


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_a_server_steps_touched_rows_as_torch_steps_the_dense_or_sparse_table(name):
    """The server core without a transport: two trainers' pushes in sync mode, each
    server row updated as torch's SGD / Adagrad update a dense table (untouched rows
    do not move for them) and as SparseAdam updates a sparse one."""
    from autopar.compiler.ir.ps_program import TableSpec
    from autopar.runtime.ps import PSServer

    factory = {"sgd": lambda p: torch.optim.SGD(p, lr=0.5),
               "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.3),
               "adam": lambda p: torch.optim.Adam(p, lr=0.1)}[name]
    torch.manual_seed(0)
    full = torch.randn(10, 3)
    spec = TableSpec("t", 10, 3, torch.float32)
    S = 2
    servers = [PSServer(s, PSLayout(servers=S), 2, [spec], [full], [], factory, "k")
               for s in range(S)]
    ref = nn.Embedding(10, 3, sparse=(name == "adam"))
    ref.weight.data.copy_(full)
    opt = (torch.optim.SparseAdam(ref.parameters(), lr=0.1) if name == "adam"
           else factory(list(ref.parameters())))
    for step in range(3):
        pushes = []
        for j in range(2):  # each trainer: its unique ids and their row gradients
            ids = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(
                10 * step + j)).unique()
            pushes.append((ids, torch.randn(len(ids), 3)))
        for s, server in enumerate(servers):
            for j, (ids, grad) in enumerate(pushes):
                mine = ids % S == s
                server.on_push(f"trainer{j}", [(ids[mine] // S, grad[mine])], [])
        dense = torch.zeros(10, 3)
        for ids, grad in pushes:
            dense.index_add_(0, ids, grad)
        dense /= 2
        opt.zero_grad()
        if name == "adam":
            nz = dense.abs().sum(1) > 0
            ref.weight.grad = torch.sparse_coo_tensor(nz.nonzero().T, dense[nz], (10, 3))
        else:
            ref.weight.grad = dense
        opt.step()
    got = torch.empty(10, 3)
    for s, server in enumerate(servers):
        got[s::S] = server.shards[0].detach()
        assert server.stats.window_sizes == [2, 2, 2]
    torch.testing.assert_close(got, ref.weight.detach(), rtol=1e-6, atol=1e-6)


def test_half_async_windows_hold_the_same_trainers_on_every_server():
    """Pushes reach two servers in different orders; each server's windows are the
    ones server 0 formed (pairing by arrival would leave trainer 0 waiting on server
    0 and trainer 1 on server 1, each for the other's next push). A member that dies
    before pushing is not waited for."""
    from autopar.compiler.ir.ps_program import TableSpec
    from autopar.runtime.ps import PSServer

    spec = TableSpec("t", 8, 2, torch.float32)
    layout = PSLayout(servers=2, mode="half-async", fraction=0.6)
    servers = [PSServer(s, layout, 3, [spec], [torch.zeros(8, 2)], [],
                        lambda p: torch.optim.SGD(p, lr=1.0), "k") for s in range(2)]
    names = [f"trainer{j}" for j in range(3)]
    joins = {j: servers[0].on_join(names[j]) for j in (2, 0)}  # window 0: trainers 2, 0
    joins[1] = servers[0].on_join(names[1])
    assert not joins[1].done()
    second = servers[0].on_join(names[2])  # window 1: trainers 1, 2
    assert joins[2].wait() == joins[0].wait() == (0, (names[2], names[0]))
    assert joins[1].wait() == second.wait() == (1, (names[1], names[2]))

    def push(s, j, window):
        row = torch.tensor([j // 2 if s == 0 else 0])
        return servers[s].on_push(names[j], [(row, torch.ones(1, 2))], [], window)

    w0, w1 = joins[0].wait(), joins[1].wait()
    pending = [push(1, 0, w0), push(1, 1, w1), push(0, 1, w1), push(0, 2, w0)]
    assert not any(f.done() for f in pending)
    pending += [push(1, 2, w0), push(0, 0, w0)]  # window 0 complete on both servers
    assert [f.done() for f in pending] == [True, False, False, True, True, True]
    pending += [push(0, 2, w1), push(1, 2, w1)]
    assert all(f.done() for f in pending)
    for server in servers:
        assert server.stats.window_needed == server.stats.window_sizes == [2, 2]
    # trainer 1 dies inside a window: the window applies with what came
    a, b = servers[0].on_join(names[0]), servers[0].on_join(names[1])
    window = a.wait()
    assert window == b.wait() == (2, (names[0], names[1]))
    got = push(0, 0, window)
    assert not got.done()
    servers[0]._finish(names[1])
    assert got.done() and servers[0].stats.window_sizes[-1] == 1
    with pytest.raises(PSError, match="applied without"):
        push(0, 1, window)
