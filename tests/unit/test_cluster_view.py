"""Seeing the cluster below Serve: the board's ledger (`deployments/snapshot.py`) turning
replica reports into a snapshot and a fault timeline, `orchard status`'s table of it
(`deployments/status.py`), and the ingress's `/v1/cluster` and `/dashboard` behind the keys
(`ingress/cluster.py`, the real app with a fake model client). Over a real Serve app:
tests/e2e/test_cluster_http.py."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.snapshot import LOST_AFTER_S, Fault, Ledger, RankReport, ReplicaReport
from deployments.status import main as orchard, render
from ingress.app import create_app
from ingress.options import EdgeOptions
from ingress.tenancy.policy import TenantPolicy
from tests.fakes import FakeClient

GIB = 2**30
NODES: list[dict[str, Any]] = [{"NodeID": "aaaa" * 10, "Alive": True, "NodeManagerHostname": "mac-studio",
          "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 16.0, "apple_silicon": 1.0,
                                                          "node:10.0.0.1": 1.0}},
         {"NodeID": "bbbb" * 10, "Alive": True, "NodeManagerHostname": "mac-mini",
          "NodeManagerAddress": "10.0.0.2", "Resources": {"apple_silicon": 1.0}}]


def report(replica: str = "orchard#Model#a1", at: float = 100.0, **changes: Any
           ) -> ReplicaReport:
    base = ReplicaReport(
        replica=replica, model="orchard-tiny", role="both", node=NODES[0]["NodeID"],
        host="mac-studio", pid=42, at=at, loaded=True, running=2, queued=1,
        kv_budget_bytes=8 * GIB, kv_used_bytes=2 * GIB, kv_shared_bytes=GIB, disk_bytes=0,
        tokens=1000, preempted=0, pulls=0, mlx_bytes=6 * GIB, node_memory_bytes=64 * GIB,
        metal=True)
    return dataclasses.replace(base, **changes)


def test_a_replica_lands_on_its_node_with_its_rate_and_the_models_totals() -> None:
    ledger = Ledger()
    ledger.report(report(at=100.0, tokens=1000))
    ledger.report(report(at=102.0, tokens=1300))
    snap = ledger.snapshot(NODES, 103.0)
    studio, mini = snap["nodes"]
    assert (studio["name"], studio["memory_bytes"], studio["metal"]) == ("mac-studio", 64 * GIB,
                                                                         True)
    assert "node:10.0.0.1" not in studio["resources"]
    (replica,) = studio["replicas"]
    assert replica["tokens_per_s"] == 150.0  # 300 tokens over the 2 s between reports
    assert (replica["state"], replica["queue"], replica["running"]) == ("running", 1, 2)
    assert (replica["kv_used_bytes"], replica["kv_shared_bytes"]) == (2 * GIB, GIB)
    assert mini["replicas"] == [] and mini["metal"] is None  # nothing reported from it
    (model,) = snap["models"]
    assert (model["id"], model["replicas"], model["running"], model["tokens_per_s"]) == \
        ("orchard-tiny", 1, 2, 150.0)
    assert snap["faults"] == []


def test_a_sharded_replica_shows_each_rank_on_its_node() -> None:
    ledger = Ledger()
    ledger.report(report(ranks=(RankReport(1, NODES[1]["NodeID"], 3 * GIB, 32 * GIB, True),)))
    studio, mini = ledger.snapshot(NODES, 100.5)["nodes"]
    assert studio["replicas"][0]["ranks"] == 2
    assert (mini["memory_bytes"], mini["metal"]) == (32 * GIB, True)  # as its rank read them
    (shard,) = mini["shards"]
    assert (shard["replica"], shard["rank"], shard["kv_budget_bytes"], shard["state"]) == \
        ("orchard#Model#a1", 1, 3 * GIB, "running")
    assert ledger.snapshot(NODES, 100.5)["models"][0]["ranks"] == 2


def test_preemptions_and_pulls_are_faults_with_times() -> None:
    ledger = Ledger()
    ledger.report(report(at=100.0))
    ledger.report(report(at=102.0, preempted=3, pulls=1))
    faults = ledger.snapshot(NODES, 102.5)["faults"]
    assert [(f["kind"], f["at"], f["detail"]) for f in faults] == [
        ("preemption", 102.0, "3 preempted"), ("pull", 102.0, "1 prefixes pulled")]


def test_a_silent_replica_is_lost_and_its_successor_a_replacement() -> None:
    ledger = Ledger()
    ledger.report(report("orchard#Model#old", at=100.0))
    snap = ledger.snapshot(NODES, 100.0 + LOST_AFTER_S + 1)
    assert snap["nodes"][0]["replicas"][0]["state"] == "lost"
    assert snap["models"][0]["lost"] == 1 and snap["models"][0]["replicas"] == 0
    ledger.report(report("orchard#Model#new", at=110.0))
    snap = ledger.snapshot(NODES, 110.5)
    assert [r["id"] for r in snap["nodes"][0]["replicas"]] == ["orchard#Model#new"]
    assert [(f["kind"], f["replica"], f["detail"]) for f in snap["faults"]] == [
        ("lost", "orchard#Model#old", f"no report for {LOST_AFTER_S + 1:.0f}s"),
        ("replacement", "orchard#Model#new", "replaces orchard#Model#old")]


def test_a_replica_stopped_on_purpose_leaves_without_a_fault() -> None:
    ledger = Ledger()
    ledger.report(report())
    ledger.gone("orchard#Model#a1")
    snap = ledger.snapshot(NODES, 200.0)
    assert snap["nodes"][0]["replicas"] == [] and snap["faults"] == []


def snapshot() -> dict[str, Any]:
    ledger = Ledger()
    ledger.report(report(ranks=(RankReport(1, NODES[1]["NodeID"], 3 * GIB),)))
    ledger.report(report("orchard#Model#b2", at=100.5, model="orchard-pipe", tokens=0))
    ledger.fault(Fault(101.0, "resume", "orchard-tiny", detail="a stream went on"))
    return ledger.snapshot(NODES, 101.0)


def test_the_table_lists_every_replica_and_shard_of_the_json() -> None:
    snap = snapshot()
    text = render(snap)
    listed = [line.split()[-1] for line in text.splitlines() if "orchard#Model#" in line]
    in_json = [r["id"] for n in snap["nodes"] for r in n["replicas"]] + \
        [s["replica"] for n in snap["nodes"] for s in n["shards"]]
    assert sorted(listed) == sorted(in_json) and len(in_json) == 3
    shard_row = next(line for line in text.splitlines() if line.startswith("mac-mini"))
    assert shard_row.split()[:6] == ["mac-mini", "?", "?", "orchard-tiny", "both", "1"]
    assert "resume" in text and "orchard-pipe" in text


class View:
    def __init__(self, snap: dict[str, Any]) -> None:
        self.snap = snap

    async def snapshot(self) -> dict[str, Any]:
        return self.snap


KEY = "sk-orchard-cluster-0123"


def http(keys: tuple[str, ...] = (KEY,), view: View | None = None) -> TestClient:
    app = create_app(FakeClient(), EdgeOptions(api_keys=frozenset(keys)),
                     cluster=view if view is not None else View(snapshot()))
    return TestClient(app)


@pytest.mark.parametrize("path", ["/v1/cluster", "/dashboard"])
def test_without_a_key_the_snapshot_and_the_page_are_401(path: str) -> None:
    response = http().get(path)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    # The page's 401 asks a browser for a key (as Basic's password); the API's does not.
    expected = 'Basic realm="Orchard", charset="UTF-8"' if path == "/dashboard" else "Bearer"
    assert response.headers["www-authenticate"] == expected
    assert http().get(path, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401


def test_with_a_key_the_snapshot_is_the_boards() -> None:
    snap = snapshot()
    response = http(view=View(snap)).get("/v1/cluster", headers={"x-api-key": KEY})
    assert response.status_code == 200
    assert response.json() == snap


def test_the_page_takes_the_key_as_basic_credentials_and_fetches_nothing_outside() -> None:
    basic = base64.b64encode(f"anyone:{KEY}".encode()).decode()
    response = http().get("/dashboard", headers={"Authorization": f"Basic {basic}"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert 'fetch("v1/cluster"' in page and 'fetch("v1/chat/completions"' in page
    assert "http://" not in page and "https://" not in page  # no CDN, no outside fetch
    assert "prefers-color-scheme: dark" in page
    wrong = base64.b64encode(b"anyone:sk-wrong").decode()
    assert http().get("/dashboard", headers={"Authorization": f"Basic {wrong}"}
                      ).status_code == 401


def test_without_keys_the_page_is_open_and_an_app_without_a_view_says_so() -> None:
    assert http(keys=()).get("/dashboard").status_code == 200
    app = create_app(FakeClient(), EdgeOptions())
    response = TestClient(app).get("/v1/cluster")
    assert response.status_code == 404
    assert "no cluster view" in response.json()["error"]["message"]


def test_orchard_status_prints_the_table_of_a_running_server(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    snap = snapshot()

    class Response:
        status_code = 200

        def json(self) -> dict[str, Any]:
            return snap

    seen: dict[str, Any] = {}

    def get(url: str, headers: dict[str, str], timeout: float) -> Response:
        seen.update(url=url, headers=headers)
        return Response()

    monkeypatch.setattr("deployments.status.httpx.get", get)
    assert orchard(["status", "--url", "http://mac-studio:8000/", "--key", KEY]) == 0
    assert seen == {"url": "http://mac-studio:8000/v1/cluster",
                    "headers": {"Authorization": f"Bearer {KEY}"}}
    assert capsys.readouterr().out.strip() == render(snap)


def test_with_tenants_the_snapshot_is_an_admins_and_the_page_any_tenants() -> None:
    admin, user = "sk-ops-0123456789", "sk-agents-0123456789"
    tenants = (TenantPolicy("ops", frozenset({admin}), admin=True),
               TenantPolicy("agents", frozenset({user})))
    snap = snapshot()
    http = TestClient(create_app(FakeClient(), EdgeOptions(tenants=tenants), cluster=View(snap)))
    assert http.get("/v1/cluster", headers={"x-api-key": admin}).json() == snap
    refused = http.get("/v1/cluster", headers={"x-api-key": user})
    assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
    assert http.get("/dashboard", headers={"x-api-key": user}).status_code == 200
    page = http.get("/dashboard")
    assert page.status_code == 401
    assert page.headers["www-authenticate"] == 'Basic realm="Orchard", charset="UTF-8"'
