"""Placement, rescaling, many models and a lost node, on a real two-node Ray cluster."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from deployments.cluster import metal_available
from deployments.model_clients import REPLICA_WAIT_S
from replicas.builtin import script
from tests.cluster.conftest import BASE_URL, LocalCluster

pytestmark = pytest.mark.cluster
CITIES = script("cities")  # answer: "...\n1. Tokyo\n2. Delhi\n..."
PROSE = script("ocean-prose")


def app_args(tiny_replicas: int) -> dict[str, Any]:
    """Two models pinned to the worker; the second differs by a default stop."""
    return {
        "cluster": {"placement": {"pin": True, "require_metal": False}},
        "models": [
            # Routing off: the load below repeats one prompt, which prefix routing keeps on
            # the replica that holds it (tests/cluster/test_prefix_routing.py), and these
            # tests want every replica serving.
            {"id": "orchard-tiny", "source": "builtin:tiny", "aliases": ["tiny"],
             "num_replicas": tiny_replicas, "routing": {"policy": "none"}},
            {"id": "orchard-tiny-stops", "source": "builtin:tiny", "default_stops": ["2."]},
        ],
    }


def chat(model: str, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 100, **extra}
    return httpx.post(f"{BASE_URL}/v1/chat/completions", json=body, timeout=60)


def model_replicas(app: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {name: d["replicas"] for name, d in app["deployments"].items()
            if name.startswith("model:")}


def test_replicas_pinned_to_worker_and_requests_routed_by_model(cluster: LocalCluster) -> None:
    cluster.ensure_worker()
    cluster.deploy(app_args(1))
    app = cluster.wait_status("RUNNING")
    nodes = cluster.node_ids()
    replicas = model_replicas(app)
    assert set(replicas) == {"model:orchard-tiny", "model:orchard-tiny-stops"}
    assert all(r["node_id"] == nodes["worker"] for rs in replicas.values() for r in rs)

    plain, alias, stopped = (chat(m, CITIES.message_dicts).json()
                             for m in ("orchard-tiny", "tiny", "orchard-tiny-stops"))
    assert plain["choices"][0]["message"]["content"] == CITIES.answer
    assert alias["model"] == "tiny"
    assert alias["choices"][0]["message"]["content"] == CITIES.answer
    # Only the second model has the default stop "2.", so this proves where it was routed.
    assert stopped["choices"][0]["message"]["content"] == CITIES.answer.split("2.")[0]
    assert stopped["choices"][0]["matched_stop"] == "2."

    listed = httpx.get(f"{BASE_URL}/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["root"]) for m in listed] == [
        ("orchard-tiny", "orchard-tiny"), ("tiny", "orchard-tiny"),
        ("orchard-tiny-stops", "orchard-tiny-stops")]

    missing = chat("no-such-model", CITIES.message_dicts)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"].endswith(
        "available models: orchard-tiny, orchard-tiny-stops")


class StreamLoad:
    """Threads streaming chat requests back to back; every outcome that is not the exact
    scripted answer is recorded as a failure."""

    def __init__(self, threads: int) -> None:
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def __enter__(self) -> "StreamLoad":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _run(self) -> None:
        body = {"model": "orchard-tiny", "messages": PROSE.message_dicts, "temperature": 0,
                "max_tokens": 100, "stream": True}
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                outcome = self._one(client, body)
                with self._lock:
                    if outcome is None:
                        self.ok += 1
                    else:
                        self.failures.append(outcome)

    @staticmethod
    def _one(client: httpx.Client, body: dict[str, Any]) -> str | None:
        text: list[str] = []
        try:
            with client.stream("POST", f"{BASE_URL}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return f"HTTP {r.status_code}: {r.read()[:300]!r}"
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        return f"stream error: {chunk['error']}"
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["delta"].get("content") or "")
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if "".join(text) == PROSE.answer else f"wrong text: {''.join(text)!r}"


def served_streams(cluster: LocalCluster, replica: dict[str, Any]) -> int:
    log = cluster.session_logs() / replica["log_file_path"].lstrip("/")
    return log.read_text().count("CALL stream OK") if log.exists() else 0


def test_serve_deploy_rescales_under_streaming_load(cluster: LocalCluster) -> None:
    cluster.ensure_worker()
    cluster.deploy(app_args(1))
    cluster.wait_status("RUNNING")
    with StreamLoad(threads=4) as load:
        deadline = time.monotonic() + 60
        while load.ok < 4 and not load.failures and time.monotonic() < deadline:
            time.sleep(0.2)
        before = load.ok
        cluster.deploy(app_args(2))
        app = cluster.wait_status("RUNNING")
        tiny = model_replicas(app)["model:orchard-tiny"]
        assert len(tiny) == 2
        # Keep streaming until both new replicas have finished some requests.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(served_streams(cluster, r) for r in tiny) < 2:
            time.sleep(0.5)
    assert load.failures == []
    assert load.ok > before
    assert all(served_streams(cluster, r) >= 2 for r in tiny)
    assert {r["node_id"] for r in tiny} == {cluster.node_ids()["worker"]}


def test_requests_get_fast_503_when_no_node_can_run_the_model(cluster: LocalCluster) -> None:
    cluster.ensure_worker()
    cluster.deploy(app_args(2))
    cluster.wait_status("RUNNING")
    cluster.stop_worker()

    start = time.monotonic()
    with ThreadPoolExecutor() as pool:  # both wait out REPLICA_WAIT_S: at once, not in turn
        openai_call = pool.submit(chat, "orchard-tiny", PROSE.message_dicts, stream=True)
        anthropic_call = pool.submit(httpx.post, f"{BASE_URL}/v1/messages", timeout=60, json={
            "model": "orchard-tiny-stops", "max_tokens": 50, "messages": PROSE.message_dicts})
        r, anthropic = openai_call.result(), anthropic_call.result()
    assert time.monotonic() - start < REPLICA_WAIT_S + 10
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"]
    assert "no replica of the model 'orchard-tiny'" in r.json()["error"]["message"]
    assert anthropic.status_code == 529
    assert anthropic.json()["error"]["type"] == "overloaded_error"
    # The ingress runs on the head, so the API itself stays up.
    assert httpx.get(f"{BASE_URL}/v1/models", timeout=30).status_code == 200


@pytest.mark.skipif(metal_available(), reason="this node has Metal")
def test_replica_refuses_a_node_without_metal(cluster: LocalCluster) -> None:
    cluster.deploy({"cluster": {"placement": {"require_metal": True}},
                    "models": [{"id": "needs-metal", "source": "builtin:tiny"}]}, name="metal")
    app = cluster.wait_status("DEPLOY_FAILED", name="metal")
    message = app["deployments"]["model:needs-metal"]["message"]
    assert "model 'needs-metal' requires Metal (placement.require_metal)" in message
    assert "has no Metal GPU" in message
