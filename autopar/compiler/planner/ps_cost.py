"""Parameter servers against all-reducing the tables' dense gradients, priced.

For a parameter-server layout the only traffic that differs from data parallelism is
the tables': a trainer pulls the rows of its batch's unique ids and pushes their
gradients (ids and rows), where data parallelism would all-reduce every table's whole
gradient every step. `compare_ps` prices both with `costs` (the same alpha-beta
formulas as every collective) on the cluster's link between trainers and servers, and
says which is faster. Dense parameters cost the same in both and are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.cluster import ClusterSpec
from autopar.compiler.ir.ps_program import PSProgram
from autopar.costs import DEFAULT_EFFICIENCY, collective_time, ps_exchange_time
from autopar.layout import Layout

ID_BYTES = 8  # int64 ids travel with every pushed row (and with every pull request)


@dataclass(frozen=True)
class PSComparison:
    trainers: int
    servers: int
    looked_up: int  # ids the trainer's batch looks up, over all pulls
    unique: int  # of them distinct per pull: the rows pulled and pushed
    pull_bytes: int  # per trainer and step: ids sent, rows received
    push_bytes: int  # ids and row gradients sent
    ps_seconds: float
    dense_bytes: int  # the tables' whole gradients, all-reduced instead
    allreduce_seconds: float
    link: str

    @property
    def faster(self) -> str:
        return "parameter servers" if self.ps_seconds <= self.allreduce_seconds else "all-reduce"

    def __str__(self) -> str:
        ratio = (max(self.ps_seconds, self.allreduce_seconds)
                 / max(min(self.ps_seconds, self.allreduce_seconds), 1e-12))
        return (f"per trainer and step: {self.unique:,} unique rows of {self.looked_up:,} ids "
                f"looked up; pull {_mib(self.pull_bytes)} + push {_mib(self.push_bytes)} "
                f"-> {self.ps_seconds * 1e3:.3f} ms with {self.servers} server(s) and "
                f"{self.trainers} trainer(s) on {self.link}; all-reducing the tables' "
                f"gradients instead: {_mib(self.dense_bytes)} -> "
                f"{self.allreduce_seconds * 1e3:.3f} ms. Faster for this model and "
                f"cluster: {self.faster}, by {ratio:.1f}x")


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


def compare_ps(program: PSProgram, unique_per_pull: Sequence[int], layout: Layout,
               cluster: ClusterSpec) -> PSComparison:
    """Price one step's table traffic both ways. `unique_per_pull`: distinct ids of each
    of the program's pulls on one trainer's batch (measured on the example batch)."""
    ps = layout.ps
    pull = push = 0
    for p, unique in zip(program.pulls, unique_per_pull):
        table = program.tables[p.table]
        row = table.dim * table.dtype.itemsize
        pull += unique * (ID_BYTES + row)
        push += unique * (ID_BYTES + row)
    # trainers and servers are different processes: on one node they share its links,
    # on several the servers are reached over the network
    link = cluster.inter_node if cluster.nodes > 1 else cluster.intra_node
    dense = sum(t.nbytes for t in program.tables)
    return PSComparison(
        trainers=layout.dp, servers=ps.servers,
        looked_up=sum(p.capacity for p in program.pulls), unique=sum(unique_per_pull),
        pull_bytes=pull, push_bytes=push,
        ps_seconds=ps_exchange_time(pull, push, layout.dp, ps.servers, link,
                                    DEFAULT_EFFICIENCY.link),
        dense_bytes=dense,
        allreduce_seconds=collective_time("all_reduce", dense, layout.dp, cluster),
        link=("the network" if cluster.nodes > 1 else "the node's links")
        + f" ({link.bandwidth / 1e9:g} GB/s, {link.latency_s * 1e6:g} us)")
