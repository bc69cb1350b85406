"""Choose one sharding strategy per forward op: an integer program solved by HiGHS.

Variables: x[v, s] = 1 if node v runs strategy s (exactly one per node). The cost,
in seconds of one training step under the cost model (a pure function of the
cluster, no clocks):

- compute: each op's roofline time (forward and twice that for backward) times the
  fraction of the work one rank does under s;
- redistribution on every edge u -> v whose producer's output placement differs
  from the placement v's strategy needs (y[e, p, q] >= o[u, p] + r[v, q] - 1):
  all-gather, all-reduce, reduce-scatter or a local slice, plus the collective
  its backward needs;
- the gradient all-reduce of a replicated value that feeds ops whose work is
  split (z[u] >= x[v, s]): each rank then holds only part of the value's gradient
  (Megatron's "f"); one all-reduce per value, however many such consumers;
- collectives a lowering issues itself (the vocabulary-parallel loss);
- the optimizer's update of each parameter, which reads and writes about 7 values
  per element (AdamW: weight, gradient, two moments; SGD fewer), on 1/tp of it when
  sharded: what sharding a weight saves every step besides memory.

All-replicated is always feasible, so the chosen plan is never predicted slower
than replicating everything (tests/unit/test_tensor_parallel.py checks it).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import highspy
import numpy as np
import torch
import torch.fx as fx

from autopar.compiler.ir.annotate import (
    module_of,
    node_bytes,
    node_flops,
    source_of,
    tensor_bytes,
)
from autopar.compiler.passes.tp_rules import (
    P,
    Placement,
    R,
    Strategy,
    Strided,
    fits,
    is_tensor_node,
    output_vals,
    show,
    split_dim,
    strategies,
    strided_demand,
    tensor_inputs,
)
from autopar.costs import collective_time, op_time
from autopar.highs import new_model

# bytes the optimizer reads and writes per parameter element per step, in units of the
# element size: AdamW reads weight, gradient and two moments and writes three of them
OPTIMIZER_TOUCHES = 7
INF = math.inf


@dataclass
class TPCosts:
    """The cost model's prices of what the solver trades: compute, collectives on the
    tp group (one node, the intra-node link), optimizer updates."""

    cluster: object  # autopar.ClusterSpec
    tp: int

    def compute(self, node: fx.Node, strategy: Strategy) -> float:
        flops = node_flops(node) or _extra_flops(node)
        nbytes = node_bytes(node) + self._unfused_scores(node)
        if not flops and not nbytes:
            return 0.0
        dev = self.cluster.device
        peak = self.cluster.peak_flops_for("fp32")
        return 3 * strategy.work * op_time(flops, nbytes, peak, dev.memory_bandwidth)

    def _unfused_scores(self, node: fx.Node) -> int:
        """Bytes a cluster without fused attention (DeviceSpec.attention "unfused") moves
        for sdpa's materialised scores: written, read by the softmax, its probabilities
        written and read by the second matmul (the trace decomposes it so, ir/trace.py)."""
        if node.target is not _SDPA or self.cluster.device.attention != "unfused":
            return 0
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        return 4 * q.shape[:-1].numel() * k.shape[-2] * q.element_size()

    def collective(self, kind: str, nbytes: float) -> float:
        return collective_time(kind, nbytes, self.tp, self.cluster)

    def redistribute(self, src: Placement, dst: Placement, val: torch.Tensor,
                     needs_grad: bool) -> float:
        """Forward conversion src -> dst and the conversion its backward does."""
        if src == dst:
            return 0.0
        n = tensor_bytes(val)
        grad = (lambda kind: self.collective(kind, n)) if needs_grad else (lambda kind: 0.0)
        if dst == P:
            return INF  # nothing turns a whole value into a partial sum worth having
        if src == P:
            if dst == R:
                return self.collective("all_reduce", n)
            return self.collective("reduce_scatter", n) + grad("all_gather")
        if src == R:  # a local slice; the backward gathers the gradient's blocks
            return grad("all_gather")
        if dst == R:  # gather the blocks; the backward keeps its own block (or, when the
            # consumers split their work, reduce-scatters: priced as their all-reduce)
            return self.collective("all_gather", n)
        if isinstance(src, Strided) or isinstance(dst, Strided):
            return INF  # pieces to another split: not converted (tp_comm.redistribute)
        # one split dim for another: an all-to-all moves (tp-1)/tp of each rank's block, as
        # an all-gather of one block's size would (and the same back in backward)
        return self.collective("all_gather", n / self.tp) + grad("all_gather") / self.tp

    def lowering(self, strategy: Strategy) -> float:
        return sum(self.collective(kind, n) for kind, n in strategy.comm)

    def optimizer_update(self, val: torch.Tensor, placement: Placement) -> float:
        share = 1 / self.tp if split_dim(placement) is not None else 1.0
        return share * OPTIMIZER_TOUCHES * tensor_bytes(val) / self.cluster.device.memory_bandwidth


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _extra_flops(node: fx.Node) -> int:
    """FLOPs of forward ops the joint graph's counter never sees (they decompose there)."""
    if node.target == torch.ops.aten.linear.default:
        out, x = node.meta["val"], node.args[0].meta["val"]
        return 2 * out.numel() * x.shape[-1]
    return 0


@dataclass
class TPPlan:
    """The chosen strategy of every node, the placement of every value, and costs."""

    tp: int
    choice: dict[str, Strategy]
    placement: dict[str, Placement | tuple[Placement, ...]]
    cost_s: float  # predicted seconds of the cost terms above
    replicated_cost_s: float  # the same with every op replicated
    options: dict[str, int] = field(default_factory=dict)  # node -> number of strategies


def needs_grad(graph: fx.Graph, params: set[str]) -> set[str]:
    """Names of the nodes whose value gets a gradient (floating, downstream of a parameter)."""
    out: set[str] = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        floating = any(v is not None and v.is_floating_point() for v in output_vals(node)) \
            if node.op != "placeholder" else isinstance(val, torch.Tensor) and val.is_floating_point()
        if node.op == "placeholder":
            if node.name in params:
                out.add(node.name)
        elif floating and node.op == "call_function" and not isinstance(
                node.target, torch._ops.HigherOrderOperator) \
                and any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def data_dims(graph: fx.Graph, inputs: dict[str, Iterable[int]]) -> dict[str, set[int]]:
    """node -> the dims of its value that derive from the given dims of the user inputs
    (`inputs`: placeholder -> dims), through each output dim a strategy maps such a dim
    to: the batch and sequence of the activations, through views and matmuls."""
    out: dict[str, set[int]] = {n: set(dims) for n, dims in inputs.items()}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            if node.op == "call_function" and node.args[0].name in out:
                out[node.name] = set(out[node.args[0].name])
            continue
        ins = tensor_inputs(node)
        found: set[int] = set()
        for s in strategies(node, 1):
            if any(split_dim(p) in out.get(a.name, ()) for a, p in zip(ins, s.inputs)):
                found.update(split_dim(p) for p in s.outputs() if split_dim(p) is not None)
        if found:
            out[node.name] = found
    return out


def _splits_data(s: Strategy, node: fx.Node, data: dict[str, set[int]]) -> bool:
    if any(split_dim(p) in data.get(a.name, ()) for a, p in zip(tensor_inputs(node), s.inputs)):
        return True
    return any(split_dim(p) in data.get(node.name, ()) for p in s.outputs())


def solve(graph: fx.Graph, tp: int, costs: TPCosts, param_options: dict[str, list[Placement]],
          tied: Iterable[list[str]] = (), unsplit: dict[str, Iterable[int]] | None = None,
          param_budget: float | None = None,
          split: dict[str, Iterable[int]] | None = None) -> TPPlan:
    """The cheapest strategy per node. `param_options`: placeholder -> placements the
    parameter may take (other placeholders are replicated inputs); `tied`: groups of
    placeholders that are one tensor and must take one placement; `unsplit`: user
    input placeholder -> its dims that no value derived from them may be split on (see
    tensor_parallel.unsplit_dims); `param_budget`: the most bytes of parameters one
    rank may hold (None: no limit); `split`: user input placeholder -> dims that every
    value derived from them is split on wherever its op can run so (sequence
    parallelism), rather than kept whole."""
    grads = needs_grad(graph, set(param_options))
    banned = data_dims(graph, unsplit or {})
    wanted = {n: dims - banned.get(n, set()) for n, dims in data_dims(graph, split or {}).items()}
    demand = strided_demand(graph, tp)
    param_options = with_strided(graph, param_options, demand, tied, tp)
    options = _options(graph, tp, param_options, costs, banned, wanted, demand)
    model = _Model()
    x = {name: model.choose(name, opts) for name, opts in options.items()}
    for group in tied:
        for other in group[1:]:
            for (a, _), (b, _) in zip(x[group[0]], x[other]):
                model.equal(a, b)
    if param_budget is not None:
        model.budget(_param_bytes(graph, {n: x[n] for n in param_options}, tied, tp), param_budget)
    out_expr = {}  # node -> {placement: [(var or None, strategy)]}
    for node in graph.nodes:
        if node.name in x:
            out_expr[node.name] = _placement_expr(x[node.name], lambda s: s.output)
        elif node.op == "call_function" and node.target is operator.getitem \
                and node.args[0].name in x:
            idx = node.args[1]
            out_expr[node.name] = _placement_expr(x[node.args[0].name],
                                                  lambda s, i=idx: s.outputs()[i])
    for node in graph.nodes:
        if node.name not in x:
            continue
        for slot, src in enumerate(tensor_inputs(node)):
            need = _placement_expr(x[node.name], lambda s, i=slot: s.inputs[i])
            try:
                model.edge(out_expr[src.name], need,
                           lambda p, q, v=src.meta["val"], g=src.name in grads:
                           costs.redistribute(p, q, v, g))
            except _NoPlan as exc:
                raise TensorParallelPlanError(
                    node, tp, f"its input {src.name} can only be "
                    f"{' or '.join(sorted(show(p) for p in out_expr[src.name]))}, and no "
                    f"strategy of {node.target} takes that as input {slot} ({exc})") from None
            if src.name in grads:
                split_users = [var for var, s in x[node.name] if s.inputs[slot] == R and s.splits_work]
                model.grad_allreduce(src.name, split_users,
                                     costs.collective("all_reduce", tensor_bytes(src.meta["val"])))
    for out in graph.output_node().args[0]:
        if is_tensor_node(out):
            if R not in out_expr[out.name]:
                raise TensorParallelPlanError(
                    out, tp, f"the step returns it whole, and every strategy of its op gives "
                             f"{' or '.join(sorted(show(p) for p in out_expr[out.name]))}")
            try:
                model.require(out_expr[out.name], R)
            except _NoPlan as exc:
                raise TensorParallelPlanError(out, tp, f"the step returns it whole, and it "
                                                       f"can only be split ({exc})") from None
    model.solve(tp)
    choice = {name: model.chosen(opts) for name, opts in x.items()}
    placement = {name: s.output for name, s in choice.items()}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem \
                and node.args[0].name in choice:
            placement[node.name] = choice[node.args[0].name].outputs()[node.args[1]]
    return TPPlan(tp, choice, placement, model.objective(), model.replicated,
                  {name: len(opts) for name, opts in options.items()})


def _param_bytes(graph: fx.Graph, x: dict, tied: Iterable[list[str]], tp: int) -> list:
    """(variable or None, bytes one rank holds) for each parameter's placement choice;
    a tied parameter is counted once."""
    repeats = {name for group in tied for name in group[1:]}
    terms = []
    for node in graph.nodes:
        if node.op == "placeholder" and node.name in x and node.name not in repeats:
            full = tensor_bytes(node.meta["val"])
            terms += [(var, full / tp if split_dim(s.output) is not None else full)
                      for var, s in x[node.name]]
    return terms


def with_strided(graph: fx.Graph, param_options: dict[str, list[Placement]],
                 demand: dict[str, set[Strided]], tied: Iterable[list[str]],
                 tp: int) -> dict[str, list[Placement]]:
    """`param_options` with the Strided placements demanded of each parameter that fit
    it; tied parameters (one tensor under several names) get the union, in one order,
    as the program equates their choices option by option."""
    vals = {n.name: n.meta["val"] for n in graph.nodes if n.op == "placeholder"}
    groups = {name: [name] for name in param_options}
    for group in tied:
        for name in group:
            groups[name] = list(group)
    out = {}
    for name, places in param_options.items():
        extra = {p for member in groups[name] for p in demand.get(member, ())}
        out[name] = list(places) + sorted(p for p in extra if fits(vals[name], p, tp))
    return out


def _options(graph: fx.Graph, tp: int, param_options: dict[str, list[Placement]],
             costs: TPCosts, banned: dict[str, set[int]], wanted: dict[str, set[int]],
             demand: dict[str, set[Strided]]) -> dict[str, list[tuple[Strategy, float]]]:
    """node -> [(strategy, its own cost)] for every node whose output is a tensor (or tuple)."""
    out: dict[str, list[tuple[Strategy, float]]] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            places = param_options.get(node.name, [R])
            out[node.name] = [(Strategy((), p), costs.optimizer_update(val, p)
                               if node.name in param_options else 0.0) for p in places]
        elif node.op == "call_function" and node.target is not operator.getitem \
                and output_vals(node):
            offered = sorted(demand.get(node.name, ()))
            allowed = [s for s in strategies(node, tp, offered)
                       if not _splits_data(s, node, banned)]
            if any(p in wanted.get(node.name, ()) for s in allowed for p in s.outputs()):
                allowed = [s for s in allowed if any(p != R for p in s.outputs())]
            out[node.name] = [(s, costs.compute(node, s) + costs.lowering(s)) for s in allowed]
    return out


def _placement_expr(vars_: list, pick) -> dict[Placement, list]:
    expr: dict[Placement, list] = {}
    for var, s in vars_:
        expr.setdefault(pick(s), []).append(var)
    return expr


# The program's costs are in microseconds: in seconds, a GPU op's costs (1e-8 to 1e-5)
# sit at HiGHS's tolerances (an optimality gap of 1e-6 absolute is "optimal"), and it
# returned plans a few microseconds, several percent, off the optimum.
_MICRO = 1e6


class _Model:
    """The integer program, with constant folding for nodes that have one option. A
    variable is its column's index; the rows are kept as lists and handed to HiGHS in one
    call when it solves (highspy's expression objects cost more than the solve)."""

    def __init__(self) -> None:
        self.constant = 0.0
        self.replicated = 0.0  # the objective of the all-replicated plan
        self._cost: list[float] = []  # per column: its objective coefficient
        self._binary: list[int] = []  # the columns that are 0/1 choices
        self._rows: list[tuple[dict[int, float], float, float]] = []  # (terms, low, high)
        self._grad_vars: dict[str, int | None] = {}
        self._values: list[float] = []
        self._objective = 0.0

    def _var(self, cost: float, binary: bool = False) -> int:
        self._cost.append(cost * _MICRO)
        if binary:
            self._binary.append(len(self._cost) - 1)
        return len(self._cost) - 1

    def _row(self, terms: Iterable[tuple[int, float]], low: float, high: float) -> None:
        merged: dict[int, float] = {}
        for var, coef in terms:
            merged[var] = merged.get(var, 0.0) + coef
        self._rows.append((merged, low, high))

    def choose(self, name: str, opts: list[tuple[Strategy, float]]) -> list[tuple]:
        self.replicated += next((c for s, c in opts if all(p == R for p in s.outputs())),
                                opts[0][1])
        if len(opts) == 1:
            self.constant += opts[0][1]
            return [(None, opts[0][0])]
        vars_ = [self._var(cost, binary=True) for _, cost in opts]
        self._row(((v, 1.0) for v in vars_), 1.0, 1.0)
        return list(zip(vars_, (s for s, _ in opts)))

    def equal(self, a: int | None, b: int | None) -> None:
        if a is not None and b is not None:
            self._row(((a, 1.0), (b, -1.0)), 0.0, 0.0)

    def edge(self, have: dict, need: dict, price) -> None:
        """The redistribution of a value from the placement its producer gives (`have`:
        placement -> the producer's variables giving it, None for a fixed choice) to the
        one its user takes (`need`). With both sides chosen, by the pair's indicator
        z_pq, whose rows (sum_q z_pq = X_p, sum_p z_pq = Y_q) make z the product of the
        two choices already in the LP relaxation: the relaxation of `y >= X_p + Y_q - 1`
        is loose (a half of each choice pays nothing), and HiGHS then spends its cuts
        and a sub-MIP closing that gap."""
        prices = {(p, q): price(p, q) for p in have for q in need}
        if any(None in vs for vs in (*have.values(), *need.values())):
            for (p, q), cost in prices.items():
                if cost == 0.0:
                    continue
                const, live = _split(have[p] + need[q])
                if cost == INF:
                    self._at_most(const, live, 1)
                elif not live:  # both sides fixed (one option each): the pair is the plan's
                    self.constant += cost
                else:  # one side fixed: y >= the other side's choice, as tight as it gets
                    y = self._var(cost)
                    self._row([(y, 1.0)] + [(v, -1.0) for v in live], const - 1, math.inf)
            return
        if all(cost == 0.0 for cost in prices.values()):
            return
        z = {pq: self._var(cost) for pq, cost in prices.items() if cost != INF}
        for p, src_vars in have.items():
            self._row([(z[p, q], 1.0) for q in need if (p, q) in z] +
                      [(v, -1.0) for v in src_vars], 0.0, 0.0)
        for q, dst_vars in need.items():
            self._row([(z[p, q], 1.0) for p in have if (p, q) in z] +
                      [(v, -1.0) for v in dst_vars], 0.0, 0.0)

    def grad_allreduce(self, value: str, split_users: list, cost: float) -> None:
        """One all-reduce of `value`'s gradient if any of split_users is chosen."""
        if not split_users or cost == 0.0:
            return
        known = value in self._grad_vars
        z = self._grad_vars.get(value)
        if known and z is None:
            return  # already paid for unconditionally
        if any(v is None for v in split_users):
            self.constant += cost
            self._grad_vars[value] = None
            return
        if z is None:
            z = self._grad_vars[value] = self._var(cost)
        for v in split_users:
            self._row(((z, 1.0), (v, -1.0)), 0.0, math.inf)

    def budget(self, terms: list, limit: float) -> None:
        const = sum(b for v, b in terms if v is None)
        live = [(v, b) for v, b in terms if v is not None]
        if not live:
            return
        self._row(live, -math.inf, limit - const)

    def require(self, expr: dict, placement: Placement) -> None:
        for p, vars_ in expr.items():
            if p != placement:
                self._at_most(*_split(vars_), 0)

    def _at_most(self, const: int, live: list[int], bound: int) -> None:
        """const + the sum of the `live` variables <= bound."""
        if not live:
            if const > bound:
                raise _NoPlan("the only placements on both sides cannot be converted")
            return
        self._row(((v, 1.0) for v in live), -math.inf, bound - const)

    def solve(self, tp: int) -> None:
        if not self._cost:
            return
        h = new_model()
        n = len(self._cost)
        h.addCols(n, np.array(self._cost), np.zeros(n), np.ones(n), 0,
                  np.zeros(n, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
        h.changeColsIntegrality(len(self._binary), np.array(self._binary, dtype=np.int32),
                                np.full(len(self._binary), highspy.HighsVarType.kInteger))
        starts, index, value = [], [], []
        for terms, _, _ in self._rows:
            starts.append(len(index))
            index += terms
            value += terms.values()
        h.addRows(len(self._rows), np.array([low for _, low, _ in self._rows]),
                  np.array([high for _, _, high in self._rows]), len(index),
                  np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
                  np.array(value))
        h.run()
        status = h.getModelStatus()
        if status != highspy.HighsModelStatus.kOptimal:
            ended = h.modelStatusToString(status)
            raise TensorParallelPlanError(
                None, tp, f"the placement program (HiGHS) ended {ended}: the ops' "
                "strategies admit no consistent set of placements")
        self._values = list(h.getSolution().col_value)
        self._objective = h.getInfo().objective_function_value / _MICRO

    def chosen(self, vars_: list[tuple]) -> Strategy:
        if vars_[0][0] is None:
            return vars_[0][1]
        return max(vars_, key=lambda vs: self._values[vs[0]])[1]

    def objective(self) -> float:
        return self.constant + self._objective


class _NoPlan(ValueError):
    """A constraint between fixed placements that cannot hold (raised while building)."""


class TensorParallelPlanError(ValueError):
    """No placement of the step's tensors over the tp ranks satisfies every op: the
    message names the op (module and source line) where the constraints meet, and what
    the user can do."""

    def __init__(self, node: fx.Node | None, tp: int, why: str):
        where, rewrite = "the step", ""
        if node is not None:
            path, _ = module_of(node)
            line = source_of(node) or "an unknown source line"
            where = f"{node.target} (node {node.name}) at {line}" + \
                (f" in module `{path}`" if path else "")
            rewrite = ", or write that line with another op"
        super().__init__(
            f"tensor parallelism (tp={tp}) found no valid placement for {where}: {why}. Train "
            f"this model with Layout(tp=1) (dp, pp and ZeRO need no placement){rewrite}; "
            f"please report the model")


def _split(vars_: list) -> tuple[int, list[int]]:
    """(how many of vars_ are None, a choice fixed to 1; the others, variables)."""
    return sum(1 for v in vars_ if v is None), [v for v in vars_ if v is not None]
