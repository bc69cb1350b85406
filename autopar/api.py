"""autopar.compile and autopar.trace: the entry points of the public contract.

Environment variables are read here and nowhere deeper: AUTOPAR_DUMP (a directory:
the IR after each pass), AUTOPAR_LOGS (see autopar.logs).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopar.cluster import ClusterSpec, ClusterSpecError
from autopar.compiler.analysis.memory import profile_optimizer
from autopar.compiler.ir.batch import Batch, BatchError, LossFn, Objective
from autopar.compiler.ir.collectives import check_collectives, program_collectives
from autopar.compiler.ir.graph import TrainGraph
from autopar.compiler.ir.schedule import ScheduleError
from autopar.compiler.ir.trace import TraceError, local_example, trace_source, trace_train_step
from autopar.compiler.lowering.lower import to_program
from autopar.compiler.lowering.lower_pipeline import lower_pipeline
from autopar.compiler.lowering.lower_ps import split_for_ps
from autopar.compiler.passes.amp_policy import parse_amp_lists
from autopar.compiler.passes.assign_stages import StageError
from autopar.compiler.passes.base import GraphPass, PassOptions
from autopar.compiler.passes.batch_split import BatchSplitError
from autopar.compiler.passes.defaults import first_graph, is_pipelined, pass_list, run_passes
from autopar.compiler.passes.recompute_rules import RecomputeError
from autopar.compiler.passes.sync_batch_norm import training_batch_norms, where
from autopar.compiler.passes.tp_solver import TensorParallelPlanError
from autopar.compiler.planner.ps_cost import compare_ps
from autopar.compiler.planner.result import Plan
from autopar.compiler.planner.search import PlanError
from autopar.costs import dp_node_split
from autopar.layout import Layout, LayoutError
from autopar.logs import configure_from_env
from autopar.runtime import ps as ps_runtime
from autopar.runtime.dgc import DGCPipelineStep, DGCStep
from autopar.runtime.dgc import check_optimizer as check_dgc_optimizer
from autopar.runtime.executor import DistributedStep, OptimizerFactory
from autopar.runtime.local_sgd import LocalSGDPipelineStep, LocalSGDStep
from autopar.runtime.mesh import launched_rank, launched_world_size
from autopar.runtime.pipeline import PipelineStep
from autopar.runtime.ps import PSServer, PSTrainer

log = logging.getLogger("autopar")

# What compile (and estimate, check, plan) raise for a layout the model or the cluster
# cannot take: its values, the cluster, the batch's split, the stage cut, the
# tensor-parallel placement, the schedule, the recomputation rules, and a plan that
# finds none. Each names what the user controls, so the CLI and the per-rank workers
# report it as a message, not a traceback; any other error is a bug and keeps its
# traceback.
LAYOUT_ERRORS = (LayoutError, ClusterSpecError, BatchError, ScheduleError, TraceError,
                 StageError, RecomputeError, TensorParallelPlanError, PlanError, BatchSplitError)


def _default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def trace(model: torch.nn.Module, example_inputs: Batch,
          loss_fn: LossFn | None = None, example_targets: Batch | None = None) -> TrainGraph:
    """The joint forward + loss + backward graph of one step on the example batch."""
    objective, flat = Objective.from_example(example_inputs, example_targets, loss_fn)
    return trace_train_step(model, flat, objective)


def compile(model: torch.nn.Module,
            cluster: ClusterSpec | None = None,
            example_inputs: Batch = (), loss_fn: LossFn | None = None,
            optimizer: OptimizerFactory = _default_optimizer, layout: Layout | Plan | None = None,
            passes: Sequence[GraphPass | str] | None = None,
            amp_lists: dict[str, Sequence[str]] | None = None,
            example_targets: Batch | None = None,
            pass_options: dict[str, Any] | None = None) -> DistributedStep | PipelineStep:
    """Compile one training step of `model` for this job's processes and return it.

    `example_inputs` is what the model takes of one global batch: a tuple of tensors
    (`model(*inputs)`), one tensor, or a dict (`model(**inputs)`); `example_targets`
    what only the loss takes (`loss_fn(output, *targets)`); without targets the loss
    takes the output and the inputs. The step is called with the batch as the model
    is, targets after inputs: `step(x, y)`, `step(**batch)` (compiler/ir/batch.py).
    Every rank passes the same global batch; the step takes its slice. `layout=None`
    plans it: `autopar.plan` on `cluster` (default
    `ClusterSpec.local` of this job's processes), which must have this job's world
    size; every rank plans the same layout (the plan is a pure function of the traced
    graph and the cluster), and the plan is on `step.plan`. `passes` replaces the default
    pass list (`autopar.default_passes(layout)`) with your own list of passes or
    registered pass names. `amp_lists={"white": [...], "black": [...], "gray": [...]}`
    moves aten ops ("mm" or "aten.mm") between AMP's lists (with Layout.amp on).
    `pass_options` sets fields of the passes' options (`autopar.PassOptions`) for a
    given layout, e.g. {"pipeline_cuts": ["transformer.h.2.mlp"]}: where pipeline
    stages start, at a block or a module inside one. A Plan's own `pass_options` (what
    it costed the layout with) apply under them.
    """
    if pass_options and layout is None:
        raise ValueError("pass_options set how the passes rewrite a given layout; pass "
                         "layout= too (the planner costs its candidates with the default "
                         "options)")
    own = sorted(set(pass_options or ()) & {"tp_rank", "dp_rank", "optimizer_memory",
                                             "amp_lists"})
    if own:
        raise ValueError(f"pass_options {own} are set by compile itself (each rank's "
                         f"coordinates, the optimizer you pass, amp_lists=)")
    configure_from_env()
    world = launched_world_size()
    objective, example_inputs = Objective.from_example(example_inputs, example_targets, loss_fn)
    if example_inputs:  # a batch that does not fit forward fails before planning
        objective.check_signatures(model)
    plan = layout if isinstance(layout, Plan) else None
    if layout is None:
        plan = _plan_for_job(model, cluster, example_inputs, objective, optimizer, world)
    layout = plan.layout if plan is not None else layout
    if plan is not None and plan.pass_options:  # what the plan costed; the caller's win
        pass_options = {**plan.pass_options, **(pass_options or {})}
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be an autopar.Layout or Plan, got {type(layout).__name__}")
    layout.check_world_size(world)
    if layout.ps is not None:
        return build_ps(model, cluster, example_inputs, objective, optimizer, layout)
    step = build_step(model, cluster, example_inputs, objective, optimizer, layout, passes,
                      amp_lists, pass_options=pass_options)
    step.plan = plan  # the Plan it came from (layout=None or a Plan), else None
    return step


def build_step(model: torch.nn.Module, cluster: ClusterSpec | None, example_inputs: tuple,
               objective: Objective, optimizer: OptimizerFactory, layout: Layout,
               passes: Sequence[GraphPass | str] | None = None,
               amp_lists: dict[str, Sequence[str]] | None = None,
               record_rewrites: bool = False,
               pass_options: dict[str, Any] | None = None) -> DistributedStep | PipelineStep:
    """The step of `compile` for a given layout and flat example batch: trace, rewrite
    (`record_rewrites`: mark what each pass changed, for autopar.bisect), lower, bind to
    this rank, and check every rank's collectives against its peers'. `pass_options`:
    more PassOptions fields (e.g. {"hierarchy_form": "shards"})."""
    parse_amp_lists(amp_lists)  # a misspelt op fails before the (slow) trace
    if layout.dgc is not None:  # and an optimizer DGC cannot correct
        check_dgc_optimizer(optimizer([torch.nn.Parameter(torch.zeros(1))]))
    if not example_inputs:
        raise ValueError("compile needs example_inputs: one global batch, as passed to the step")
    local = local_example(example_inputs, layout)
    # Local SGD and DGC: this is their warm-up's program, gradients summed every step
    synchronous = layout.synchronous()
    tg = first_graph(trace_source(model, local, objective, whole=example_inputs),
                     pass_list(synchronous, passes))
    options = PassOptions(
        # each rank's program holds its own blocks (tp is the inner mesh dim), and with
        # ZeRO-2/3 its block of each gathered embedding table
        tp_rank=_rank_options(launched_rank(), layout)[0],
        dp_rank=_rank_options(launched_rank(), layout)[1],
        # what the user's optimizer holds, for recompute="auto"'s memory budget and the
        # bytes a pipeline stage's parameters weigh in its cut
        optimizer_memory=profile_optimizer(optimizer)
        if layout.recompute == "auto" or layout.pp > 1 else "adamw",
        amp_lists=amp_lists or None, **(pass_options or {}))
    traced = tg
    tg, results = run_passes(tg, synchronous, cluster, passes, options=options,
                             dump_dir=os.environ.get("AUTOPAR_DUMP"),
                             record_rewrites=record_rewrites)
    if layout.amp != "off" and "amp" not in tg.provides:
        raise LayoutError(f"Layout.amp={layout.amp!r} but the passes given to compile have no "
                          "'amp' pass: add \"amp\" first in passes=, or use amp='off'")
    for r in results:
        log.info("%s", r.summary())
    if is_pipelined(layout) and layout.dgc is not None:
        step = DGCPipelineStep(lower_pipeline(tg, layout), model, optimizer,
                               objective=objective, sparsity=layout.dgc,
                               warmup=layout.dgc_warmup, rampup=layout.dgc_rampup,
                               clip=layout.dgc_clip, topk=layout.dgc_topk)
    elif is_pipelined(layout) and layout.local_sgd is not None:
        step = LocalSGDPipelineStep(lower_pipeline(tg, layout), model, optimizer,
                                    objective=objective, period=layout.local_sgd,
                                    warmup=layout.local_sgd_warmup,
                                    adaptive=layout.local_sgd_adaptive,
                                    overlap=layout.local_sgd_overlap,
                                    **_pipeline_levels(layout, cluster, options))
    elif is_pipelined(layout):
        step = PipelineStep(lower_pipeline(tg, layout), model, optimizer, objective=objective,
                            **_pipeline_levels(layout, cluster, options))
    elif layout.dgc is not None:
        own = _local_program(traced, layout, cluster, passes, options)
        _check_collectives_across_ranks(own)
        step = DGCStep(to_program(tg, layout), own, model, optimizer, objective=objective,
                       sparsity=layout.dgc, warmup=layout.dgc_warmup, rampup=layout.dgc_rampup,
                       clip=layout.dgc_clip, topk=layout.dgc_topk)
    elif layout.local_sgd is not None:
        local = _local_program(traced, layout, cluster, passes, options)
        _check_collectives_across_ranks(local)
        levels = _pipeline_levels(layout, cluster, options)
        step = LocalSGDStep(to_program(tg, layout), local, model, optimizer, objective=objective,
                            period=layout.local_sgd, warmup=layout.local_sgd_warmup,
                            adaptive=layout.local_sgd_adaptive,
                            hierarchy_form=levels.get("hierarchy_form", "leaders"),
                            overlap=layout.local_sgd_overlap)
    else:
        step = DistributedStep(to_program(tg, layout), model, optimizer, objective=objective)
    _check_collectives_across_ranks(step.program)
    step.pass_results = results
    step.train_graph = tg  # the rewritten graph the step runs (to inspect, or cost)
    return step


def build_ps(model: torch.nn.Module, cluster: ClusterSpec | None, example_inputs: tuple,
             objective: Objective, optimizer: OptimizerFactory,
             layout: Layout) -> PSServer | PSTrainer:
    """This rank's part of a parameter-server job (runtime/ps.py): the first
    `layout.ps.servers` ranks serve the tables, the others train. Both carry
    `comparison`: the tables' traffic priced against all-reducing their gradients."""
    ps = layout.ps
    if not example_inputs:
        raise ValueError("compile needs example_inputs: one global batch, as passed to the step")
    local = local_example(example_inputs, layout)
    if any(p.is_meta for p in model.parameters()):
        # tables on the meta device exist only on the servers (which make their rows):
        # trace a meta copy, as the planner traces meta models; the graph runs on CPU
        meta = lambda xs: tuple(x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
                                for x in xs)
        traced = trace_train_step(copy.deepcopy(model).to("meta"), meta(local), objective,
                                  whole=meta(example_inputs))
    else:
        traced = trace_train_step(model, local, objective, whole=example_inputs)
    if ps.mode == "sync" and layout.dp > 1:
        norms = training_batch_norms(traced)
        if norms:  # the trainers have no group to sum a forward's statistics over
            raise LayoutError(f"{where(norms[0])}: a batch norm in training mode normalises "
                              f"by the whole batch's statistics, and the {layout.dp} "
                              f"parameter-server trainers of a sync step each hold a shard "
                              f"of it; train this model with a dp layout (which sums them), "
                              f"or put the module in eval mode")
        # a loss that divides by a count of the batch (ignore_index, a mask's sum)
        # divides by the global batch's count, as one process on the whole batch does
        traced = run_passes(traced, layout, None, ["global_loss_mean"])[0]
    program = split_for_ps(traced, ps.tables)
    on_meta = [e.name for e in program.dense if dict(model.named_parameters())[e.name].is_meta]
    if on_meta:
        raise ValueError(f"parameters {on_meta} are on the meta device, but they are not "
                         f"parameter-server tables: only tables may be (the servers make "
                         f"their rows); build the rest of the model on the CPU")
    for table in program.tables:
        if ps.servers > table.rows:
            raise LayoutError(f"Layout.ps.servers={ps.servers} is more than the {table.rows} "
                              f"rows of table {table.name!r}: a server would hold no row; use "
                              f"at most {table.rows} servers")
    if ps.mode == "geo":
        ps_runtime.geo_learning_rate(optimizer)
    else:
        ps_runtime.table_optimizer(optimizer)  # an optimizer the servers lack fails here
    comparison = compare_ps(program, _unique_per_pull(program, model, local), layout,
                            cluster or ClusterSpec.local(layout.world_size))
    log.info("parameter servers: %s", comparison)
    token = ps_runtime.job_token()
    world, rank = layout.world_size, launched_rank()
    trainers = range(ps.servers, world)
    group = None
    if ps.dense_policy == "allreduce" and layout.dp > 1:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        group = dist.new_group(list(trainers))
    named = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    if rank < ps.servers:
        dense = [(e.name, named[e.name]) for i, e in enumerate(program.dense)
                 if ps.dense_policy == "servers" and i % ps.servers == rank]
        init = [None if named[t.name].is_meta else named[t.name] for t in program.tables]
        server = PSServer(rank, ps, layout.dp, program.tables, init, dense, optimizer, token)
        server.transport_factory = lambda: ps_runtime.RpcTransport(
            ps_runtime.server_name(rank), rank, world, token)
        server.program, server.comparison = program, comparison
        return server
    transport = ps_runtime.RpcTransport(ps_runtime.trainer_name(rank - ps.servers), rank,
                                        world, token)
    trainer = PSTrainer(program, ps, rank - ps.servers, layout.dp, named, buffers, optimizer,
                        transport, group)
    trainer.objective, trainer.comparison = objective, comparison
    return trainer


def _unique_per_pull(program, model: torch.nn.Module, local: tuple) -> list[int]:
    """Distinct ids of each pull on one trainer's example batch: the program run once
    with zero rows for every pull; it returns each pull's ids (then -1s)."""
    from autopar.compiler.ir import ps_ops

    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def value(entry) -> torch.Tensor:
        t = named[entry.name]
        return torch.zeros(entry.shape, dtype=entry.dtype) if t.is_meta else t.detach()

    ps_ops.bind_reader(lambda table, ids: torch.zeros(ids.numel(), program.tables[table].dim,
                                                      dtype=program.tables[table].dtype))
    norms = [torch.ones((), dtype=n.dtype) for n in program.normalizers]  # ids ignore them
    try:
        with torch.no_grad():
            outs = program.gm(*[value(e) for e in program.dense],
                              *[value(b) for b in program.buffers], *local, *norms)
    finally:
        ps_ops.bind_reader(None)
    first = 1 + len(program.dense)
    return [int((outs[first + 2 * k + 1] >= 0).sum()) for k in range(len(program.pulls))]


def _pipeline_levels(layout: Layout, cluster: ClusterSpec | None,
                     options: PassOptions) -> dict[str, Any]:
    """PipelineStep's node split and form for Layout.allreduce="hierarchical" (the
    pipeline runtime sums the gradients after the schedule, outside the graph; Local
    SGD's average takes the same form)."""
    if layout.allreduce != "hierarchical":
        return {}
    if cluster is None:
        raise LayoutError("Layout.allreduce='hierarchical' sums inside each node first and "
                          "needs the cluster's devices per node: pass "
                          "cluster=ClusterSpec(...) to compile")
    form = options.hierarchy_form
    if form == "auto":
        form = "shards" if cluster.backend == "nccl" else "leaders"
    return {"node_split": dp_node_split(layout, cluster)[0], "hierarchy_form": form}


def _local_program(traced: TrainGraph, layout: Layout, cluster: ClusterSpec | None,
                   passes: Sequence[GraphPass | str] | None, options: PassOptions):
    """The program of Local SGD's steps after its warm-up (default_passes of a
    Layout.local_sgd: this rank's own gradients of its share's mean loss), or of DGC's
    compressed steps (of a Layout.dgc: this rank's share of the global loss's
    gradients); nothing summed over dp, tensor parallelism's collectives stay
    (runtime/local_sgd.py, runtime/dgc.py)."""
    tg, _ = run_passes(traced, layout, cluster, passes, options=options)
    return to_program(tg, layout)


def check(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor] | Batch,
          loss_fn: LossFn | None = None, layout: Layout | None = None,
          cluster: ClusterSpec | None = None, example_targets: Sequence | None = None,
          passes: Sequence[GraphPass | str] | None = None) -> int:
    """Build every rank's program of `layout` in this process (no process is launched)
    and check that the ranks of each group run the same collectives in the same order,
    with the same shapes and dtypes (compiler/ir/collectives.py). Returns how many
    collectives were compared; raises CollectiveMismatch naming the rank, the node and
    the two operations at the first difference. `compile` runs the same check across
    the launched ranks. Ranks whose passes read the same options (tensor-parallel rank,
    ZeRO's data-parallel rank) build the same program, so each is built once."""
    layout = layout or Layout()
    objective, example_inputs = Objective.from_example(example_inputs, example_targets, loss_fn)
    if not example_inputs:
        raise ValueError("check needs example_inputs: one global batch, as passed to the step")
    tg = first_graph(trace_source(model, local_example(example_inputs, layout), objective,
                                  whole=example_inputs), pass_list(layout, passes))
    built: dict[tuple[int, int], dict] = {}
    by_rank = {}
    for rank in range(layout.world_size):
        options = _rank_options(rank, layout)
        if options not in built:
            out, _ = run_passes(tg, layout, cluster, passes, options=PassOptions(
                tp_rank=options[0], dp_rank=options[1]))
            program = lower_pipeline(out, layout) if is_pipelined(layout) else \
                to_program(out, layout)
            built[options] = (program.mesh, program_collectives(program),
                              getattr(program, "node_split", 1))
        by_rank[rank] = built[options][1]
    first = built[_rank_options(0, layout)]
    return check_collectives(by_rank, first[0], first[2])


def _rank_options(rank: int, layout: Layout) -> tuple[int, int]:
    """(tp_rank, dp_rank) the passes read for `rank`, as `compile` gives them: the dp rank
    only where programs differ by it (ZeRO-2/3's blocks, a hierarchical all-reduce's
    node leaders)."""
    reads_dp = layout.zero >= 2 or layout.allreduce == "hierarchical"
    dp_rank = rank // layout.tp % layout.dp if reads_dp else 0  # mesh (pp, dp, tp)
    return rank % layout.tp, dp_rank


def _check_collectives_across_ranks(program) -> None:
    """Every rank's collectives against its groups' peers (ir/collectives.py), before any
    step runs: one all_gather_object of each rank's list; CollectiveMismatch, on every
    rank alike, names the first difference."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = program_collectives(program)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    check_collectives(dict(enumerate(everyone)), program.mesh, getattr(program, "node_split", 1))


def _plan_for_job(model, cluster, example_inputs: tuple, loss_fn, optimizer,
                  world: int) -> Plan:
    """autopar.plan for `compile(layout=None)` on this job's processes."""
    from autopar.compiler.planner.plan import plan

    if not example_inputs:
        raise ValueError("compile needs example_inputs: one global batch, as passed to the step")
    if cluster is None:
        cluster = ClusterSpec.local(nprocs=world)
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"layout=None plans the layout, which needs cluster to be an "
                        f"autopar.ClusterSpec (or None for this machine), got "
                        f"{type(cluster).__name__}")
    if cluster.world_size != world:
        raise LayoutError(f"layout=None plans for the cluster, but cluster {cluster.name!r} has "
                          f"{cluster.world_size} devices and this job has {world} processes: "
                          f"launch {cluster.world_size} processes, or pass a cluster of {world} "
                          f"devices (e.g. ClusterSpec.local(nprocs={world}))")
    kind = optimizer_kind(optimizer)
    chosen = plan(model, cluster, example_inputs, loss_fn, optimizer=kind)
    log.info("planned %s on %s: predicted %.3g s per step (%s optimizer), %d layouts costed",
             chosen.layout, cluster.describe(), chosen.predicted.step_time_s, kind,
             len(chosen.alternatives) + 1)
    return chosen


def optimizer_kind(factory: OptimizerFactory) -> str:
    """The cost model's name of the optimizer a factory builds ("adamw", "adam",
    "sgd-momentum", "sgd"; "-fused" where it was built with fused=True). Another
    optimizer is refused: its memory and step time would be guessed."""
    opt = factory([torch.nn.Parameter(torch.zeros(1))])
    fused = "-fused" if opt.defaults.get("fused") else ""
    if isinstance(opt, torch.optim.AdamW):
        return "adamw" + fused
    if isinstance(opt, torch.optim.Adam):
        return "adam" + fused
    if isinstance(opt, torch.optim.SGD):
        return ("sgd-momentum" if opt.defaults.get("momentum") else "sgd") + fused
    raise ValueError(f"layout=None plans the layout with the cost model, which knows AdamW, "
                     f"Adam and SGD; the optimizer factory built {type(opt).__name__}: pass a "
                     "layout= (or a Plan from autopar.plan(..., optimizer=...)) instead")
