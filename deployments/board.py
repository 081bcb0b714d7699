"""The status board: one named Ray actor per Serve application that every model replica
pushes its report to (`Reporter`, every `REPORT_S` seconds, from the stats the replica
already keeps) and the ingress asks for the snapshot (`BoardView`, behind
`GET /v1/cluster` and `/dashboard`).

Pushed, not polled: a snapshot costs one call to the board, whatever the number of
replicas, and a replica that died (kill -9, a lost Mac) shows by falling silent. Detached,
as the Responses store actor is (`responses/store.py`), so the board outlives the replica
that happened to create it and a kill -9 of that replica lands in the fault timeline.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable

import ray

from deployments.snapshot import REPORT_S, Fault, Ledger, RankReport, ReplicaReport

log = logging.getLogger(__name__)

_ACTOR_NAME = "orchard-board-{app}"
# How long one snapshot serves the ingress: the page refreshes every 2 s, so several open
# pages and `orchard status --watch` cost one board call a second, whatever their number.
_VIEW_TTL_S = 1.0
# Ray's node table changes when a Mac joins or leaves; asked at most this often.
_NODES_TTL_S = 5.0


@ray.remote(num_cpus=0, max_restarts=-1)
class _Board:
    def __init__(self) -> None:
        self._ledger = Ledger()
        self._nodes: list[dict[str, Any]] = []
        self._nodes_at = 0.0

    def report(self, report: ReplicaReport) -> None:
        self._ledger.report(report)

    def gone(self, replica: str) -> None:
        self._ledger.gone(replica)

    def fault(self, fault: Fault) -> None:
        self._ledger.fault(fault)

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        if now - self._nodes_at > _NODES_TTL_S:
            self._nodes = [n for n in ray.nodes() if n.get("Alive")]
            self._nodes_at = now
        return self._ledger.snapshot(self._nodes, now)


def board(app: str) -> Any:
    """The application's board, created by whoever asks first."""
    return _Board.options(  # type: ignore[attr-defined]
        name=_ACTOR_NAME.format(app=app), namespace="orchard", get_if_exists=True,
        lifetime="detached").remote()


class BoardView:
    """The ingress's side (`ingress.cluster.ClusterView`): the board's snapshot, kept for
    `_VIEW_TTL_S` so pages and watchers share one call."""

    def __init__(self, app: str) -> None:
        self._board = board(app)
        self._snapshot: dict[str, Any] | None = None
        self._at = 0.0

    async def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._snapshot is None or now - self._at > _VIEW_TTL_S:
            self._snapshot = await self._board.snapshot.remote()
            self._at = now
        assert self._snapshot is not None
        return self._snapshot

    def resumed(self, model: str) -> None:
        """A stream moved to another replica (`RayModelClient`'s `on_resume`)."""
        self._board.fault.remote(Fault(time.time(), "resume", model,
                                       detail="a stream went on on another replica"))


def _metal() -> bool:
    from deployments.cluster import metal_available

    return metal_available()


def _mlx_bytes() -> int:
    import mlx.core as mx  # a model replica's process: MLX is loaded already

    return int(mx.get_active_memory())


def node_memory_bytes() -> int:
    """This node's RAM (a rank's Mac, for the snapshot's memory bars)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Reporter:
    """A model replica's side: a daemon thread that pushes `report()` every `REPORT_S`
    seconds. `stats` is the replica owner's own (`ReplicaOwner.stats`); `ranks`, a sharded
    replica's node per rank, rank 0 first, and the other ranks' node RAM and Metal
    (`ShardGroup.nodes`, `ShardGroup.node_facts`)."""

    def __init__(self, app: str, replica: str, model: str, role: str,
                 stats: Callable[[], dict[str, Any]],
                 ranks: Callable[[], tuple[list[str], list[tuple[int, bool]]]] = lambda: ([], [])
                 ) -> None:
        self._board = board(app)
        self._replica, self._model, self._role = replica, model, role
        self._stats, self._rank_nodes = stats, ranks
        self._node = ray.get_runtime_context().get_node_id()
        self._host, self._metal, self._memory = socket.gethostname(), _metal(), \
            node_memory_bytes()
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="orchard-board-report", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._board.report.remote(self.report())
            except Exception:  # noqa: BLE001 - a report is best effort; serving goes on
                log.debug("status report failed", exc_info=True)
            self._stop.wait(REPORT_S)

    def report(self) -> ReplicaReport:
        stats = self._stats()
        memory, decode = stats.get("memory"), stats.get("decode")
        pulls = sum(n for outcome, n in (stats.get("pulls") or {}).get("outcomes", {}).items()
                    if outcome.endswith("pulled"))
        return ReplicaReport(
            replica=self._replica, model=self._model, role=self._role, node=self._node,
            host=self._host, pid=os.getpid(), at=time.time(), loaded=memory is not None,
            running=stats["active"], queued=stats["waiting"],
            kv_budget_bytes=memory["budget_bytes"] if memory else 0,
            kv_used_bytes=memory["projected_bytes"] if memory else 0,
            kv_shared_bytes=stats["cache_bytes"], disk_bytes=stats["disk_bytes"],
            tokens=decode["tokens"] if decode else 0,
            preempted=memory["preempted"] if memory else 0, pulls=pulls,
            mlx_bytes=_mlx_bytes(), node_memory_bytes=self._memory, metal=self._metal,
            ranks=self._ranks(memory))

    def _ranks(self, memory: dict[str, Any] | None) -> tuple[RankReport, ...]:
        """Ranks 1..N-1 of a sharded replica: each one's node and its KV budget."""
        nodes, facts = self._rank_nodes()  # nodes: rank 0 first; facts: ranks 1..N-1
        budgets = [budget for budget, _ in memory["ranks"]] if memory else []
        return tuple(RankReport(rank, nodes[rank], budgets[rank] if rank < len(budgets) else 0,
                                *facts[rank - 1])
                     for rank in range(1, len(nodes)) if rank - 1 < len(facts))

    def stop(self) -> None:
        """A stop on purpose: the board forgets this replica without a fault."""
        self._stop.set()
        try:
            self._board.gone.remote(self._replica)
        except Exception:  # noqa: BLE001 - Ray may be shutting down with us
            pass
