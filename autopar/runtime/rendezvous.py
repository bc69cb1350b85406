"""torchrun's c10d rendezvous, fixed so that a replacement node can join a running job.

Use it as `torchrun --rdzv-backend autopar-c10d ...` (registered with torchrun through
the `torchrun.handlers` entry point; `autopar train --elastic` on several nodes and
`autopar k8s` choose it).

Why: with the TCP store shared between the agents and the workers (torch's default),
rank 0's agent publishes the workers' MASTER_ADDR / MASTER_PORT under a round's keys only
the first time it is rank 0. A node that joins a later round (a replacement for one that
died) waits for those keys under the new round's prefix, and the agent of rank 0 waits
for the newcomer's role information: both time out and the job ends. The fix here
publishes them every round from rank 0 and reads them every round on the other ranks
(a node's cached copy may name a rank 0 of an earlier round). With the store sharing
turned off (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) torch already does both, and this
handler changes nothing there.

Each round's number also goes to the workers (`ROUND_ENV`, set in the agent's environment,
which the workers it starts next inherit). The workers' process group keys its store
entries by it: a restart count cannot serve, since each agent counts its own restarts and
a replacement starts again from 0.
"""

from __future__ import annotations

import os

# torch imports its rendezvous handlers' entry points (this module) while it initialises
# torch.distributed.elastic.rendezvous: whatever is needed from there is imported late,
# so this module loads whichever of the two is imported first.

BACKEND = "autopar-c10d"
ROUND_ENV = "AUTOPAR_RDZV_ROUND"


class RepublishingRendezvous:
    """torch's c10d `DynamicRendezvousHandler` (`inner`), with the workers' store address
    published by rank 0 and read by every other rank in each round. It has the methods of
    torch's `RendezvousHandler`, which torchrun's agent calls."""

    def __init__(self, inner):
        self._inner = inner

    def next_rendezvous(self):
        from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

        info = self._inner.next_rendezvous()
        os.environ[ROUND_ENV] = str(self._round())
        if not self._inner.use_agent_store:
            return info
        if info.rank == 0:
            found = info.bootstrap_store_info
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, found.master_addr.encode())
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(found.master_port).encode())
            return info
        return RendezvousInfo(info.store, info.rank, info.world_size,
                              RendezvousStoreInfo.build(info.rank, info.store, None))

    def _round(self) -> int:
        """The round just joined. torch keeps it in a private field of its handler
        (read here as in torch 2.13, the version autopar pins)."""
        try:
            return self._inner._state_holder.state.round
        except AttributeError as e:
            import torch

            raise RuntimeError(
                f"the {BACKEND} rendezvous cannot read the round number from torch "
                f"{torch.__version__}'s c10d handler (it reads the one of torch 2.13); use "
                f"--rdzv-backend c10d, with which a replacement node cannot join") from e

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def get_backend(self) -> str:
        return BACKEND

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def create(params) -> RepublishingRendezvous:
    """torch's c10d handler for `params`, wrapped (the registry's creator)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    return RepublishingRendezvous(create_handler(store, backend, params))


def handler():
    """The `torchrun.handlers` entry point: torchrun calls it and registers what it returns
    as the creator of the `autopar-c10d` backend."""
    return create
