"""`previous_response_id` works whichever ingress replica answers: with two ingress
replicas the Responses store is one Ray actor both reach (deployments/response_store.py),
over a SQLite file, so the actor's death and restart loses nothing."""

from __future__ import annotations

from typing import Any

import os
import signal
import time

import httpx
import pytest

from tests.cluster.conftest import BASE_URL, DASHBOARD, LocalCluster

pytestmark = pytest.mark.cluster


def respond(body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{BASE_URL}/v1/responses", timeout=60, json={
        "model": "orchard-tiny", "temperature": 0, "max_output_tokens": 16, **body})


def test_follow_ups_find_their_response_on_any_ingress_replica(cluster: LocalCluster) -> None:
    cluster.deploy({"ingress": {"num_replicas": 2},
                    "models": [{"id": "orchard-tiny", "source": "builtin:tiny"}]})
    app = cluster.wait_status("RUNNING")
    assert len(app["deployments"]["Ingress"]["replicas"]) == 2
    # Serve spreads requests over both replicas: with a store per replica, about half of
    # these follow-ups would miss (a 404); through the shared actor none may.
    first = [respond({"input": f"Hello number {i}!"}) for i in range(8)]
    assert all(r.status_code == 200 for r in first), [r.text for r in first]
    _kill_store_actor(cluster)  # Ray restarts it over the same file
    alone = respond({"input": "And then?"}).json()
    for response in first:
        earlier = response.json()
        follow = respond({"input": "And then?", "previous_response_id": earlier["id"]})
        assert follow.status_code == 200, follow.text
        body = follow.json()
        assert body["previous_response_id"] == earlier["id"]
        # The stored turn is in the prompt: its input, its output (re-tokenized, so not
        # counted exactly), then the new input.
        assert body["usage"]["input_tokens"] > \
            earlier["usage"]["input_tokens"] + alone["usage"]["input_tokens"], (body, earlier)
    unknown = respond({"input": "Hi", "previous_response_id": "resp_missing"})
    assert unknown.status_code == 404


def _kill_store_actor(cluster: LocalCluster) -> None:
    def store() -> dict[str, Any] | None:
        r = httpx.get(f"{DASHBOARD}/api/v0/actors?limit=1000&detail=true", timeout=30,
                      headers={"Authorization": f"Bearer {cluster.token}"})
        r.raise_for_status()
        alive = [a for a in r.json()["data"]["result"]["result"] if a["state"] == "ALIVE"
                 and (a.get("name") or "").startswith("orchard-responses-")]
        return alive[0] if alive else None

    before = store()
    assert before is not None
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (after := store()) is None or after["pid"] == before["pid"]:
        assert time.monotonic() < deadline, "the store actor did not restart"
        time.sleep(1)
