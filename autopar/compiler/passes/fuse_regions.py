"""FuseRegions: group the joint graph's pointwise and row-reduction ops into fused kernels.

Rewrites each fusable region of the joint forward+loss+backward graph into one call
of the custom op `autopar::fused(key, inputs)` (compiler/codegen/kernels.py) whose
outputs are taken apart with getitem; the region's original aten ops become the
kernel's eager fallback and the source of its Triton kernel.

- Candidates: ops with a Triton lowering (codegen/ops.py: pointwise ops with
  broadcasting, reductions over the last dim, column sums, softmax, log-softmax,
  layer norm and their backwards, reshapes of contiguous tensors, remaps (slices,
  cat, slice_backward, transposes, expands), small middle-dim sums, constants, a
  dropout's mask draw). Matmuls, attention, reshapes of non-contiguous tensors,
  collectives and `comm` nodes are never fused; views at a region's edge stay views
  (`_trim_views`), and a remap that would read a reduction's value is left out with
  what follows it (`_cut_remaps`).
- Legality: torch.fx's CapabilityBasedPartitioner groups connected candidates
  without a cycle through the rest of the graph; it runs once per program (forward
  or backward of a pipeline stage), so no kernel spans two programs, on the nodes that
  can change that program's partition (`_partition_scope`: the regions of the whole
  graph, tests/unit/test_fusion.py). The code
  generator then accepts the region (one iteration shape, or a row kernel with
  per-row and column outputs) or says why not; a region over two sizes is cut to its
  largest part and the rest proposed again in the next round (see `_peel`).
- Profitability: a region is fused when it moves fewer bytes than its ops did
  unfused (each op reading its inputs and writing its output, as the cost model
  counts them); a lone op gains nothing and stays an aten op.

- Memo: the planner runs the pass on one forward and backward under many layouts that
  differ only in what the comm passes add. A run's decisions (the regions of each
  round, in order) are kept in this process under a hash of what they read
  (`_fingerprint`), and a later graph with the same hash replays them: the same graph
  as a fresh run (tests/unit/test_fusion.py), without the partitioner or code
  generation. It is module state on purpose (see `_RECIPES`): the planner calls
  `run_passes` many times per search and holds no object to keep it in.

Requires: "traced". Provides: "fused". Runs last in the default pass list (after the comm passes).

Before:                                         After:
    mul = mul(add, 0.5)                             fused = autopar.fused(k3f.., [add])
    tanh = tanh(mul)                                getitem = getitem(fused, 0)
    mul_1 = mul(tanh, add)                          mm = mm(getitem, t)
    mm = mm(mul_1, t)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import operator
from collections import Counter, OrderedDict

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from autopar.compiler.codegen.kernels import FUSED_OP, register_region
from autopar.compiler.codegen.ops import (
    ATEN_INPUT_PASSES,
    LAYOUT_VIEWS,
    POINTWISE,
    REMAPS,
    ROW_OPS,
    VIEWS,
    Unsupported,
    has_lowering,
    is_column_sum,
    is_remap,
    is_row_op,
    moves_no_data,
    unsupported_reason,
)
from autopar.compiler.codegen.triton_gen import TensorArg
from autopar.compiler.ir import meta as M
from autopar.compiler.ir.annotate import op_name, tensor_bytes
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.passes.base import GraphPass, PassContext, PassResult, writable
from autopar.compiler.passes.manager import register_pass

FUSED_KEY = "autopar.fused_key"  # str: the region's key on its fused node
FUSED_OPS = "autopar.fused_ops"  # list[str]: names of the ops the fused node replaced


def program_of(node: fx.Node) -> tuple | None:
    """Which program a node runs in (forward or backward, and its pipeline stage);
    None for nodes never fused (collectives and their packing, the optimizer)."""
    role = node.meta.get(M.ROLE)
    if role not in (M.Role.FORWARD, M.Role.LOSS, M.Role.BACKWARD):
        return None
    return (role == M.Role.BACKWARD, node.meta.get(M.STAGE))


class _Fusable(OperatorSupportBase):
    """The partitioner's checker: candidates of one program; records why others are not."""

    def __init__(self, program: tuple):
        self.program = program
        self.rejected: dict[fx.Node, str] = {}

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        if node.op != "call_function" or program_of(node) != self.program:
            return False
        if node.target is operator.getitem:  # of a multi-output op that is itself fused
            return node.args[0].op == "call_function" and unsupported_reason(node.args[0]) is None
        reason = unsupported_reason(node)
        if reason is not None and has_lowering(node):  # views, matmuls: never fused, by design
            self.rejected[node] = reason
        return reason is None


def _region_io(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """External inputs (first-use order) and the nodes whose values leave the region."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    return inputs, outputs


def _subgraph(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(inputs):
        env[a] = graph.placeholder(f"in{i}")
        env[a].meta = {"val": a.meta[M.VAL]}
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta = {"val": n.meta[M.VAL]}
    graph.output([env[n] for n in outputs])
    # lazy: its Python code is generated when it first runs; the pass only keys and
    # generates kernels from its graph, for many regions it then leaves unfused
    return _LazyGraphModule(torch.nn.Module(), graph)


def _bytes_unfused(nodes: list[fx.Node]) -> int:
    """Bytes the region's ops move as aten ops: each reads its inputs (twice for ops with
    two kernels, ATEN_INPUT_PASSES) and writes its output; views move none."""
    total = 0
    for n in nodes:
        if not moves_no_data(n):
            reads = sum(tensor_bytes(a.meta.get(M.VAL)) for a in n.all_input_nodes)
            total += reads * ATEN_INPUT_PASSES.get(n.target, 1) + tensor_bytes(n.meta.get(M.VAL))
    return total


def _region_name(nodes: list[fx.Node]) -> str:
    named = [n.target for n in nodes if n.target in ROW_OPS] or \
        [n.target for n in nodes if n.target in POINTWISE or n.target in REMAPS]
    base = named[0]._schema.name.split("::")[-1].lstrip("_") if named else "fused"
    return f"{base}_x{len(nodes)}"


def _trim_views(nodes: list[fx.Node]) -> list[fx.Node]:
    """Leave out views at the region's edge: reshapes and transposes of its inputs whose
    values are also used outside it (a kernel output cannot be a view of its input: they
    read the input through the view instead), and transposes, permutes and expands of
    its values that only the rest of the graph reads (it views the kernel's output, as
    it viewed the unfused value). They sit at the edge, so no cycle appears."""
    nodes = list(nodes)
    while True:
        inside = set(nodes)
        edge = [n for n in nodes if (n.target in VIEWS or n.target in LAYOUT_VIEWS)
                and not set(n.all_input_nodes) & inside and any(u not in inside for u in n.users)]
        edge += [n for n in nodes if n.target in LAYOUT_VIEWS and not set(n.users) & inside]
        if not edge:
            return nodes
        nodes = [n for n in nodes if n not in edge]


def _storage_roots(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each node's storage owner as eager runs the ops: itself, for a view the owner of
    what it views (a node outside the region when it views an input); a getitem of an op
    that computes several outputs owns its output (a layer norm's mean dies apart from
    its result), a getitem of a view op's list (split) views what that op views."""
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        first = n.all_input_nodes[0] if n.all_input_nodes else n
        computed = n.target is operator.getitem and not moves_no_data(first)
        root[n] = root.get(first, first) if moves_no_data(n) and not computed else n
    return root


def _distinct_outputs(nodes: list[fx.Node], outputs: list[fx.Node]):
    """The region's outputs with no two of one storage: where several outputs are (views
    of) one value of the region, that value is the output and the views are made again
    outside from it (a kernel would write the elements twice; inline, one storage would
    stand for two in the cost model). Returns (outputs, [(value, [view, ...])]): each
    re-made view with the chain of views from its value to it, in order."""
    inside = set(nodes)
    root = _storage_roots(nodes)
    by_root: dict[fx.Node, list[fx.Node]] = {}
    for o in outputs:
        by_root.setdefault(root[o], []).append(o)
    kept, views = [], []
    for o in outputs:
        r = root[o]
        if r not in inside or len(by_root[r]) == 1:  # its own storage (or an input's view)
            kept.append(o)
            continue
        if r not in kept:
            kept.append(r)
        if o is not r:
            chain = [o]
            while chain[-1].all_input_nodes[0] is not r:
                chain.append(chain[-1].all_input_nodes[0])
            views.append((r, chain[::-1]))
    return kept, views


class _Region:
    """One candidate partition, its generated kernel and its byte accounting."""

    def __init__(self, nodes: list[fx.Node]):
        self.nodes = nodes
        self.inputs, outputs = _region_io(nodes)
        self.outputs, self.views = _distinct_outputs(nodes, outputs)
        self.args = [TensorArg(tuple(a.meta[M.VAL].shape), tuple(a.meta[M.VAL].stride()),
                               a.meta[M.VAL].dtype) for a in self.inputs]
        self.bytes_before = _bytes_unfused(nodes)
        self.bytes_after = sum(map(_bytes_read, self.inputs, [set(nodes)] * len(self.inputs))) \
            + sum(tensor_bytes(n.meta.get(M.VAL)) for n in self.outputs)
        self.inline = inline_timeline(nodes, self.inputs, self.outputs)

    @functools.cached_property
    def gm(self) -> fx.GraphModule:
        """The region's ops as a GraphModule (the kernel's fallback and codegen source)."""
        return _subgraph(self.nodes, self.inputs, self.outputs)

    def describe(self) -> str:
        return f"{_region_name(self.nodes)} at {self.nodes[0].name} ({len(self.nodes)} ops)"


def _bytes_read(value: fx.Node, inside: set[fx.Node]) -> int:
    """Bytes a kernel reads of its input `value`: all of it, or what its slices take when
    the region reads it only through slices (tensor parallelism's head range of a
    replicated tensor)."""
    whole = tensor_bytes(value.meta.get(M.VAL))
    readers, todo = [], [u for u in value.users if u in inside]
    while todo:  # through reshapes to what reads the elements
        user = todo.pop()
        if user.target in VIEWS:
            todo += [u for u in user.users if u in inside]
        else:
            readers.append(user)
    if readers and all(u.target == torch.ops.aten.slice.Tensor for u in readers):
        return min(whole, sum(tensor_bytes(u.meta.get(M.VAL)) for u in readers))
    return whole


def inline_timeline(nodes: list[fx.Node], inputs: list[fx.Node],
                    outputs: list[fx.Node]) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """The region's memory when its ops run inline, as the runtime runs them where no
    kernel does (a CPU: codegen/kernels.py's run rule): per op, (bytes it makes, bytes
    of region values freed after it, the positions in `inputs` whose last read in the
    region it is). Storage as `_storage_roots` has it: views make nothing and keep what
    they view alive; a value lives until the last op reading it or a view of it, the
    outputs to the end. The memory model replays it (analysis/memory.graph_liveness)."""
    root = _storage_roots(nodes)
    last: dict[fx.Node, int] = {}
    for k, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[root.get(a, a)] = k
    kept = {root[o] for o in outputs}
    index = {n: k for k, n in enumerate(nodes)}
    made = [0] * len(nodes)
    freed = [0] * len(nodes)
    for k, n in enumerate(nodes):
        if root[n] is not n:
            continue
        nbytes = tensor_bytes(n.meta.get(M.VAL))
        # a getitem's output is made by the op it takes it from, which keeps the
        # outputs nobody takes until its last getitem
        maker = index.get(n.args[0], k) if n.target is operator.getitem else k
        if n.target is not operator.getitem:
            nbytes -= sum(tensor_bytes(u.meta.get(M.VAL)) for u in n.users
                          if u.target is operator.getitem and root.get(u) is u)
        made[maker] += nbytes
        if n not in kept:  # freed after its last reader (at once when nothing reads it)
            freed[max(last.get(n, maker), maker)] += nbytes
    dying: dict[int, list[int]] = {}
    for p, a in enumerate(inputs):
        if a in last:
            dying.setdefault(last[a], []).append(p)
    return tuple((made[k], freed[k], tuple(dying.get(k, ()))) for k in range(len(nodes)))


def _candidates(tg: TrainGraph, rejected: dict[fx.Node, str]) -> list[list[fx.Node]]:
    nodes = list(tg.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    members: dict[tuple, list[fx.Node]] = {}
    for n in nodes:
        if n.op == "call_function" and (p := program_of(n)) is not None:
            members.setdefault(p, []).append(n)
    out = []
    for program, inside in members.items():
        support = _Fusable(program)
        view = _ProgramView(_partition_scope(inside, order))
        partitioner = _ProgramPartitioner(view, support, allows_single_node_partition=True,
                                          skip_horizontal_fusion=True)
        for part in partitioner.propose_partitions():
            out.append(sorted(part.nodes, key=order.__getitem__))
        rejected.update(support.rejected)
    return sorted(out, key=lambda nodes: order[nodes[0]])


def _partition_scope(inside: list[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
    """The nodes the partitioner must see to partition one program as it would on the
    whole graph, in graph order: the program's, every node outside it on a path from the
    program back into it (such a path forbids some merges), and the values the program
    reads (the partitioner moves a getitem to its producer's partition, none when the
    producer is outside). Any other node is unsupported, makes no partition and lies on
    no path between two of the program's nodes, so leaving it out changes no partition,
    and the partitioner's downstream sets shrink from the rest of the graph (a forward
    reaches the whole backward) to the program."""
    members = set(inside)
    reached: set[fx.Node] = set()  # outside nodes a path from the program reaches
    todo = [u for n in inside for u in n.users if u not in members]
    while todo:
        n = todo.pop()
        if n not in reached:
            reached.add(n)
            todo += [u for u in n.users if u not in members]
    returning: set[fx.Node] = set()  # of those, the ones with a path back into it
    todo = [a for n in inside for a in n.all_input_nodes if a in reached]
    while todo:
        n = todo.pop()
        if n not in returning:
            returning.add(n)
            todo += [a for a in n.all_input_nodes if a in reached]
    read = {a for n in inside for a in n.all_input_nodes}
    return sorted(members | returning | read, key=order.__getitem__)


class _ProgramView:
    """What CapabilityBasedPartitioner reads of its graph module: `graph.nodes`, in order
    (here a subset of a graph's nodes, `_partition_scope`)."""

    def __init__(self, nodes: list[fx.Node]):
        self.graph = self
        self.nodes = nodes


class _ProgramPartitioner(CapabilityBasedPartitioner):
    """The partitioner asking `_Fusable`, which reads no submodule: without the dict of
    the graph module's submodules the base class builds for each node it asks about."""

    def _is_node_supported(self, node: fx.Node) -> bool:
        return self.operator_support.is_node_supported({}, node)


def _replace(tg: TrainGraph, region: _Region, key: str, name: str) -> list[fx.Node]:
    """Put the fused node where the region's last op stood; its outputs' getitems, in order."""
    graph, last = tg.graph, region.nodes[-1]
    with graph.inserting_after(last):
        fused = graph.create_node("call_function", FUSED_OP, (key, list(region.inputs)),
                                  name=f"fused_{name}")
    fused.meta = {**last.meta, M.VAL: [n.meta[M.VAL] for n in region.outputs],
                  M.CREATED_BY: "fusion", M.FLOPS: sum(n.meta.get(M.FLOPS, 0) for n in region.nodes),
                  M.BYTES: region.bytes_after, FUSED_KEY: key,
                  FUSED_OPS: [n.name for n in region.nodes],
                  M.FUSED_PROVENANCE: tuple(M.Provenance(n) for n in region.nodes),
                  # what runs where no kernel does (a CPU step): costed op by op
                  M.FUSED_INLINE: region.inline,
                  M.FUSED_MEMBERS: tuple(
                      (op_name(n), n.meta.get(M.FLOPS, 0), n.meta.get(M.BYTES, 0),
                       0 if moves_no_data(n) else tensor_bytes(n.meta.get(M.VAL)))
                      for n in region.nodes)}
    fused.meta.pop(M.GRAD_OF, None)  # a getitem below carries it, with the value
    items = []
    for index, old in enumerate(region.outputs):
        with graph.inserting_after(fused):
            item = graph.call_function(operator.getitem, (fused, index))
        item.meta = {**old.meta, M.CREATED_BY: "fusion", M.BYTES: 0, M.FLOPS: 0,
                     M.COMPUTES: old.meta.get(M.COMPUTES, (old.name, M.op_key(old)))}
        items.append(item)
    remade = []
    for value, chain in region.views:  # outputs that view another one: viewed outside
        made = {value: items[region.outputs.index(value)]}
        for view in chain:
            with graph.inserting_after(made[view.all_input_nodes[0]]):
                made[view] = graph.node_copy(view, lambda a: made.get(a, a))
            made[view].meta[M.CREATED_BY] = "fusion"
        remade.append((chain[-1], made[chain[-1]]))
    for old, new in [*zip(region.outputs, items), *remade]:
        old.replace_all_uses_with(new)
    for old in reversed(region.nodes):
        graph.erase_node(old)
    return items


def stable_toposort(graph: fx.Graph, first: dict[fx.Node, float]) -> None:
    """Reorder `graph` topologically, keeping each node as early as its original
    position allows (`first`: a node's sort key; missing nodes sort by position)."""
    position = {n: first.get(n, i) for i, n in enumerate(graph.nodes)}
    output = graph.output_node()
    pending = {n: len(set(n.all_input_nodes)) for n in graph.nodes}
    ready = [(position[n], i, n) for i, n in enumerate(graph.nodes) if not pending[n]]
    heapq.heapify(ready)
    tie = len(pending)
    while ready:
        _, _, node = heapq.heappop(ready)
        if node is not output:
            output.prepend(node)
        for user in node.users:
            pending[user] -= 1
            if not pending[user]:
                tie += 1
                heapq.heappush(ready, (position[user], tie, user))


@register_pass
class FuseRegions(GraphPass):
    name = "fusion"
    requires = frozenset({"traced"})
    provides = frozenset({"fused"})
    layout_fields = frozenset({"fusion"})

    def run(self, tg: TrainGraph, ctx: PassContext) -> tuple[TrainGraph, PassResult]:
        if not ctx.layout.fusion:
            return tg, PassResult(self.name, changed=False, declined=[("fusion", "Layout.fusion=False")])
        out = writable(tg, ctx)
        stats = Counter()
        made: set[fx.Node] = set()  # the nodes the pass made
        key = _fingerprint(out)
        recipe = _RECIPES.get(key) if key is not None else None
        if recipe is not None:  # the same ops fused before: the same regions, replayed
            _RECIPES.move_to_end(key)
            for regions in recipe.rounds:
                _replay_round(out, regions, stats, made)
            reasons = list(recipe.declined)
        else:
            rejected: dict[fx.Node, str] = {}
            declined: dict[tuple[str, str], fx.Node] = {}
            rounds = []
            # NOTE: rounds until nothing more fuses: what a round peels off a region
            # (another iteration shape) is proposed again, as its own region, next round
            while regions := _fuse_round(out, rejected, declined, stats, made):
                rounds.append(regions)
            alive = set(out.graph.nodes)
            reasons = [what for what, node in declined.items() if node in alive]
            reasons += [(f"{count} op(s)", why) for why, count in Counter(rejected.values()).items()]
            # a region holding a node the pass made is named by what the graph called
            # it, which another graph may call something else: such a run is not kept
            # (none is: the ops the pass makes are not fusable)
            if key is not None and None not in (ops for regions in rounds
                                                for ops, _, _ in regions):
                _RECIPES[key] = _Recipe(tuple(rounds), tuple(reasons))
                while len(_RECIPES) > _RECIPES_KEPT:
                    _RECIPES.popitem(last=False)
        out.gm.recompile()
        return out, PassResult(self.name, changed=stats["kernels"] > 0, stats=dict(stats),
                               declined=reasons)


# -- the memo: the planner fuses the same forward and backward under many layouts -----------

@dataclasses.dataclass(frozen=True)
class _Recipe:
    """What one run of the pass decided: per round, the regions fused in order (their
    ops' names, kernel key and name), and what it declined."""

    rounds: tuple[tuple[tuple[tuple[str, ...], str, str], ...], ...]
    declined: tuple[tuple[str, str], ...]


# The memo, shared by every run of the pass in this process, least recently used first.
# What: per `_fingerprint` (a sha256 of every op of the forward and backward programs
# with its arguments, program, shape, stride and dtype, and what it reads, the values
# from outside the programs named by first read), the
# regions each round fused (the ops' names, the kernel's key and name) and what the
# run declined; never a graph or a node. Why sharing cannot give a wrong result: the
# decisions are a function of what the fingerprint hashes and nothing else (the
# context is read only for Layout.fusion, checked before the memo; the partitioner
# and code generator read only the graph), so a graph with the same fingerprint gets
# the regions a fresh run would pick, by the same names; their kernels are in
# codegen.kernels' registry, keyed by their code and never forgotten in a process. A
# run whose regions hold a node the pass made is not kept (its name could differ),
# nor is a graph with no fingerprint. Not thread-safe: the planner's workers are
# forked processes, each with its own copy. `clear_memo()` empties it.
_RECIPES: OrderedDict[str, _Recipe] = OrderedDict()
_RECIPES_KEPT = 32  # the planner's forward-level graphs x stage cuts, and room to spare


def clear_memo() -> None:
    """Forget the fusion decisions kept in this process (the next run decides afresh)."""
    _RECIPES.clear()


def _fingerprint(tg: TrainGraph) -> str | None:
    """A hash of everything the pass's decisions read: the ops of the forward and backward
    programs in graph order (name, op, program, arguments, value shape, stride and
    dtype, whether a value is read outside its program) and the values they read. A
    value from outside the programs is named by the order of its first read, not by
    its node: ZeRO-3 reads each weight from its gather, which the pass never fuses and
    whose name is not the parameter's. Layouts that differ only in what the comm passes
    add (gradient buckets, ZeRO) fuse alike. None when a path leaves the programs and
    comes back into them: then the partition could depend on the rest of the graph, and
    the pass decides afresh."""
    inside: set[fx.Node] = set()
    left: set[fx.Node] = set()  # values outside the programs computed from inside
    # a value read from outside: named by its first read in each program (a region is
    # of one program, so which value another program reads does not change it)
    outside: dict[tuple, dict[fx.Node, str]] = {}

    def label(a: fx.Node, program: tuple) -> str:
        if a in inside:
            return a.name
        names = outside.setdefault(program, {})
        return names.setdefault(a, f"@{len(names)}")

    lines = []
    for n in tg.graph.nodes:
        program = program_of(n) if n.op == "call_function" else None
        if program is None:
            if any(a in inside or a in left for a in n.all_input_nodes):
                left.add(n)
            continue
        if any(a in left for a in n.all_input_nodes):
            return None
        inside.add(n)
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: label(a, program))
        reads = [f"{label(a, program)}:{_signature(a)}" for a in n.all_input_nodes]
        lines.append(f"{n.name}|{n.target}|{program}|{args}|{reads}|"
                     f"{_signature(n)}|{any(program_of(u) != program for u in n.users)}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _signature(node: fx.Node) -> str:
    val = node.meta.get(M.VAL)
    vals = val if isinstance(val, (tuple, list)) else [val]
    return ";".join(f"{tuple(v.shape)}/{v.stride()}/{v.dtype}" if isinstance(v, torch.Tensor)
                    else type(v).__name__ for v in vals)


class _Round:
    """One round's rewrites: each region replaced where its first op stood (`order`
    keeps the fused node there, and every other node where it stood when the round
    began, when the round ends in a stable topological sort). `made` collects the
    nodes the rewrites make."""

    def __init__(self, out: TrainGraph, made: set[fx.Node]):
        self.out, self.made = out, made
        self.order: dict[fx.Node, float] = {n: i for i, n in enumerate(out.graph.nodes)}

    def apply(self, region: _Region, key: str, name: str, stats: Counter) -> None:
        start = min(self.order[n] for n in region.nodes)
        items = _replace(self.out, region, key, name)
        self.made.update(items)
        self.made.update(n.args[0] for n in items)
        stats["kernels"] += 1
        stats["ops_fused"] += sum(n.target is not operator.getitem for n in region.nodes)
        stats["bytes_saved"] += region.bytes_before - region.bytes_after
        self.order.update({n: start + 0.5 for n in self.out.graph.nodes if n not in self.order})

    def finish(self) -> None:
        # NOTE: every node keyed by its place when the round began. Keying the others by
        # their place after the erasures (shifted left by every region fused before
        # them) put each fused node hundreds of places late among them: the ops waiting
        # for it stalled, and the sort pulled every ready node ahead meanwhile (a ZeRO-3
        # step issued its backward gathers blocks early and held those weights).
        stable_toposort(self.out.graph, self.order)


def _fuse_round(out: TrainGraph, rejected, declined, stats, made: set[fx.Node]
                ) -> list[tuple[tuple[str, ...] | None, str, str]]:
    """Fuse every profitable region the partitioner proposes now; the regions fused (their
    ops' names, None if one is a node the pass made; kernel key and name), in order."""
    rewrite = _Round(out, made)
    fused_now = []
    for nodes in _candidates(out, rejected):
        found = _emit(nodes, rewrite.order, declined)
        if found is None:
            continue
        region, fused = found
        names = None if any(n in made for n in region.nodes) else \
            tuple(n.name for n in region.nodes)
        fused_now.append((names, fused.key, fused.name))
        rewrite.apply(region, fused.key, fused.name, stats)
    rewrite.finish()
    return fused_now


def _replay_round(out: TrainGraph, regions, stats, made: set[fx.Node]) -> None:
    """A round of an earlier run (`_fuse_round`'s regions) on a graph with the same ops."""
    by_name = {n.name: n for n in out.graph.nodes}
    rewrite = _Round(out, made)
    for ops, key, name in regions:
        rewrite.apply(_Region([by_name[op] for op in ops]), key, name, stats)
    rewrite.finish()


def _emit(nodes: list[fx.Node], order, declined):
    """(region, its registered kernel) for a candidate partition, or None: unprofitable,
    or the code generator declined it and its largest-shape part (recorded in `declined`)."""
    nodes = _trim_views(_cut_remaps(nodes))
    for attempt in (nodes, _peel(nodes)):
        if not attempt or all(n.target is operator.getitem or n.target in VIEWS for n in attempt):
            return None
        if attempt is not nodes and (attempt == nodes or _has_cycle(attempt, order)):
            return None
        region = _Region(attempt)
        if region.bytes_after >= region.bytes_before:
            return None  # a lone op (or a region saving nothing) stays an aten op
        try:
            fused = register_region(region.gm, region.args, _region_name(attempt))
            fused.check(region.args)
            return region, fused
        except Unsupported as exc:
            declined.setdefault((region.describe(), str(exc)), attempt[0])
    return None


def _cut_remaps(nodes: list[fx.Node]) -> list[fx.Node]:
    """The region without each remap (a slice, cat, transpose, ...) that reads a value a
    reduction makes, and without what follows it: a kernel computes such a value at its
    own row only (triton_gen's `_Emitter.at`). GPT-2's loss: the log-softmax backward
    stays a row kernel and the shift's slice_backward after it an aten op."""
    inside = set(nodes)
    cut: set[fx.Node] = set()
    for n in nodes:
        if n in cut:
            continue
        if is_remap(n) and _reads_reduction(n, inside):
            cut.add(n)
        if cut & set(n.all_input_nodes):
            cut.add(n)
    return [n for n in nodes if n not in cut] if cut else nodes


def _reads_reduction(node: fx.Node, inside: set[fx.Node]) -> bool:
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or n not in inside:
            continue
        seen.add(n)
        if n.target is operator.getitem or (n.target in ROW_OPS and not is_remap(n)):
            return True
        stack += n.all_input_nodes
    return False


def _domain(node: fx.Node) -> int:
    """Elements of the iteration a node belongs to (a reduction: its input's)."""
    src = node.args[0] if node.target is operator.getitem else node
    val = src.args[0].meta[M.VAL] if is_row_op(src) or is_column_sum(src) else src.meta[M.VAL]
    val = next((v for v in val if isinstance(v, torch.Tensor)), None) \
        if isinstance(val, (tuple, list)) else val
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _peel(nodes: list[fx.Node]) -> list[fx.Node]:
    """The part of a region over its largest iteration: nodes of other sizes are taken off
    its input and output sides (Llama's rotary tables feed both the query's and the
    smaller key's chain: the query's chain stays, the rest is proposed again later). A
    node only remaps read is computed at their indices: it counts as theirs (the rotary
    embedding's half-width slices and neg belong to the cat's iteration)."""
    if not nodes:
        return nodes
    inside = set(nodes)
    domains: dict[fx.Node, int] = {}
    remapped: set[fx.Node] = set()  # read only by remaps, directly or through such nodes
    for n in reversed(nodes):
        if n.users and all(u in inside and (is_remap(u) or u in remapped)
                           for u in n.users):
            remapped.add(n)
            domains[n] = max(domains[u] for u in n.users)
        else:
            domains[n] = _domain(n)
    domain = max(domains.values())
    kept = list(nodes)
    while True:
        inside = set(kept)
        edge = {n for n in kept if domains[n] != domain
                and (not set(n.all_input_nodes) & inside or not set(n.users) & inside)}
        if not edge:
            return kept
        kept = [n for n in kept if n not in edge]


def _has_cycle(nodes: list[fx.Node], order: dict[fx.Node, float]) -> bool:
    """Whether a path leaves `nodes` and comes back (fusing them would make a cycle)."""
    inside, last = set(nodes), max(order[n] for n in nodes)
    stack = [u for n in nodes for u in n.users if u not in inside]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen or order.get(node, last + 1) > last:
            continue
        seen.add(node)
        for user in node.users:
            if user in inside:
                return True
            stack.append(user)
    return False


__all__ = ["FuseRegions", "FUSED_KEY", "FUSED_OPS", "stable_toposort"]
