"""`GET /v1/cluster` over a real `serve run`, in every layout: the model's replica is on a
node of Ray's node table with its KV budget, its numbers move while a stream decodes, and
`orchard status` (here `python -m deployments.cluster status`) prints the same replicas.
The ledger's arithmetic and the keys: tests/unit/test_cluster_view.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.e2e

MODEL = "orchard-tiny"
# A replica reports every 2 s (deployments/snapshot.py, REPORT_S) and a rate needs two
# reports: a few periods is plenty, on a busy 2-core machine too.
WAIT_S = 30.0


def cluster(server: str) -> dict[str, Any]:
    response = httpx.get(f"{server}/v1/cluster", timeout=10)
    assert response.status_code == 200, response.text
    snapshot: dict[str, Any] = response.json()
    return snapshot


def replicas(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for node in snapshot["nodes"] for r in node["replicas"]]


def until(server: str, check: Any) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while True:
        snapshot = cluster(server)
        if check(snapshot):
            return snapshot
        assert time.monotonic() < deadline, replicas(snapshot)
        time.sleep(0.5)


def test_the_snapshot_places_the_replica_and_its_numbers_move(server: str) -> None:
    snapshot = until(server, lambda s: any(r["model"] == MODEL and r["state"] == "running"
                                           for r in replicas(s)))
    node = next(n for n in snapshot["nodes"] if n["replicas"])
    assert node["alive"] and node["memory_bytes"] > 0 and node["metal"] is not None
    (replica,) = [r for r in replicas(snapshot) if r["model"] == MODEL]
    assert replica["kv_budget_bytes"] > 0 and replica["ranks"] == 1
    assert [m["id"] for m in snapshot["models"]] == [MODEL]

    # Streams one after another: while they decode, the replica reports streams and a rate.
    done = threading.Event()

    def decode() -> None:
        body = {"model": MODEL, "prompt": "count:", "max_tokens": 400, "stream": True}
        while not done.is_set():
            with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    if done.is_set():
                        break

    seen = {"running": 0, "tokens_per_s": 0.0}

    def moved(snap: dict[str, Any]) -> bool:
        (mine,) = [r for r in replicas(snap) if r["model"] == MODEL]
        for key in seen:
            seen[key] = max(seen[key], mine[key])
        return seen["running"] >= 1 and seen["tokens_per_s"] > 0

    thread = threading.Thread(target=decode, daemon=True)
    thread.start()
    try:
        busy = until(server, moved)
    finally:
        done.set()
        thread.join(timeout=60)
    assert next(m for m in busy["models"] if m["id"] == MODEL)["replicas"] == 1


def test_orchard_status_prints_the_replicas_of_the_json(server: str) -> None:
    result = subprocess.run([sys.executable, "-m", "deployments.cluster", "status",
                             "--url", server], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    # The node table (faults below it name replicas too): each row names its replica last.
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NODE"))
    listed = {line.split()[-1] for line in lines[start + 1:lines.index("", start)]}
    assert listed == {r["id"] for r in replicas(cluster(server))} and listed
