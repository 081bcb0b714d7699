"""`GET /v1/cluster` over a real `serve run`, in every layout: the model's replica is on a
node of Ray's node table with its KV budget, its numbers move while a stream decodes, and
`orchard status` (here `python -m deployments.cluster status`) prints the same replicas.
The ledger's arithmetic and the keys: tests/unit/test_cluster_view.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.cluster_view import decoding, snapshot, status_replicas

pytestmark = pytest.mark.e2e

MODEL = "orchard-tiny"
# A replica reports every 2 s (deployments/snapshot.py, REPORT_S) and a rate needs two
# reports: a few periods is plenty, on a busy 2-core machine too.
WAIT_S = 30.0


def replicas(snap: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for node in snap["nodes"] for r in node["replicas"]]


def until(server: str, check: Any) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while True:
        snap = snapshot(server)
        if check(snap):
            return snap
        assert time.monotonic() < deadline, replicas(snap)
        time.sleep(0.5)


def test_the_snapshot_places_the_replica_and_its_numbers_move(server: str) -> None:
    snap = until(server, lambda s: any(r["model"] == MODEL and r["state"] == "running"
                                           for r in replicas(s)))
    node = next(n for n in snap["nodes"] if n["replicas"])
    assert node["alive"] and node["memory_bytes"] > 0 and node["metal"] is not None
    (replica,) = [r for r in replicas(snap) if r["model"] == MODEL]
    assert replica["kv_budget_bytes"] > 0 and replica["ranks"] == 1
    assert [m["id"] for m in snap["models"]] == [MODEL]

    seen = {"running": 0, "tokens_per_s": 0.0}

    def moved(snap: dict[str, Any]) -> bool:
        (mine,) = [r for r in replicas(snap) if r["model"] == MODEL]
        for key in seen:
            seen[key] = max(seen[key], mine[key])
        return seen["running"] >= 1 and seen["tokens_per_s"] > 0

    # While streams decode, the replica reports a stream and a token rate.
    with decoding(server, MODEL):
        busy = until(server, moved)
    assert next(m for m in busy["models"] if m["id"] == MODEL)["replicas"] == 1


def test_orchard_status_prints_the_replicas_of_the_json(server: str) -> None:
    listed = status_replicas(server)
    assert sorted(listed) == sorted(r["id"] for r in replicas(snapshot(server))) and listed
