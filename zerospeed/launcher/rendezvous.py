"""The c10d rendezvous of a zerospeed job: the plan of how a node meets the others (pure), and
``NodeRendezvous``, which runs it on torch's ``DynamicRendezvousHandler``.

``NodeRendezvous`` wraps torch's handler to (1) note each node's arrival in the store, so a timeout
names the nodes that never came, (2) without elasticity, give each node its place in the world
(hostfile order) as its group rank, and (3) tell the ranks which store to meet in.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerospeed.launcher.errors import LauncherError
from zerospeed.utils.ports import free_port

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousInfo
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

DEFAULT_RDZV_TIMEOUT_S = 600  # DynamicRendezvousHandler's join timeout
DEFAULT_LAST_CALL_S = 30  # ... and its wait for more nodes once min_nodes joined (elastic only)
DEFAULT_KEEP_ALIVE_S = 5  # ... and its heartbeat interval: a node silent for 3 of them is dropped
RDZV_TIMEOUT_VAR = "ZEROSPEED_RDZV_TIMEOUT"  # seconds; exported to every node by the runners
LAST_CALL_VAR = "ZEROSPEED_RDZV_LAST_CALL_TIMEOUT"
KEEP_ALIVE_VAR = "ZEROSPEED_RDZV_KEEP_ALIVE_INTERVAL"
RUN_ID_VAR = "ZEROSPEED_RUN_ID"


@dataclass(frozen=True)
class RendezvousPlan:
    """How this node meets the others (pure data; ``rendezvous_plan`` makes it)."""

    master_addr: str  # the c10d store, hosted by node 0's agent, is on master_addr:master_port
    master_port: int
    run_id: str
    min_nodes: int
    max_nodes: int
    node_rank: int
    num_nodes: int  # nodes of the world (hostfile); with elasticity, the most expected
    is_host: bool  # this node's agent hosts the store
    pinned: bool  # node order is the world's (non-elastic); else the rendezvous's
    join_timeout_s: int
    last_call_timeout_s: int
    keep_alive_s: int = DEFAULT_KEEP_ALIVE_S  # heartbeat interval; a lost node is noticed after 3 of them

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` of the store."""
        return f"{self.master_addr}:{self.master_port}"

    def parameters(self) -> dict[str, Any]:
        """Keyword arguments of torch's ``RendezvousParameters``."""
        return {
            "backend": "c10d",
            "endpoint": self.endpoint,
            "run_id": self.run_id,
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "is_host": self.is_host,
            "join_timeout": self.join_timeout_s,
            "last_call_timeout": self.last_call_timeout_s,
            "keep_alive_interval": self.keep_alive_s,
            # a node waits for the store (node 0) as long as for the rendezvous itself
            "read_timeout": self.join_timeout_s,
        }


def _seconds(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "")
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise LauncherError(f"{name}={text!r} must be a whole number of seconds >= 1")
    return int(text)


def elastic_nodes(num_nodes: int, min_nodes: int | None, max_nodes: int | None) -> tuple[int, int]:
    """``--min_elastic_nodes`` / ``--max_elastic_nodes`` with DeepSpeed's defaults (1 and the node count)."""
    lo = 1 if min_nodes in (None, -1) else min_nodes
    hi = num_nodes if max_nodes in (None, -1) else max_nodes
    if lo < 1 or hi < lo:
        raise LauncherError(f"--min_elastic_nodes {lo} / --max_elastic_nodes {hi}: need 1 <= min <= max")
    return lo, hi


def rendezvous_plan(
    *,
    master_addr: str,
    master_port: int,
    node_rank: int,
    num_nodes: int,
    elastic: tuple[int, int] | None,
    env: Mapping[str, str],
) -> RendezvousPlan:
    """The rendezvous of node ``node_rank``: all ``num_nodes`` nodes, or ``elastic`` = (min, max) of them."""
    lo, hi = elastic if elastic is not None else (num_nodes, num_nodes)
    return RendezvousPlan(
        master_addr=master_addr,
        master_port=master_port,
        run_id=env.get(RUN_ID_VAR) or "zerospeed",
        min_nodes=lo,
        max_nodes=hi,
        node_rank=node_rank,
        num_nodes=num_nodes,
        is_host=node_rank == 0,
        pinned=elastic is None,
        join_timeout_s=_seconds(env, RDZV_TIMEOUT_VAR, DEFAULT_RDZV_TIMEOUT_S),
        last_call_timeout_s=_seconds(env, LAST_CALL_VAR, DEFAULT_LAST_CALL_S),
        keep_alive_s=_seconds(env, KEEP_ALIVE_VAR, DEFAULT_KEEP_ALIVE_S),
    )


def arrival_key(run_id: str, node_rank: int) -> str:
    """Store key where node ``node_rank`` notes how many rendezvous rounds it has entered."""
    return f"zerospeed/{run_id}/arrived/{node_rank}"


def missing_nodes(arrivals: Mapping[int, int], num_nodes: int, attempt: int) -> list[int]:
    """Nodes that have not entered round ``attempt`` (``arrivals``: node -> rounds entered, pure)."""
    return [r for r in range(num_nodes) if arrivals.get(r, -1) < attempt]


def timeout_message(plan: RendezvousPlan, missing: Sequence[int]) -> str:
    """The error for a rendezvous that timed out, naming the nodes that did not come."""
    who = (
        f"node(s) {', '.join(map(str, missing))} of {plan.num_nodes} never arrived"
        if missing
        else f"fewer than {plan.min_nodes} node(s) were ready"
    )
    return (
        f"node {plan.node_rank}: the rendezvous at {plan.endpoint} timed out after {plan.join_timeout_s} s: "
        f"{who}; start the missing node launchers (same --master_addr/--master_port), or wait longer "
        f"with {RDZV_TIMEOUT_VAR}=SECONDS"
    )


def unreachable_message(plan: RendezvousPlan, err: BaseException) -> str:
    """The error for a node that could not reach node 0's store (or, on node 0, could not host it)."""
    if plan.is_host:
        return (
            f"node 0 cannot host the rendezvous store on {plan.endpoint}: port {plan.master_port} is in use "
            f"(another job?) or {plan.master_addr} is not an address of this host; choose another "
            f"--master_port, or check --master_addr ({err})"
        )
    return (
        f"node {plan.node_rank}: cannot reach the rendezvous store at {plan.endpoint}, which node 0 hosts, "
        f"within {plan.join_timeout_s} s: node 0 never arrived, or {plan.endpoint} is not reachable from "
        f"this host (check --master_addr/--master_port and the firewall) ({err})"
    )


class NodeRendezvous:
    """torch's c10d ``DynamicRendezvousHandler`` with zerospeed's node order and arrival notes.

    Note [torch on first use]: this is a ``RendezvousHandler`` (torch's agent calls only the methods
    below) that does not subclass torch's class, so that the launcher's modules import without torch
    and the ``zerospeed`` command starts in a fraction of a second; torch loads when a node is run.
    """

    def __init__(self, plan: RendezvousPlan) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

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
        from torch.distributed.elastic.rendezvous import RendezvousInfo

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
            raise LauncherError(
                f"node {self._plan.node_rank}: the rendezvous formed with {info.world_size} "
                f"node(s), but the job has {self._plan.num_nodes}"
            )

    def _ranks_store(self, info: RendezvousInfo, group_rank: int) -> RendezvousStoreInfo:
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

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
