"""What the CLI's command modules share: the one console they print to, and the
cluster a command's --cluster / --nodes / --nproc name."""

from __future__ import annotations

import os

from rich.console import Console

from autopar.cluster import ClusterSpec

console = Console(stderr=False)


def cluster_from_args(name: str, nodes: int | None, layout, nproc: int | None = None):
    if name == "local":
        if nodes not in (None, 1):
            raise SystemExit("autopar: --nodes applies to a preset or YAML cluster; "
                             "--cluster local is this one machine (one process per device)")
        return ClusterSpec.local(nprocs=layout.world_size if layout is not None else nproc)
    if name.endswith((".yaml", ".yml")) or os.path.exists(name):
        spec = ClusterSpec.from_yaml(name)
        return spec if nodes is None else ClusterSpec.from_dict(
            {**spec.to_dict(), "nodes": nodes}, source=name)
    return ClusterSpec.preset(name, nodes=1 if nodes is None else nodes)


def bytes_whose(layout) -> str:
    """Whose bytes Prediction.comm_bytes holds: a pipelined step's critical rank's."""
    pipelined = layout.pp > 1 or layout.microbatches > 1
    return "the critical pipeline rank's sends and collectives" if pipelined \
        else "one rank's collectives"
