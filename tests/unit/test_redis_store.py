"""The Redis Responses store against a real `redis-server` (tests/redis_server.py): the
bounds the other stores keep (count, bytes, age; least recently used first), two stores on
one server as two ingress replicas would be, a kill -9 of the server losing nothing, and a
server that is down failing as the API's 503 rather than a crash."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.errors import CodedError
from deployments.responses.redis import RedisResponseStore
from ingress.responses.store import StoredResponse, encode
from replicas.contract import Channel, ErrorKind, Finished, FinishReason, TextDelta, Usage
from tests.fakes import FakeClient
from tests.redis_server import RedisServer


def stored(text: str) -> StoredResponse:
    return StoredResponse({"id": text, "output": [{"type": "message", "text": text}]},
                          ({"role": "user", "content": text},))


def make(server: RedisServer, **bounds: Any) -> RedisResponseStore:
    return RedisResponseStore(server.url, "test:", **bounds)


def consistent(server: RedisServer) -> tuple[int, int]:
    """(count, bytes), after checking the index agrees with itself: every indexed id has
    its text and a size, and the running byte total is the sum of the sizes."""
    raw = redis.Redis(port=server.port)
    ids = {i.decode() for i in raw.zrange("test:recency", 0, -1)}
    sizes = {k.decode(): int(v) for k, v in raw.hgetall("test:sizes").items()}
    assert set(sizes) == ids == {i.decode() for i in raw.zrange("test:expires", 0, -1)}
    assert all(raw.strlen(f"test:r:{i}") == sizes[i] for i in ids)
    total = int(raw.get("test:bytes") or 0)
    assert total == sum(sizes.values())
    raw.close()
    return len(ids), total


def test_put_get_and_an_unknown_id(server: RedisServer) -> None:
    async def run() -> None:
        store = make(server)
        await store.put("resp_1", stored("one"))
        assert await store.get("resp_1") == stored("one")
        assert await store.get("resp_missing") is None
        assert await store.get("a\udc00b") is None  # a lone surrogate names nothing
        await store.put("resp_1", stored("again"))  # a put over an id replaces it
        assert await store.get("resp_1") == stored("again")
        assert await store.count() == 1 and await store.bytes() == len(encode(stored("again")))
        await store.aclose()

    asyncio.run(run())
    assert consistent(server) == (1, len(encode(stored("again"))))


def test_bounds_by_count_and_bytes_least_recently_used_first(server: RedisServer) -> None:
    async def run() -> None:
        store = make(server, max_entries=2, max_bytes=400)
        for name in ("a", "b", "c"):
            await store.put(name, stored(name))
        assert await store.get("a") is None and await store.get("b") == stored("b")  # count
        await store.put("d", stored("d"))  # "c" is least recently used now
        assert await store.get("c") is None and await store.get("b") is not None
        await store.put("big", stored("x" * 500))  # over the byte cap: not kept
        assert await store.get("big") is None
        assert await store.bytes() <= 400
        # Bytes bind before the count: three of ~115 bytes each do not fit in 300.
        small = make(server, max_entries=100, max_bytes=300)
        for name in ("e", "f", "g"):
            await small.put(name, stored(name))
        assert await small.get("b") is None and await small.get("e") is None
        assert await small.get("f") == stored("f") and await small.get("g") == stored("g")
        await store.aclose()
        await small.aclose()

    asyncio.run(run())
    assert consistent(server) == (2, 2 * len(encode(stored("f"))))


def test_bounds_by_age(server: RedisServer) -> None:
    async def run() -> None:
        store = make(server, ttl_s=0.5)
        await store.put("old", stored("old"))
        assert await store.get("old") == stored("old")
        await asyncio.sleep(0.7)
        assert await store.get("old") is None  # Redis expired its text
        await store.put("new", stored("new"))  # and a put drops it from the index too
        assert await store.count() == 1
        await store.aclose()

    asyncio.run(run())
    assert consistent(server) == (1, len(encode(stored("new"))))


def test_two_replicas_write_at_once_and_see_each_others_responses(server: RedisServer) -> None:
    async def run() -> None:
        # Two stores, two connection pools: what two ingress replicas on two nodes hold.
        first, second = make(server, max_entries=1000), make(server, max_entries=1000)
        await asyncio.gather(*(store.put(f"r{k}-{i}", stored(f"{k}-{i}"))
                               for i in range(100) for k, store in enumerate((first, second))))
        assert await first.get("r1-99") == stored("1-99")
        assert await second.get("r0-42") == stored("0-42")
        assert await first.count() == 200
        # Trimming under contention: both write past a cap of 50 at once.
        capped = [make(server, max_entries=50), make(server, max_entries=50)]
        await asyncio.gather(*(store.put(f"c{k}-{i}", stored(f"c{k}-{i}"))
                               for i in range(60) for k, store in enumerate(capped)))
        assert await capped[0].count() == 50
        for store in (first, second, *capped):
            await store.aclose()

    asyncio.run(run())
    assert consistent(server)[0] == 50


def test_a_killed_and_restarted_server_keeps_every_response(server: RedisServer) -> None:
    async def write() -> None:
        store = make(server)
        for i in range(20):
            await store.put(f"resp_{i}", stored(f"kept {i}"))
        await store.aclose()

    async def read_with(store: RedisResponseStore) -> list[StoredResponse | None]:
        return [await store.get(f"resp_{i}") for i in range(20)]

    async def reconnect() -> None:
        # The same store (a replica that lived through the restart) and a new one (a
        # replica started after it) both find everything.
        survivor = make(server)
        assert await survivor.get("resp_0") == stored("kept 0")
        server.restart()
        assert await read_with(survivor) == [stored(f"kept {i}") for i in range(20)]
        await survivor.aclose()
        fresh = make(server)
        assert await read_with(fresh) == [stored(f"kept {i}") for i in range(20)]
        await fresh.aclose()

    asyncio.run(write())
    server.kill()  # SIGKILL: no shutdown save; only the append-only file holds them
    server.start()
    asyncio.run(reconnect())
    assert consistent(server) == (20, sum(len(encode(stored(f"kept {i}"))) for i in range(20)))


def test_a_stopped_server_is_a_503_in_the_apis_shape(server: RedisServer) -> None:
    async def run() -> None:
        store = make(server)
        await store.put("resp_1", stored("one"))
        server.kill()
        started = time.monotonic()
        for call in (store.get("resp_1"), store.put("resp_2", stored("two"))):
            with pytest.raises(CodedError) as caught:
                await call
            assert caught.value.kind is ErrorKind.OVERLOADED
            assert caught.value.code == "response_store_unavailable"
        assert time.monotonic() - started < 10  # a few quick retries, not the default ten
        await store.aclose()

    asyncio.run(run())


def test_http_while_the_store_is_down(server: RedisServer) -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=1)
    fake = FakeClient([TextDelta(Channel.ANSWER, "Hi."), Finished(FinishReason.EOS, usage)])
    body = {"model": "orchard-tiny", "input": "Hello"}
    # One TestClient context: one event loop for the app, as in a replica.
    with TestClient(create_app(fake, response_store=make(server))) as http:
        first = http.post("/v1/responses", json=body)
        assert first.status_code == 200, first.text
        server.kill()
        for reply in (http.get(f"/v1/responses/{first.json()['id']}"),
                      http.post("/v1/responses", json=body | {
                          "previous_response_id": first.json()["id"]}),
                      http.post("/v1/responses", json=body)):  # the save fails
            assert reply.status_code == 503, reply.text
            assert reply.headers["retry-after"] == "1"
            error = reply.json()["error"]
            assert (error["type"], error["code"]) == ("overloaded_error",
                                                      "response_store_unavailable")
            assert "127.0.0.1" not in error["message"]  # the cause is logged, not sent
        # Streamed, the status is sent before the save: the stream ends with the error.
        streamed = http.post("/v1/responses", json=body | {"stream": True})
        assert streamed.status_code == 200
        events = [line for line in streamed.text.splitlines() if line.startswith("event:")]
        assert events[-2:] == ["event: response.completed", "event: error"], events
        assert "response_store_unavailable" in streamed.text.split("event: error")[-1]
        server.start()  # back: the same app stores and finds again
        again = http.post("/v1/responses", json=body)
        assert again.status_code == 200, again.text
        assert http.get(f"/v1/responses/{again.json()['id']}").status_code == 200
        assert http.get(f"/v1/responses/{first.json()['id']}").status_code == 200


def test_the_config_names_a_server_for_redis_only() -> None:
    from pydantic import ValidationError

    from deployments.config import ResponsesSettings
    from deployments.responses.store import configured_store

    with pytest.raises(ValidationError, match="responses.url"):
        ResponsesSettings(store="redis")
    with pytest.raises(ValidationError, match="responses.url"):
        ResponsesSettings(url="redis://127.0.0.1:6379/0")  # the default store is sqlite
    with pytest.raises(ValidationError, match="key_prefix"):
        ResponsesSettings(store="memory", key_prefix="x:")
    settings = ResponsesSettings(store="redis", url="redis://127.0.0.1:1/0", max_entries=7)
    store = configured_store(settings, "myapp")  # connects on first use, not here
    assert isinstance(store, RedisResponseStore)
    assert (store.prefix, store.max_entries) == ("orchard:responses:myapp:", 7)
    custom = ResponsesSettings(store="redis", url="redis://127.0.0.1:1/0", key_prefix="a:")
    assert configured_store(custom, "myapp").prefix == "a:"  # type: ignore[attr-defined]
