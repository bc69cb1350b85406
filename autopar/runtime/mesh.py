"""Process group and DeviceMesh set-up under torchrun (or a single process without it)."""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.runtime.rendezvous import ROUND_ENV

log = logging.getLogger("autopar.runtime")


class WorldSizeError(RuntimeError):
    """The number of processes does not match what the program was compiled for."""


def launched_world_size() -> int:
    """Processes in this job: the initialised process group's, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Mesh:
    """The DeviceMesh of a program and the process-group name of each dimension."""

    device_mesh: DeviceMesh | None
    group_names: dict[str, str]
    coords: dict[str, int]  # this rank's index along each mesh dimension
    _checkpoint_mesh: DeviceMesh | None = field(default=None, repr=False)
    # groups that are not dimensions of the DeviceMesh: "dp.local", "dp.node" (split_dp)
    _subgroups: dict = field(default_factory=dict, repr=False)

    def rank_in(self, dim: str) -> int:
        return self.coords.get(dim, 0)

    def group(self, dim: str):
        """The process group of mesh dimension `dim` (None without a process group or when
        the mesh has no such dimension); "dp.local" and "dp.node" once `split_dp` made them."""
        if dim in self._subgroups:
            return self._subgroups[dim]
        if self.device_mesh is None or dim not in self.group_names:
            return None
        return self.device_mesh.get_group(dim)

    def split_dp(self, local: int) -> None:
        """The two levels of a hierarchical all-reduce (Program.node_split): each dp group
        cut into runs of `local` consecutive ranks, one node's ("dp.local"), and the ranks
        at the same place in every node ("dp.node"). Idempotent."""
        if local <= 1 or "dp.local" in self._subgroups or self.device_mesh is None:
            return
        for name, group in self._new_dp_groups(local, whole=False).items():
            self._subgroups[name] = group
            self.group_names[name] = group.group_name

    def detached_dp_groups(self, local: int = 1) -> dict:
        """A second set of this rank's dp groups ("dp", and with `local` > 1 "dp.local" and
        "dp.node" as split_dp cuts them), for collectives issued from another thread than
        the step's: a process group runs its collectives in the order they are issued, so
        two threads sharing one (the loss scaler's default group can be the dp group)
        could issue them in different orders on different ranks."""
        if self.device_mesh is None:
            return {}
        return self._new_dp_groups(local, whole=True)

    def _new_dp_groups(self, local: int, whole: bool) -> dict:
        """New process groups over every dp row of the mesh, by name: the whole row ("dp",
        with `whole`) and, with `local` > 1, its runs of `local` ranks ("dp.local") and
        its ranks at the same place in every run ("dp.node"). Every rank makes every
        group, in the same order (new_group is collective); it keeps its own."""
        mesh = self.device_mesh.mesh
        axis = list(self.device_mesh.mesh_dim_names).index("dp")
        me, out = dist.get_rank(), {}
        for row in mesh.movedim(axis, -1).reshape(-1, mesh.shape[axis]).tolist():
            sets = [("dp", [row])] if whole else []
            if local > 1:
                sets += [("dp.local", [row[k:k + local] for k in range(0, len(row), local)]),
                         ("dp.node", [row[j::local] for j in range(local)])]
            for name, groups in sets:
                for ranks in groups:
                    group = new_group(ranks)
                    if me in ranks:
                        out[name] = group
        return out

    def sum_over_dp(self, flat: torch.Tensor, node_split: int = 1,
                    form: str = "leaders", groups: dict | None = None) -> None:
        """`flat` summed over the dp group in place: one all-reduce, or with a node split
        (`split_dp`'s groups) in three levels, docs/communication.md: "leaders" reduces
        inside each node to its first rank, all-reduces among those and broadcasts back
        (gloo, where reduce_scatter is an all-reduce); "shards" reduce-scatters inside
        the node, all-reduces each rank's shard among the nodes and all-gathers.
        `groups`: detached_dp_groups' set to run them on, instead of the mesh's own."""
        group = self.group if groups is None else groups.__getitem__
        if node_split <= 1:
            dist.all_reduce(flat, group=group("dp"))
            return
        inner, outer = group("dp.local"), group("dp.node")
        if form == "leaders":
            here = self.rank_in("dp")
            leader = self.global_rank(dp=here - here % node_split)
            dist.reduce(flat, dst=leader, group=inner)
            if here % node_split == 0:
                dist.all_reduce(flat, group=outer)
            dist.broadcast(flat, src=leader, group=inner)
            return
        padded = flat.new_zeros(-(-flat.numel() // node_split) * node_split)
        padded[:flat.numel()] = flat
        shard = padded.new_empty(padded.numel() // node_split)
        dist.reduce_scatter_tensor(shard, padded, group=inner)
        dist.all_reduce(shard, group=outer)
        dist.all_gather_into_tensor(padded, shard, group=inner)
        flat.copy_(padded[:flat.numel()])

    def global_rank(self, **coords: int) -> int:
        """The rank at these mesh coordinates; dimensions not named are this rank's own."""
        if self.device_mesh is None:
            return 0
        names = self.device_mesh.mesh_dim_names
        index = tuple(coords.get(name, self.coords[name]) for name in names)
        return int(self.device_mesh.mesh[index])

    def checkpoint_mesh(self) -> DeviceMesh | None:
        """The same ranks with the dimensions reordered tp, pp, dp, for the DTensor views
        checkpoints write (shards.global_view). A tensor's dim 0 split by tensor parallelism
        and then by ZeRO is, read left to right, DTensor's nested Shard(0) on (tp, dp).
        It makes no process groups: views over it are only read and written by DCP."""
        if self.device_mesh is None:
            return None
        if self._checkpoint_mesh is None:
            names = list(self.device_mesh.mesh_dim_names)
            order = sorted(range(len(names)), key=lambda i: _CHECKPOINT_ORDER.get(names[i], 3))
            self._checkpoint_mesh = DeviceMesh(
                self.device_mesh.device_type, self.device_mesh.mesh.permute(order),
                mesh_dim_names=tuple(names[i] for i in order), _init_backend=False)
        return self._checkpoint_mesh


_CHECKPOINT_ORDER = {"tp": 0, "pp": 1, "dp": 2}


def build_mesh(dims: tuple[tuple[str, int], ...], node_split: int = 1) -> Mesh:
    """Initialise the process group (gloo on CPU, NCCL on GPU) and the mesh; with
    `node_split` > 1 the hierarchical all-reduce's groups too (Mesh.split_dp).

    A single-process program with no torchrun runs without any process group.
    """
    needed = 1
    for _, size in dims:
        needed *= size
    world = launched_world_size()
    if world != needed:
        raise WorldSizeError(
            f"this program was compiled for {needed} processes (mesh {dict(dims)}), but the job "
            f"has {world}: start it with `torchrun --nproc-per-node {needed} ...` "
            f"(or `autopar train --nproc {needed}`)")
    if needed == 1 and not dist.is_initialized():
        return Mesh(None, {}, {name: 0 for name, _ in dims})
    init_world()
    names = tuple(name for name, _ in dims)
    shape = tuple(size for _, size in dims)
    mesh = init_device_mesh(device_type(), shape, mesh_dim_names=names)
    timeout = collective_timeout()
    for name in names:
        # init_device_mesh gives the groups it makes torch's default timeout (30 min on
        # gloo), not the world group's: a collective of a dimension would wait that long
        set_timeout(mesh.get_group(name), timeout)
    groups = {name: mesh.get_group(name).group_name for name in names}
    coords = {name: mesh.get_local_rank(name) for name in names}
    built = Mesh(mesh, groups, coords)
    built.split_dp(node_split)
    return built


def init_world(timeout: timedelta | None = None) -> None:
    """Initialise the default process group (gloo on CPU, NCCL on GPU) under torchrun,
    unless it is already: `timeout` bounds how long any collective waits for its peers
    (torch's default without it: 30 min on gloo, 10 on NCCL). A collective past it
    raises on the ranks that wait, so a rank that stopped answering ends the job (or,
    under torchrun's restarts, restarts it) instead of hanging it. Every group autopar
    makes afterwards takes the same timeout (`collective_timeout`)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type() == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout, **_elastic_store())
    # NOTE: a process that exits with its gloo group alive aborts ("terminate called
    # without an active exception"); the group autopar made, autopar tears down.
    atexit.register(_destroy_process_group)
    log.info("process group %s: rank %d of %d, collectives time out after %s", backend,
             dist.get_rank(), dist.get_world_size(), collective_timeout())


def collective_timeout() -> timedelta:
    """The timeout of the default process group's collectives: init_process_group's
    `timeout` (init_world's, or the caller's own), read back from its backend."""
    return _timeout_of(dist.group.WORLD)


def _timeout_of(group) -> timedelta:
    """The timeout of `group`'s backend for its first device type (a group made by
    the caller on another backend than this machine's default is read as it is)."""
    devices = group._device_types or [torch.device(device_type())]
    return group._get_backend(devices[0]).options._timeout


def set_timeout(group, timeout: timedelta) -> None:
    """Give `group`'s collectives `timeout` (torch gives a new group its backend's
    default, whatever the world group's timeout is)."""
    if _timeout_of(group) != timeout:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def new_group(ranks=None, backend=None):
    """dist.new_group with the world group's collective timeout (collective; every rank
    calls it with the same arguments, in the same order)."""
    return dist.new_group(ranks, timeout=collective_timeout(), backend=backend)


def _elastic_store() -> dict:
    """Under torchrun the workers share the store its agent hosts, and that store outlives
    a restart of the workers: the keys gloo's rendezvous left in it name the listening
    ports of processes that no longer run, and the restarted workers' connections to them
    are refused (seen with torch 2.13, --standalone --max-restarts 1). A prefix per
    rendezvous round gives each set of workers keys of its own: the round's number from
    autopar's rendezvous handler (`ROUND_ENV`, the same on every node, a replacement
    included), else TORCHELASTIC_RESTART_COUNT (torch's own handler: right while no node
    joins, since every agent raises it on a failure and a new agent starts at 0).
    Nothing outside torchrun: init_process_group's env://."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    rdzv_round = os.environ.get(ROUND_ENV)
    prefix = (f"autopar/round-{rdzv_round}" if rdzv_round is not None
              else f"autopar/restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(minutes=5))
    return {"store": dist.PrefixStore(prefix, store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
