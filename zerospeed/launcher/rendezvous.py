"""The c10d rendezvous of a zerospeed job, on torch's ``DynamicRendezvousHandler`` (imports torch).

``NodeRendezvous`` wraps torch's handler to (1) note each node's arrival in the store, so a timeout
names the nodes that never came, (2) without elasticity, give each node its place in the world
(hostfile order) as its group rank, and (3) tell the ranks which store to meet in.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from zerospeed.launcher.agent import RendezvousPlan, arrival_key, missing_nodes
from zerospeed.launcher.errors import LauncherError
from zerospeed.utils.ports import free_port


class NodeRendezvous(RendezvousHandler):
    """torch's c10d ``DynamicRendezvousHandler`` with zerospeed's node order and arrival notes."""

    def __init__(self, plan: RendezvousPlan) -> None:
        params = RendezvousParameters(**plan.parameters())
        backend, self._store = create_backend(params)  # connects to (or, on node 0, hosts) the store
        self._inner = create_handler(self._store, backend, params)
        self._plan = plan
        self._attempt = 0
        self._shared = True

    @property
    def store(self) -> Store:
        """The job's c10d store (on node 0)."""
        return self._store

    @property
    def attempt(self) -> int:
        """Rendezvous rounds this node has entered (the one in progress included)."""
        return self._attempt

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round; without elasticity this node's group rank is its ``--node_rank``."""
        self._attempt += 1
        self._store.set(arrival_key(self._plan.run_id, self._plan.node_rank), str(self._attempt))
        with _torch_store_sharing_off():  # Note [no torch store sharing]
            info = self._inner.next_rendezvous()
        rank = self._plan.node_rank if self._plan.pinned else info.rank
        if self._plan.pinned:
            self._check_world(info)
        return RendezvousInfo(info.store, rank, info.world_size, self._ranks_store(info, rank))

    def _check_world(self, info: RendezvousInfo) -> None:
        # Note [node order]: torch's rendezvous numbers nodes by (hostname, pid), so which host gets
        # rank 0 would change from run to run. A fixed world keeps DeepSpeed's order instead (the
        # hostfile's, or --node_rank): ranks, CROSS_RANK and the --master_addr host's rank 0 stay
        # where the user put them. Only the group rank changes; torch derives the global ranks from it.
        if info.world_size != self._plan.num_nodes:
            raise LauncherError(f"node {self._plan.node_rank}: the rendezvous formed with {info.world_size} "
                                f"node(s), but the job has {self._plan.num_nodes}")

    def _ranks_store(self, info: RendezvousInfo, group_rank: int) -> RendezvousStoreInfo:
        # Note [the ranks' store]: in the job's first round the ranks join node 0's rendezvous store (as
        # clients: use_agent_store), so they see --master_addr/--master_port as they always did and no
        # other port must be open. That store outlives a restart, and torch's ranks keep their keys in
        # it without a per-attempt prefix, so restarted ranks would read their predecessors' addresses
        # (gloo: "connection refused"). In later rounds rank 0 therefore hosts a fresh store, on a port
        # its node picks. Group rank 0 decides and publishes in this round's keys (info.store is prefixed
        # per round), so every node decides alike even when elastic membership changes restart only some.
        if group_rank == 0:
            first = self._store.add(f"zerospeed/{self._plan.run_id}/rounds", 1) == 1
            port = self._plan.master_port if first else free_port()
            info.store.set("zerospeed/ranks_store", f"{int(first)} {port}")
        first, port = info.store.get("zerospeed/ranks_store").decode().split()
        self._shared = first == "1"
        # Rank 0 lives on group rank 0: node 0 (--master_addr) unless torch ordered the nodes (elastic),
        # and then on the host torch's rank 0 published.
        fresh_host = self._plan.master_addr if self._plan.pinned else info.bootstrap_store_info.master_addr
        return RendezvousStoreInfo(self._plan.master_addr if self._shared else fresh_host, int(port))

    def missing(self) -> list[int]:
        """Nodes that have not entered this node's current round (read from the store, no waiting)."""
        arrivals = {}
        for r in range(self._plan.num_nodes):
            key = arrival_key(self._plan.run_id, r)
            if self._store.check([key]):
                arrivals[r] = int(self._store.get(key))
        return missing_nodes(arrivals, self._plan.num_nodes, self._attempt)

    def get_backend(self) -> str:
        """See ``RendezvousHandler``."""
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        """Whether the ranks join the agents' store (first round) or rank 0 hosts one (Note [the ranks' store])."""
        return self._shared

    def is_closed(self) -> bool:
        """See ``RendezvousHandler``."""
        return self._inner.is_closed()

    def set_closed(self) -> None:
        """See ``RendezvousHandler``."""
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """See ``RendezvousHandler``."""
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        """See ``RendezvousHandler``."""
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        """See ``RendezvousHandler``."""
        return self._inner.shutdown()


_NO_SHARING_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextlib.contextmanager
def _torch_store_sharing_off() -> Iterator[None]:
    # Note [no torch store sharing]: with its default (sharing on), torch's handler builds the ranks'
    # store address once per node and caches it, so in later rounds the node that was rank 0 no longer
    # publishes it in the round's keys. A node that joins a running job (elastic grow) has no cache and
    # waits for that key until its read timeout, and the old node's restarted ranks wait for the new
    # node's: the job hangs (torch 2.13; seen in tests/dist/test_elastic_training.py; pytorch #135712 is
    # the restart side of it). And were the joining node to become rank 0, the others would keep a
    # cached address that is no longer rank 0's. torch's opt-out makes rank 0 publish its address in
    # every round (and starts no extra store server in the agent); which store the ranks meet in is
    # still ours to say (``use_agent_store``, Note [the ranks' store]). torch reads the variable only in
    # ``next_rendezvous``, so it is set for that call alone and the ranks started later don't inherit it.
    previous = os.environ.get(_NO_SHARING_VAR)
    os.environ[_NO_SHARING_VAR] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_NO_SHARING_VAR, None)
        else:
            os.environ[_NO_SHARING_VAR] = previous


