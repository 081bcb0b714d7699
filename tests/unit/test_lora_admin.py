"""The run-time adapter endpoint (`ingress/lora_admin.py`) over the real app and the
deployments' control (`deployments/adapter_admin.py`), with a fake model client, an
in-memory store and replicas that follow it through the real `AdapterSync`
(`deployments/adapter_store.py`): loads reach every replica, a new replica gets the set,
the cards learn the names, unloading waits for rows, and every bad call gets OpenAI's
error shape while the server keeps serving. Over Ray Serve: tests/e2e/test_adapters_http.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.adapter_admin import ServedAdapters
from deployments.adapter_store import AdapterSync, RuntimeAdapter, ServedBy
from ingress.app import create_app
from ingress.client import ModelCard
from ingress.options import EdgeOptions
from ingress.tenancy.policy import TenantPolicy
from replicas.contract import Channel, FinishReason, Finished, TextDelta, Usage
from replicas.errors import InvalidRequestError
from tests.fakes import FakeClient, Step

BASE = ModelCard("tiny-lora", aliases=("tl",), adapters=("alpha",),
                 adapter_aliases=(("tiny-alpha", "alpha"),))
OTHER = ModelCard("other")
SCRIPT: list[Step] = [TextDelta(Channel.ANSWER, "Hi."), Finished(FinishReason.EOS, Usage(1, 1))]


class FakeReplica:
    """Adapters by name; a path holding "bad" is refused as the real replica refuses a
    wrong adapter; an adapter in `busy` has rows, so unloading it is refused."""

    def __init__(self, configured: tuple[str, ...] = ("alpha",)) -> None:
        self.names = list(configured)
        self.busy: set[str] = set()

    def adapter_names(self) -> tuple[str, ...]:
        return tuple(self.names)

    async def load_adapter(self, name: str, path: str) -> None:
        if "bad" in path:
            raise InvalidRequestError(f"adapter '{name}': {path}/adapter_config.json does "
                                      "not exist")
        self.names.append(name)

    async def unload_adapter(self, name: str) -> None:
        if name in self.busy:
            raise InvalidRequestError(f"adapter '{name}' is in use by 1 rows")
        self.names.remove(name)


class FakeStore:
    """The store actor's calls in memory; asking who serves what first lets every replica
    take a sync pass, as their threads would within a second."""

    def __init__(self) -> None:
        self.adapters_set: dict[tuple[str, str], RuntimeAdapter] = {}
        self.version = 0
        self.reports: dict[str, ServedBy] = {}
        self.syncs: list[AdapterSync] = []

    def add_replica(self, replica: FakeReplica, rid: str) -> AdapterSync:
        sync = AdapterSync(replica, BASE.id, rid, ("alpha",),
                           lambda: tuple(self.adapters_set.values()), self.report)
        sync.once()  # at start, before it serves
        self.syncs.append(sync)
        return sync

    def report(self, served: ServedBy) -> None:
        self.reports[served.replica] = ServedBy(served.replica, served.model, served.names,
                                                served.errors, time.time())

    async def put(self, adapter: RuntimeAdapter) -> float | None:
        if (adapter.model, adapter.name) in self.adapters_set:
            return None
        self.adapters_set[(adapter.model, adapter.name)] = adapter
        self.version += 1
        return time.time()

    async def remove(self, model: str, name: str) -> float | None:
        if self.adapters_set.pop((model, name), None) is None:
            return None
        self.version += 1
        return time.time()

    async def adapters(self) -> tuple[int, tuple[RuntimeAdapter, ...]]:
        return self.adapters_now()

    def adapters_now(self) -> tuple[int, tuple[RuntimeAdapter, ...]]:
        return self.version, tuple(self.adapters_set.values())

    async def served(self, model: str) -> tuple[ServedBy, ...]:
        for sync in self.syncs:
            await asyncio.to_thread(sync.once)  # its own loop, as on its thread
        return tuple(s for s in self.reports.values() if s.model == model)


class Setup:
    def __init__(self, options: EdgeOptions = EdgeOptions()) -> None:
        self.client = FakeClient(SCRIPT, models=(BASE, OTHER))
        self.store = FakeStore()
        self.replicas = [FakeReplica(), FakeReplica()]
        for i, replica in enumerate(self.replicas):
            self.store.add_replica(replica, f"r{i}")
        self.validated: list[str] = []

        async def validate(model: str, name: str, path: str) -> str | None:
            self.validated.append(name)
            try:
                await self.replicas[0].load_adapter(name, path)
            except InvalidRequestError as exc:
                return str(exc)
            return None

        def apply(cards: list[ModelCard]) -> None:
            self.client._models = (*cards,)

        self.control = ServedAdapters([BASE, OTHER], apply, self.store,  # type: ignore[arg-type]
                                      validate, wait_s=5.0, drain_wait_s=0.3)
        self.http = TestClient(create_app(self.client, options, adapter_control=self.control))


def _openai_error(response: Any, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error
    return dict(error)


def _model_ids(http: TestClient) -> set[str]:
    return {m["id"] for m in http.get("/v1/models").json()["data"]}


def test_load_reaches_every_replica_and_routing() -> None:
    s = Setup()
    listed = s.http.get("/v1/adapters").json()["data"]
    assert [(e["id"], e["source"], e["aliases"]) for e in listed] == \
        [("tiny-lora:alpha", "config", ["tiny-alpha"])]
    answer = s.http.post("/v1/adapters", json={"model": "tl", "name": "gamma",
                                               "path": "/adapters/gamma",
                                               "aliases": ["tiny-gamma"]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["id"], body["source"], body["replicas"]) == ("tiny-lora:gamma", "runtime", 2)
    assert all(r.adapter_names() == ("alpha", "gamma") for r in s.replicas)
    assert {"tiny-lora:gamma", "tiny-gamma"} <= _model_ids(s.http)
    chat = s.http.post("/v1/chat/completions", json={
        "model": "tiny-gamma", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    assert (s.client.requests[-1].model, s.client.requests[-1].adapter) == ("tiny-lora", "gamma")
    # A replica that starts later gets the set before it serves.
    late = FakeReplica()
    s.store.add_replica(late, "r-late")
    assert late.adapter_names() == ("alpha", "gamma")
    listed = {e["id"]: e for e in s.http.get("/v1/adapters").json()["data"]}
    assert listed["tiny-lora:gamma"]["replicas"] == 3


def test_bad_calls_get_openai_errors_and_change_nothing() -> None:
    s = Setup()
    _openai_error(s.http.post("/v1/adapters", json={"model": "nope", "name": "g", "path": "/p"}),
                  404, "nope")
    bad = _openai_error(s.http.post("/v1/adapters", json={
        "model": "tiny-lora", "name": "g", "path": "/bad/g"}), 400, "does not exist")
    assert bad["param"] == "path"
    _openai_error(s.http.post("/v1/adapters", json={
        "model": "tiny-lora", "name": "alpha", "path": "/p"}), 409, "already serves")
    _openai_error(s.http.post("/v1/adapters", json={
        "model": "tiny-lora", "name": "g", "path": "/p", "aliases": ["other"]}), 409, "other")
    _openai_error(s.http.post("/v1/adapters", json={
        "model": "tiny-lora", "name": "a:b", "path": "/p"}), 400, "name")
    _openai_error(s.http.post("/v1/adapters", json={
        "model": "tiny-lora", "name": "g", "path": "/p", "aliases": ["x:y"]}), 400, "aliases")
    _openai_error(s.http.post("/v1/adapters", json={"model": "tiny-lora", "name": "g"}), 400,
                  "path")
    _openai_error(s.http.post("/v1/adapters", json={
        "model": "tiny-lora", "name": "g", "path": "/p", "rank": 8}), 400, "rank")
    _openai_error(s.http.delete("/v1/adapters/tiny-lora:nope"), 404, "tiny-lora:nope")
    _openai_error(s.http.delete("/v1/adapters/tiny-lora:alpha"), 400, "configured")
    assert s.validated == ["g"]  # only the call that got that far reached a replica
    assert all(r.adapter_names() == ("alpha",) for r in s.replicas)
    assert s.store.adapters_set == {}
    assert "tiny-lora:g" not in _model_ids(s.http)
    assert s.http.get("/health").status_code == 200


def test_unload_leaves_routing_at_once_and_rows_finish() -> None:
    """The choice: unloading never cuts a row. The name leaves routing at once; a replica
    whose rows use it frees it when they end (202 until then), the others at once."""
    s = Setup()
    assert s.http.post("/v1/adapters", json={"model": "tiny-lora", "name": "gamma",
                                             "path": "/g"}).status_code == 200
    s.replicas[1].busy.add("gamma")
    gone = s.http.delete("/v1/adapters/tiny-lora:gamma")
    assert gone.status_code == 202, gone.text
    assert (gone.json()["deleted"], gone.json()["pending"], gone.json()["path"]) == \
        (True, 1, "/g")
    assert s.replicas[0].adapter_names() == ("alpha",)
    assert s.replicas[1].adapter_names() == ("alpha", "gamma")  # its row decodes on
    refused = s.http.post("/v1/chat/completions", json={
        "model": "tiny-lora:gamma", "messages": [{"role": "user", "content": "hi"}]})
    _openai_error(refused, 400, "gamma")
    assert "tiny-lora:gamma" not in _model_ids(s.http)
    s.replicas[1].busy.clear()  # its row ended
    asyncio.run(s.store.served("tiny-lora"))
    assert s.replicas[1].adapter_names() == ("alpha",)
    _openai_error(s.http.delete("/v1/adapters/tiny-lora:gamma"), 404)
    # Loaded again, unloaded with no rows on it: 200 at once.
    assert s.http.post("/v1/adapters", json={"model": "tiny-lora", "name": "gamma",
                                             "path": "/g"}).status_code == 200
    assert s.http.delete("/v1/adapters/tiny-lora:gamma").status_code == 200


def test_another_ingress_learns_the_names() -> None:
    s = Setup()
    second = FakeClient(models=(BASE, OTHER))

    def apply(cards: list[ModelCard]) -> None:
        second._models = (*cards,)

    other = ServedAdapters([BASE, OTHER], apply, s.store,  # type: ignore[arg-type]
                           lambda m, n, p: asyncio.sleep(0, None))
    other.watch(period_s=0.05)
    try:
        assert s.http.post("/v1/adapters", json={"model": "tiny-lora", "name": "gamma",
                                                 "path": "/g"}).status_code == 200
        deadline = time.monotonic() + 5
        while second.resolve("tiny-lora") != s.client.resolve("tiny-lora") \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        card = second.resolve("tiny-lora")
        assert card is not None and card.adapters == ("alpha", "gamma")
    finally:
        other.stop()


@pytest.mark.parametrize("key,status", [(None, 401), ("user-key", 403), ("admin-key", 200)])
def test_admin_keys_only(key: str | None, status: int) -> None:
    tenants = (TenantPolicy("ops", frozenset({"admin-key"}), admin=True),
               TenantPolicy("agents", frozenset({"user-key"})))
    s = Setup(EdgeOptions(tenants=tenants))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for call in (lambda: s.http.get("/v1/adapters", headers=headers),
                 lambda: s.http.post("/v1/adapters", headers=headers, json={
                     "model": "tiny-lora", "name": "gamma", "path": "/g"}),
                 lambda: s.http.delete("/v1/adapters/tiny-lora:gamma", headers=headers)):
        answer = call()
        if status == 200:
            assert answer.status_code < 300, answer.text
        else:
            _openai_error(answer, status)
    # Refused: never loaded; allowed: loaded, then unloaded by the DELETE.
    assert all(r.adapter_names() == ("alpha",) for r in s.replicas)
    assert s.validated == (["gamma"] if status == 200 else [])


def test_plain_keys_and_no_control() -> None:
    s = Setup(EdgeOptions(api_keys=frozenset({"k"})))
    _openai_error(s.http.get("/v1/adapters"), 401)
    assert s.http.get("/v1/adapters", headers={"Authorization": "Bearer k"}).status_code == 200
    bare = TestClient(create_app(FakeClient()))
    _openai_error(bare.get("/v1/adapters"), 404, "cannot load adapters")
