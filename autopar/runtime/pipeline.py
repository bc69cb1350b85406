"""Run a pipelined (and/or micro-batched) program: one rank's stages, by the schedule.

Each rank executes exactly its action list of the Schedule IR (compiler/ir/schedule.py):
F and B run a stage's forward / backward GraphModule on one micro-batch, SF/SB send
the values later (earlier) stages need, RF/RB receive them. Values are keyed by the
joint graph's node names. Sends are asynchronous (`isend`); receives block, which the
schedule's static check proves deadlock-free. A send's tensor is let go of after the
first receive that proves its receiver has it (`schedule.send_releases`: waiting for
it then returns at once), not at the end of the step: a rank holds a few send buffers,
not one per micro-batch.

A stage's backward adds its gradient parts into their sums in place from the second
micro-batch on (`pipeline_program.accumulating`), each as soon as it is made, as autograd
adds into `.grad`. A program is called boxed (`pipeline_program.boxed`) with the values
of the micro-batch's environment it reads last given up (`dying_inputs`), so it frees
each saved activation after its last use, as autograd frees a saved tensor once the
node reading it has run. After the last action: gradients (summed over micro-batches; the backward seed is
already scaled by 1/(microbatches*dp)) are summed over data-parallel ranks, each
parameter's gradient parts are summed over the pipeline ranks that read it (a tied
embedding has one part per stage that uses it, accumulated locally), and every
such rank updates its own copy with the same gradient.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.compiler.ir.batch import BatchError, Objective, normalizer_means
from autopar.compiler.ir.pipeline_program import (
    PipelineProgram,
    StageProgram,
    accumulating,
    boxed,
)
from autopar.compiler.ir.program import TensorEntry, bind_groups, runnable
from autopar.runtime.loss_scaler import LossScaler
from autopar.runtime.mesh import Mesh, build_mesh, new_group
from autopar.runtime.shards import (
    block_of,
    gather_into,
    gathered,
    own_block,
    whole,
    zero_block,
)
from autopar.runtime.training_state import HeldParam, TrainingState


class PipelineStep(TrainingState):
    """The compiled step for pp > 1 or microbatches > 1 (same interface as DistributedStep)."""

    def __init__(self, program: PipelineProgram, model: torch.nn.Module,
                 optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                 *, mesh: Mesh | None = None, objective: Objective | None = None,
                 node_split: int = 1, hierarchy_form: str = "leaders"):
        """`node_split` > 1: Layout.allreduce="hierarchical", that many ranks of a dp
        group on each node (costs.dp_node_split); `hierarchy_form`: "leaders" (reduce to
        the node's first rank, all-reduce among those, broadcast: gloo) or "shards"
        (reduce-scatter, all-reduce of each shard, all-gather: NCCL)."""
        self.program = program
        self.node_split, self.hierarchy_form = node_split, hierarchy_form
        # how a call's arguments make the flat batch (default: the tensors positionally)
        self.objective = objective or Objective(
            None, len(program.inputs) - program.loss_scaled - len(program.normalizers))
        self.mesh = mesh or build_mesh(program.mesh, node_split)
        self.mesh.split_dp(node_split)  # a mesh passed in: its two levels, if needed
        self.pp, self.dp = dict(program.mesh)["pp"], dict(program.mesh)["dp"]
        self.tp = dict(program.mesh).get("tp", 1)
        self.pp_rank, self.dp_rank = self.mesh.rank_in("pp"), self.mesh.rank_in("dp")
        self.my_stages = [self._bound(p) for p in program.stages
                          if p.stage % self.pp == self.pp_rank]
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
        self._whole = self._whole_of(model, program)  # for checkpoints, before blocks are cut
        entries = program.params + program.buffers
        self.tensor_of = {key: named[e.name] for key, e in zip(program.keys, entries)}
        self.param_key = {e.name: key for key, e in zip(program.keys, program.params)}
        self.part_keys = {k for parts in program.grad_parts for k in parts}
        # every rank that reads a parameter updates its own copy with the summed gradient
        self.held = [(e, parts) for e, parts in zip(program.params, program.grad_parts)
                     if self.pp_rank in self._ranks_reading(e, parts)]
        self._model = model
        self._groups = self._shared_groups()
        self._sync_initial_weights()
        for key, entry in zip(program.keys, program.params):  # tensor parallelism: blocks
            self.tensor_of[key] = own_block(self.tensor_of[key], entry, self.mesh.rank_in("tp"),
                                          self.tp)
        # ZeRO-1/2: the optimizer updates this rank's dim-0 block of each parameter (its
        # state is 1/dp), then the blocks are gathered back (as DistributedStep does)
        self.zero = int(program.layout.get("zero", 0))
        self.params = [self.tensor_of[self.param_key[e.name]] for e, _ in self.held]
        self.updated = ([zero_block(p, self.dp, self.dp_rank) for p in self.params] if self.zero
                        else self.params)
        # ZeRO-3: between steps a rank holds only its blocks; each step gathers the whole
        # parameters of its stages before the schedule and drops them after it
        self.rows = [p.shape[0] if p.dim() else 0 for p in self.params]
        self._release_params()
        self.optimizer = optimizer(self.updated)
        self.steps = 0
        self.pass_results: list = []
        self.loss_scaler = LossScaler() if program.loss_scaled else None
        wire = program.layout.get("grad_comm_dtype")
        self._wire_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(wire)
        self._releases = program.send_releases(self.pp_rank)
        self._accumulators: dict[tuple[int, str], tuple] = {}  # (stage, kind) -> accumulating
        self._read = program.values_read()
        # action index -> the inputs its program reads last (freed inside it), and the
        # boxed copy of each module run (pipeline_program.boxed)
        self._dying = program.dying_inputs(self.pp_rank)
        self._boxed: dict[fx.GraphModule, fx.GraphModule] = {}
        # whether the gradients are summed over dp after the schedule: Local SGD's local
        # steps and DGC's compressed ones turn it off (runtime/local_sgd.py, dgc.py)
        self.sum_over_dp = True
        # runs each stage program instead of calling it: (gm, args, schedule action) ->
        # outputs; autopar.bisect records every value of every micro-batch through it
        self.run_graph: Callable | None = None

    def _bound(self, stage: StageProgram) -> StageProgram:
        """The stage's programs with their collectives (tensor parallelism's) bound to this
        rank's process groups."""
        if not self.mesh.group_names:
            return stage
        bind = lambda gm: bind_groups(gm, self.mesh.group_names)  # noqa: E731
        split = {k: (bind(v[0]),) + tuple(v[1:]) for k, v in
                 (("input_grad", stage.input_grad), ("weight_grad", stage.weight_grad)) if v}
        return dataclasses.replace(stage, forward=bind(stage.forward),
                                   backward=bind(stage.backward), **split)

    def _ranks_reading(self, entry: TensorEntry, parts: tuple[str, ...]) -> list[int]:
        stages = self.program.stages_reading(self.param_key[entry.name], parts)
        return sorted({s % self.pp for s in stages})

    # -- process groups ----------------------------------------------------------------------

    def _global_rank(self, pp_rank: int) -> int:
        return self.mesh.global_rank(pp=pp_rank)

    def _shared_groups(self) -> dict[str, object]:
        """A process group per parameter that several pipeline ranks read (created by
        every rank, in the same order, as torch.distributed requires)."""
        groups = {}
        if self.pp == 1:
            return groups
        for entry, parts in zip(self.program.params, self.program.grad_parts):
            ranks = self._ranks_reading(entry, parts)
            if len(ranks) < 2:
                continue
            for d in range(self.dp):
                for t in range(self.tp):
                    group = new_group([self.mesh.global_rank(dp=d, pp=r, tp=t)
                                       for r in ranks])
                    if (d, t) == (self.dp_rank, self.mesh.rank_in("tp")) and self.pp_rank in ranks:
                        groups[entry.name] = group
        return groups

    def _sync_initial_weights(self) -> None:
        """Every data-parallel replica and tensor-parallel peer starts from the weights of
        replica 0 / peer 0 (as DDP does), before tensor parallelism takes its blocks."""
        for dim, size in (("dp", self.dp), ("tp", self.tp)):
            if size == 1:
                continue
            src = self.mesh.global_rank(**{dim: 0})
            with torch.no_grad():
                for e in [e for e, _ in self.held] + list(self.program.buffers):
                    key = self.param_key.get(e.name)
                    tensor = self.tensor_of[key] if key else dict(self._model.named_buffers())[e.name]
                    dist.broadcast(tensor.data, src=src, group=self.mesh.group(dim))

    # -- the step ------------------------------------------------------------------------------

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """One step on a global batch, passed as the example batch was (see Objective)."""
        flat = self.objective.flatten(args, kwargs)
        self._check_batch(flat)  # before the loss's counts read it in the compiled shape
        micro = self._micro_batches(self._with_counts(flat))
        self._gather_params()
        if self.loss_scaler is not None:  # the step's trailing input: the loss scale
            scale = self.loss_scaler.scale_input()
            micro = [inputs + [scale] for inputs in micro]
        envs: dict[int, dict[str, torch.Tensor]] = {}
        grads: dict[str, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        sends: dict[int, list] = {}  # send action's index -> its requests and tensors
        by_stage = {p.stage: p for p in self.my_stages}
        actions = self.program.schedule.ranks[self.pp_rank]
        last_use = {a.microbatch: i for i, a in enumerate(actions)}
        spans = []
        start = time.perf_counter()
        with torch.no_grad():
            for i, action in enumerate(actions):
                stage = by_stage[action.stage]
                env = envs.setdefault(action.microbatch, self._inputs_env(micro[action.microbatch]))
                begin = time.perf_counter()
                self._do(action, stage, env, grads, losses, sends.setdefault(i, []),
                         self._dying.get(i, ()))
                for j in self._releases.get(i, ()):  # received: the wait returns at once
                    for request, _tensor in sends.pop(j, ()):
                        request.wait()
                if action.kind in ("F", "B", "I", "W"):
                    spans.append((action, begin - start, time.perf_counter() - start))
                if last_use[action.microbatch] == i:
                    # its activations are no longer needed here: emptied, not only let go
                    # of, since the loop's `env` still names the last micro-batch's
                    # through the gradient sums and the optimizer step
                    envs.pop(action.microbatch).clear()
            for request, _tensor in (r for rs in sends.values() for r in rs):
                request.wait()  # the tensor stays alive until its send is done
            # measured compute spans of the schedule (compared with its simulation by
            # benchmarks/pp_vs_pipelining.py)
            self.last_timeline = (spans, time.perf_counter() - start)
            loss = self._finish_loss(losses)
            synced = self._sync_grads(grads)
            self._release_params()
            self._apply(synced)
            if self.loss_scaler is not None:
                self.loss_scaler.update()
        self.steps += 1
        return loss

    def _do(self, action, stage, env, grads, losses, sends, dying=()) -> None:
        kind, mb = action.kind, action.microbatch
        if kind == "F":
            self._run(stage.forward, stage.f_inputs, stage.f_outputs, env, action, dying=dying)
            if self.program.loss_key in stage.f_outputs:
                losses.append(env[self.program.loss_key])
        elif kind in ("B", "I", "W"):
            gm, inputs, outputs = stage.program(kind)
            parts = [k for k in outputs if k in self.part_keys]
            if parts and self.run_graph is None and all(k in grads for k in parts):
                # the program adds its parts into their sums itself, each as soon as it
                # is made (autopar.bisect records the parts themselves: the plain program)
                gm, sums, outputs = self._accumulating(stage.stage, kind, gm, outputs)
                self._run(gm, inputs, outputs, env, action, [grads[k] for k in sums], dying)
                return
            self._run(gm, inputs, outputs, env, action, dying=dying)
            made = [(k, env[k] if k in self._read else env.pop(k)) for k in parts]
            shared = _storages([*env.values(), *grads.values()]) if made else set()
            for grad_key, value in made:
                if grad_key in grads:
                    grads[grad_key] = grads[grad_key] + value
                    continue
                # the part becomes its sum, which later micro-batches add into in place:
                # copied where its storage is shared with a value of the micro-batch or
                # another sum (a part that views an activation, two parts one tensor)
                storage = value.untyped_storage().data_ptr()
                grads[grad_key] = value.clone() if storage in shared else value
                shared.add(storage)
        elif kind in ("SF", "SB"):
            table = stage.send_forward if kind == "SF" else stage.send_backward
            for dst, keys in sorted(table.items()):
                if dst % self.pp == self.pp_rank:
                    continue  # a later stage on this rank (interleaved) reads the same env
                for i, key in enumerate(keys):
                    tensor = env[key].contiguous()
                    sends.append((dist.isend(tensor, self._global_rank(dst % self.pp),
                                             tag=self._tag(stage.stage, dst, mb, i)), tensor))
        elif kind in ("RF", "RB"):
            sources = self.program.receives(stage.stage, "forward" if kind == "RF" else "backward")
            for src, keys in sorted(sources.items()):
                if src % self.pp == self.pp_rank:
                    continue
                for i, key in enumerate(keys):
                    spec = self.program.values[key]
                    buffer = torch.empty(spec.shape, dtype=spec.dtype)
                    dist.recv(buffer, self._global_rank(src % self.pp), tag=self._tag(src, stage.stage, mb, i))
                    env[key] = buffer
        else:
            raise ValueError(f"unknown schedule action kind {kind!r} in {action}")

    def _tag(self, src: int, dst: int, mb: int, index: int) -> int:
        stages = len(self.program.stages)
        return ((mb * stages + src) * stages + dst) * 4096 + index

    def _accumulating(self, stage: int, kind: str, gm: fx.GraphModule,
                      outputs: tuple[str, ...]) -> tuple:
        """`pipeline_program.accumulating` of the stage's program, made once."""
        key = (stage, kind)
        if key not in self._accumulators:
            self._accumulators[key] = accumulating(gm, outputs, self.part_keys, self._read)
        return self._accumulators[key]

    def _run(self, gm: fx.GraphModule, inputs: tuple[str, ...], outputs: tuple[str, ...],
             env: dict[str, torch.Tensor], action, sums: Sequence[torch.Tensor] = (),
             dying: Sequence[str] = ()) -> None:
        """Run `gm` on the environment's `inputs` (then `sums`); `dying`: the inputs no
        later action reads, given up by the environment so that the program frees each
        after its last use (`_dying`)."""
        args = [env[k] for k in inputs] + list(sums)
        for key in dying:
            del env[key]
        if self.run_graph is not None:  # autopar.bisect records every value, region by region
            results = self.run_graph(gm, args, action)
        else:
            # on a CPU the fused regions' ops run inline (codegen/kernels.py's run rule)
            module = runnable(gm, args)
            if module not in self._boxed:
                self._boxed[module] = boxed(module)
            results = self._boxed[module](args)  # empties `args`
        env.update(zip(outputs, results))

    def held_tensors(self) -> list[torch.Tensor]:
        """What this rank keeps across steps (besides optimizer state): the parameters its
        stages read, and the buffers."""
        mine = [*self.params, *(u for u, p in zip(self.updated, self.params) if u is not p)]
        n = len(self.program.params)
        return mine + [self.tensor_of[k] for k in self.program.keys[n:n + len(self.program.buffers)]]

    def batch_bytes(self, global_batch) -> int:
        """Bytes of this rank's micro-batches of the global batch (and the counts the loss
        divides by)."""
        return sum(x.numel() * x.element_size()
                   for mb in self._micro_batches(self._with_counts(global_batch)) for x in mb)

    def _with_counts(self, global_batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The flat global batch and, after it, the divisor of each batch-decided count
        the loss divides by (global_loss_mean.py), the same for every micro-batch."""
        return (*global_batch, *normalizer_means(
            self.program.normalizers, global_batch, self.program.batch_dims,
            self.dp * self.program.schedule.microbatches))

    def _inputs_env(self, micro_inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        env = dict(self.tensor_of)
        n = len(self.program.params) + len(self.program.buffers)
        env.update(zip(self.program.keys[n:], micro_inputs))
        return env

    def _check_batch(self, global_batch: Sequence[torch.Tensor]) -> None:
        """BatchError, naming the input, where the global batch is not the size compiled."""
        m = self.program.schedule.microbatches
        for entry, dim, x in zip(self.program.inputs, self.program.batch_dims, global_batch):
            if dim is not None and x.shape[dim] != entry.shape[dim] * m * self.dp:
                raise BatchError(
                    f"{entry.name}: global batch of {x.shape[dim]} along dim {dim}, but the "
                    f"program was compiled for {entry.shape[dim] * m * self.dp} (micro-batches "
                    f"of {entry.shape[dim]} x {m} x dp={self.dp}); compile again for a new size")

    def _micro_batches(self, global_batch) -> list[list[torch.Tensor]]:
        m = self.program.schedule.microbatches
        out = [[] for _ in range(m)]
        for entry, dim, x in zip(self.program.inputs, self.program.batch_dims, global_batch):
            if dim is None:
                for part in out:
                    part.append(x)
                continue
            size = entry.shape[dim]
            local = x.narrow(dim, self.dp_rank * size * m, size * m)
            for i, part in enumerate(out):
                part.append(local.narrow(dim, i * size, size))
        return out

    # -- after the schedule ----------------------------------------------------------------------

    def _finish_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The global mean loss on every rank (the last stage computed it)."""
        total = self._local_loss(losses)
        if self.mesh.device_mesh is None:
            return total
        total = total / (self.dp * self.tp)  # every tp peer of the last stage holds it
        dist.all_reduce(total)
        return total

    def _local_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """This rank's micro-batch mean; a rank without the loss stage gives zero in the
        loss's dtype, since the all-reduce that follows needs one dtype on every rank."""
        if losses:
            return torch.stack(losses).mean()
        return torch.zeros((), dtype=self.program.values[self.program.loss_key].dtype)

    def _sync_grads(self, parts: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Each held parameter's gradient: its parts summed over the pipeline ranks that
        share it, then over data-parallel ranks (the seed already divided by dp)."""
        grads = []
        for entry, keys in self.held:
            mine = [parts[k] for k in keys if k in parts]
            grad = sum(mine[1:], mine[0]) if mine else torch.zeros(entry.shape, dtype=entry.dtype)
            if entry.name in self._groups:
                dist.all_reduce(grad, group=self._groups[entry.name])
            grads.append(grad)
        if self.dp == 1 or not grads or not self.sum_over_dp:
            return grads
        scattered = [self.zero >= 2 and u is not p for u, p in zip(self.updated, self.params)]
        whole = [g for g, s in zip(grads, scattered) if not s]
        if whole:
            flat = self._on_wire(torch.cat([g.reshape(-1) for g in whole]))
            self._sum_over_dp(flat)
            flat = flat.to(whole[0].dtype)
            reduced = iter(chunk.view_as(g) for chunk, g in
                           zip(flat.split([g.numel() for g in whole]), whole))
        # ZeRO-2: each rank receives only the sum of its own block
        return [self._reduce_scatter(g, u) if s else next(reduced)
                for g, u, s in zip(grads, self.updated, scattered)]

    def _sum_over_dp(self, flat: torch.Tensor, groups: dict | None = None) -> None:
        """`flat` summed over the dp group in place: one all-reduce, or with a node split
        in three levels (inside the node, among the nodes, back; Mesh.sum_over_dp); on
        `groups` (Mesh.detached_dp_groups) where given."""
        self.mesh.sum_over_dp(flat, self.node_split, self.hierarchy_form, groups)

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        """Layout.grad_comm_dtype: gradients cross the network in half precision."""
        return t.to(self._wire_dtype) if self._wire_dtype is not None else t

    def _reduce_scatter(self, grad: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        rows = block.shape[0]
        padded = grad
        if grad.shape[0] != rows * self.dp:  # the last block's padding rows
            padded = grad.new_zeros((rows * self.dp, *grad.shape[1:]))
            padded[:grad.shape[0]] = grad
        out = self._on_wire(block.detach()).new_empty(block.shape)
        dist.reduce_scatter_tensor(out, self._on_wire(padded.contiguous()),
                                   group=self.mesh.group("dp"))
        return out.to(grad.dtype)

    def _apply(self, grads: list[torch.Tensor]) -> None:
        """The optimizer step (skipped everywhere when a loss-scaled step overflowed)."""
        for g in grads if self.program.grad_divisor > 1 else ():
            g.div_(self.program.grad_divisor)
        if self.loss_scaler is not None and not self.loss_scaler.unscale_and_check(grads):
            return
        for u, g in zip(self.updated, grads):
            u.grad = g if g.shape == u.shape else block_of(g, u.shape[0], self.dp_rank)
        self.optimizer.step()
        for p, u in zip(self.params, self.updated):
            u.grad = None
            if u is not p and self.zero < 3:
                gather_into(p, u, self.dp, self.mesh.group("dp"))

    def _sharded(self) -> list[tuple[torch.nn.Parameter, torch.Tensor, int]]:
        """ZeRO-3: (parameter, its block, its rows) of each parameter held as a block."""
        if self.zero < 3:
            return []
        return [(p, u, rows) for p, u, rows in zip(self.params, self.updated, self.rows)
                if u is not p]

    def _gather_params(self) -> None:
        for p, u, rows in self._sharded():
            p.data = gathered(u, rows, self.dp, self.mesh.group("dp"))

    def _release_params(self) -> None:
        for p, _, _ in self._sharded():
            p.data = p.data.new_empty(0)

    # -- weights ---------------------------------------------------------------------------------

    def _held_params(self) -> list[HeldParam]:
        """The parameters this rank's stages read (see TrainingState)."""
        return [HeldParam(e, p, u, self.zero >= 3 and u is not p, rows) for (e, _), p, u, rows
                in zip(self.held, self.params, self.updated, self.rows)]

    def _held_buffers(self) -> dict[str, torch.Tensor]:
        return {b.name: self.tensor_of[k] for b, k in
                zip(self.program.buffers, self.program.keys[len(self.program.params):])}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model under its original names, on every rank."""
        tp_group = self.mesh.group("tp")
        self._gather_params()
        mine = {e.name: whole(self.tensor_of[self.param_key[e.name]], e, tp_group, self.tp)
                for e, _ in self.held}
        self._release_params()
        named_buffers = dict(self._model.named_buffers(remove_duplicate=False))
        mine.update({b.name: named_buffers[b.name].detach().clone() for b in self.program.buffers})
        parts = [mine]
        if self.mesh.device_mesh is not None:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            merged.update(part)
        for entry in self.program.params + self.program.buffers:
            for alias in entry.aliases:
                merged[alias] = merged[entry.name]
        return merged


def _storages(values) -> set[int]:
    """The data pointers of the storages of the tensors among `values`."""
    return {t.untyped_storage().data_ptr() for t in values if isinstance(t, torch.Tensor)}
