"""The cluster as one snapshot (`GET /v1/cluster`, `/dashboard`, `orchard status`): what each
replica last reported of itself, placed on the nodes of Ray's node table, with each model's
totals and the recent faults.

Plain data and arithmetic, no Ray: the board actor (`deployments/board.py`) keeps the
reports and calls `Ledger`; the tests build snapshots from reports directly.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# A replica silent for this long is lost (it reports every `REPORT_S`): a kill -9, a frozen
# Mac, a node gone. It stays in the snapshot as lost for `FORGET_S`, then leaves.
REPORT_S = 2.0
LOST_AFTER_S = 3 * REPORT_S
FORGET_S = 60.0
# Faults kept, newest last.
MAX_FAULTS = 200


@dataclass(frozen=True)
class RankReport:
    """One rank of a sharded replica: where it runs and its share of the KV budget."""

    rank: int
    node: str  # Ray node id
    kv_budget_bytes: int
    node_memory_bytes: int | None = None  # its node's RAM and Metal, as the rank reads them
    metal: bool | None = None


@dataclass(frozen=True)
class ReplicaReport:
    """What one model replica says of itself every `REPORT_S` seconds (`board.Reporter`):
    its engine's stats and its node, as the replica already counts them."""

    replica: str  # Serve's full replica id
    model: str
    role: str  # "both", "prefill" or "decode" (`role:` in the config)
    node: str  # Ray node id of rank 0
    host: str
    pid: int
    at: float  # wall-clock seconds of this report
    loaded: bool
    running: int  # streams in the batch
    queued: int  # waiting for the batch or for KV memory
    kv_budget_bytes: int
    kv_used_bytes: int  # the running requests' reservations
    kv_shared_bytes: int  # the prefix cache: KV any request with that prefix reuses
    disk_bytes: int  # the prefix cache's disk tier
    tokens: int  # tokens decoded so far
    preempted: int  # so far
    pulls: int  # prefixes pulled from another replica so far
    mlx_bytes: int  # MLX's memory in use in rank 0's process: weights, KV, buffers
    node_memory_bytes: int  # the node's RAM, as the replica's process reads it
    metal: bool
    ranks: tuple[RankReport, ...] = ()  # ranks 1..N-1 of a sharded replica


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str  # "replacement", "lost", "resume", "preemption", "pull"
    model: str
    replica: str = ""
    detail: str = ""


@dataclass
class _Seen:
    report: ReplicaReport
    tokens_per_s: float = 0.0
    lost_at: float | None = None


class Ledger:
    """The latest report of every replica, and the faults their differences show."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}
        self.faults: deque[Fault] = deque(maxlen=MAX_FAULTS)

    def report(self, new: ReplicaReport) -> None:
        seen = self._seen.get(new.replica)
        if seen is None:
            self._arrived(new)
            self._seen[new.replica] = _Seen(new)
            return
        old = seen.report
        span = new.at - old.at
        seen.tokens_per_s = (new.tokens - old.tokens) / span if span > 0 else 0.0
        if new.preempted > old.preempted:
            self.faults.append(Fault(new.at, "preemption", new.model, new.replica,
                                     f"{new.preempted - old.preempted} preempted"))
        if new.pulls > old.pulls:
            self.faults.append(Fault(new.at, "pull", new.model, new.replica,
                                     f"{new.pulls - old.pulls} prefixes pulled"))
        seen.report, seen.lost_at = new, None

    def _arrived(self, new: ReplicaReport) -> None:
        """A replica's first report: a replacement when one of its model was lost."""
        for replica, seen in self._seen.items():
            if seen.lost_at is not None and seen.report.model == new.model and \
                    seen.report.role == new.role:
                self.faults.append(Fault(new.at, "replacement", new.model, new.replica,
                                         f"replaces {replica}"))
                del self._seen[replica]
                return

    def gone(self, replica: str) -> None:
        """A replica stopped on purpose (scaled down, redeployed): no fault."""
        self._seen.pop(replica, None)

    def fault(self, fault: Fault) -> None:
        self.faults.append(fault)

    def sweep(self, now: float) -> None:
        """Mark the silent replicas lost (a fault, once) and forget the long-lost ones."""
        for replica, seen in list(self._seen.items()):
            if seen.lost_at is None and now - seen.report.at > LOST_AFTER_S:
                seen.lost_at = now
                self.faults.append(Fault(now, "lost", seen.report.model, replica,
                                         f"no report for {now - seen.report.at:.0f}s"))
            elif seen.lost_at is not None and now - seen.lost_at > FORGET_S:
                del self._seen[replica]

    def snapshot(self, nodes: Sequence[Mapping[str, Any]], now: float) -> dict[str, Any]:
        """The JSON snapshot. `nodes`: Ray's node table (`ray.nodes()`)."""
        self.sweep(now)
        return assemble(list(self._seen.values()), nodes, list(self.faults), now)


def assemble(seen: Sequence[_Seen], nodes: Sequence[Mapping[str, Any]],
             faults: Sequence[Fault], now: float) -> dict[str, Any]:
    boxes: dict[str, dict[str, Any]] = {}
    for node in nodes:
        resources = node.get("Resources") or {}
        boxes[node["NodeID"]] = {
            "id": node["NodeID"], "name": node.get("NodeManagerHostname") or node["NodeID"][:12],
            "address": node.get("NodeManagerAddress", ""), "alive": bool(node.get("Alive")),
            "memory_bytes": None, "metal": None, "mlx_bytes": 0,
            "resources": {k: v for k, v in resources.items() if not k.startswith("node:")},
            "replicas": [], "shards": []}
    for entry in seen:
        r = entry.report
        state = "lost" if entry.lost_at is not None else "running" if r.loaded else "loading"
        live = state != "lost"
        box = boxes.setdefault(r.node, {
            "id": r.node, "name": r.host, "address": "", "alive": False, "memory_bytes": None,
            "metal": None, "mlx_bytes": 0, "resources": {}, "replicas": [], "shards": []})
        if live:
            box["memory_bytes"] = r.node_memory_bytes
            box["metal"] = r.metal
            box["mlx_bytes"] += r.mlx_bytes
        box["replicas"].append({
            "id": r.replica, "model": r.model, "role": r.role, "rank": 0,
            "ranks": 1 + len(r.ranks), "state": state, "pid": r.pid, "reported_at": r.at,
            "kv_budget_bytes": r.kv_budget_bytes, "kv_used_bytes": r.kv_used_bytes,
            "kv_shared_bytes": r.kv_shared_bytes, "disk_bytes": r.disk_bytes,
            "queue": r.queued if live else 0, "running": r.running if live else 0,
            "tokens_per_s": round(entry.tokens_per_s, 1) if live else 0.0,
            "mlx_bytes": r.mlx_bytes, "preempted": r.preempted, "pulls": r.pulls})
        for rank in r.ranks:
            node = boxes.setdefault(rank.node, {
                "id": rank.node, "name": rank.node[:12], "address": "", "alive": False,
                "memory_bytes": None, "metal": None, "mlx_bytes": 0, "resources": {},
                "replicas": [], "shards": []})
            if live and node["memory_bytes"] is None:  # a node that holds only ranks
                node["memory_bytes"], node["metal"] = rank.node_memory_bytes, rank.metal
            node["shards"].append({
                "replica": r.replica, "model": r.model, "role": r.role, "rank": rank.rank,
                "state": state, "kv_budget_bytes": rank.kv_budget_bytes})
    for box in boxes.values():  # a stable order, so a page redrawn every 2 s stays put
        box["replicas"].sort(key=lambda r: (r["model"], r["id"]))
        box["shards"].sort(key=lambda s: (s["model"], s["replica"], s["rank"]))
    return {"at": now, "nodes": list(boxes.values()),
            "models": sorted(_models(seen), key=lambda m: m["id"]),
            "faults": [dataclasses.asdict(f) for f in faults]}


def _models(seen: Sequence[_Seen]) -> list[dict[str, Any]]:
    totals: dict[str, dict[str, Any]] = {}
    for entry in seen:
        r = entry.report
        total = totals.setdefault(r.model, {
            "id": r.model, "replicas": 0, "lost": 0, "ranks": 0, "running": 0, "queue": 0,
            "tokens_per_s": 0.0, "kv_budget_bytes": 0, "kv_used_bytes": 0,
            "kv_shared_bytes": 0, "preempted": 0, "pulls": 0})
        if entry.lost_at is not None:
            total["lost"] += 1
            continue
        total["replicas"] += 1
        total["ranks"] += 1 + len(r.ranks)
        total["running"] += r.running
        total["queue"] += r.queued
        total["tokens_per_s"] = round(total["tokens_per_s"] + entry.tokens_per_s, 1)
        for key in ("kv_budget_bytes", "kv_used_bytes", "kv_shared_bytes", "preempted",
                    "pulls"):
            total[key] += getattr(r, key)
    return list(totals.values())
