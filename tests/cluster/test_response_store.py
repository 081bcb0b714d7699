"""`previous_response_id` works whichever ingress replica answers: with two ingress
replicas the Responses store is one Ray actor both reach (deployments/response_store.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.cluster.conftest import BASE_URL, LocalCluster

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
    first = [respond({"input": "Hello!"}) for _ in range(8)]
    assert all(r.status_code == 200 for r in first), [r.text for r in first]
    for response in first:
        follow = respond({"input": "And then?", "previous_response_id": response.json()["id"]})
        assert follow.status_code == 200, follow.text
        assert follow.json()["previous_response_id"] == response.json()["id"]
    unknown = respond({"input": "Hi", "previous_response_id": "resp_missing"})
    assert unknown.status_code == 404
