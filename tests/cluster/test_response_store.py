"""`previous_response_id` works whichever ingress replica answers: with two ingress
replicas the Responses store is one Ray actor both reach (deployments/responses/store.py),
over a SQLite file, so the actor's death and restart loses nothing. With `store: redis` both
replicas talk to a real redis-server (tests/redis_server.py), whose kill -9 and restart
loses nothing either, nor does the death of an ingress replica."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import os
import signal
import time

import httpx
import pytest
import redis

from tests.cluster.conftest import BASE_URL, DASHBOARD, LocalCluster
from tests.redis_server import RedisServer

pytestmark = pytest.mark.cluster


def respond(body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{BASE_URL}/v1/responses", timeout=60, json={
        "model": "orchard-tiny", "temperature": 0, "max_output_tokens": 16, **body})


def history_tokens(first_input: str, earlier: dict[str, Any], text: str) -> int:
    """Input tokens of `text` sent with the earlier turn written out as items: what a
    follow-up by `previous_response_id` must render to."""
    items = [{"role": "user", "content": first_input}, *earlier["output"],
             {"role": "user", "content": text}]
    explicit = respond({"input": items})
    assert explicit.status_code == 200, explicit.text
    return int(explicit.json()["usage"]["input_tokens"])


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
    for i, response in enumerate(first):
        earlier = response.json()
        follow = respond({"input": "And then?", "previous_response_id": earlier["id"]})
        assert follow.status_code == 200, follow.text
        body = follow.json()
        assert body["previous_response_id"] == earlier["id"]
        # The stored turn is in the prompt: its input, its output, then the new input.
        assert body["usage"]["input_tokens"] == \
            history_tokens(f"Hello number {i}!", earlier, "And then?"), (body, earlier)
    unknown = respond({"input": "Hi", "previous_response_id": "resp_missing"})
    assert unknown.status_code == 404


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def test_with_redis_follow_ups_survive_a_replica_and_the_store(
        cluster: LocalCluster, redis_server: RedisServer) -> None:
    cluster.deploy({"ingress": {"num_replicas": 2, "colocate": False},
                    "models": [{"id": "orchard-tiny", "source": "builtin:tiny"}],
                    "responses": {"store": "redis", "url": redis_server.url}})
    app = cluster.wait_status("RUNNING")
    assert len(app["deployments"]["Ingress"]["replicas"]) == 2
    first = [respond({"input": f"Hello number {i}!"}) for i in range(8)]
    assert all(r.status_code == 200 for r in first), [r.text for r in first]
    raw = redis.Redis(port=redis_server.port)
    # In Redis itself, not in an actor that a node holds.
    assert all(raw.exists(f"orchard:responses:orchard:r:{r.json()['id']}") for r in first)
    raw.close()
    def follow_ups(responses: list[httpx.Response]) -> None:
        for i, response in enumerate(responses):
            earlier = response.json()
            follow = respond({"input": "And then?", "previous_response_id": earlier["id"]})
            assert follow.status_code == 200, follow.text
            assert follow.json()["usage"]["input_tokens"] == \
                history_tokens(f"Hello number {i}!", earlier, "And then?")

    _kill_ingress_replica(cluster)  # Serve starts another, which reaches the same server
    follow_ups(first)
    redis_server.kill()  # SIGKILL: only its append-only file holds the responses
    redis_server.start()
    follow_ups(first)  # the replicas' connections to the old process reconnect
    later = [respond({"input": f"Hello again {i}!"}) for i in range(4)]
    assert all(r.status_code == 200 for r in later), [r.text for r in later]
    follow_ups(later)


def _alive_actors(cluster: LocalCluster) -> list[dict[str, Any]]:
    r = httpx.get(f"{DASHBOARD}/api/v0/actors?limit=1000&detail=true", timeout=30,
                  headers={"Authorization": f"Bearer {cluster.token}"})
    r.raise_for_status()
    return [a for a in r.json()["data"]["result"]["result"] if a["state"] == "ALIVE"]


def _kill_ingress_replica(cluster: LocalCluster) -> None:
    replicas = [a for a in _alive_actors(cluster)
                if a.get("class_name") == "ServeReplica:orchard:Ingress"]
    assert len(replicas) == 2, replicas
    os.kill(replicas[0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # Serve notices the death, then starts a replacement
        app = cluster.app()
        ingress = app.get("deployments", {}).get("Ingress", {}).get("replicas", [])
        if [r["state"] for r in ingress] == ["RUNNING", "RUNNING"] and \
                replicas[0]["actor_id"] not in {r.get("actor_id") for r in ingress}:
            return
        assert time.monotonic() < deadline, f"no new ingress replica: {ingress}"
        time.sleep(1)


def _kill_store_actor(cluster: LocalCluster) -> None:
    def store() -> dict[str, Any] | None:
        alive = [a for a in _alive_actors(cluster)
                 if (a.get("name") or "").startswith("orchard-responses-")]
        return alive[0] if alive else None

    before = store()
    assert before is not None
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (after := store()) is None or after["pid"] == before["pid"]:
        assert time.monotonic() < deadline, "the store actor did not restart"
        time.sleep(1)
