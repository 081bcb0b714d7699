"""The Responses API's stores: the same bounds in memory and in SQLite (count, bytes, age,
least recently used first), and the SQLite store keeps what it stored across a restart."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Callable

import pytest

from deployments.responses.sqlite import SqliteResponseStore
from ingress.responses.store import MemoryResponseStore, ResponseStore, StoredResponse

Make = Callable[..., ResponseStore]


@pytest.fixture(params=["memory", "sqlite"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Make:
    if request.param == "memory":
        return MemoryResponseStore
    return lambda **kw: SqliteResponseStore(tmp_path / "responses.sqlite3", **kw)


def stored(text: str) -> StoredResponse:
    return StoredResponse({"id": text, "output": [{"type": "message", "text": text}]},
                          ({"role": "user", "content": text},))


def test_bounds(make: Make) -> None:
    now = [0.0]
    store = make(max_entries=2, max_bytes=400, ttl_s=10, clock=lambda: now[0])

    async def run() -> None:
        for name in ("a", "b", "c"):
            await store.put(name, stored(name))
        assert await store.get("a") is None and await store.get("b") == stored("b")  # count
        await store.put("d", stored("d"))  # "c" is least recently used now
        assert await store.get("c") is None and await store.get("b") is not None
        await store.put("big", stored("x" * 500))  # over the byte cap: not kept
        assert await store.get("big") is None
        assert store.bytes <= 400  # type: ignore[attr-defined]
        now[0] = 11.0
        assert await store.get("b") is None and await store.get("d") is None  # expired

    asyncio.run(run())


def test_an_id_that_is_not_utf8_is_not_found(make: Make) -> None:
    # A client's previous_response_id may carry a lone surrogate (the fuzz suite sends one).
    assert asyncio.run(make().get("a\udc00b")) is None


def test_sqlite_keeps_everything_across_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "store" / "responses.sqlite3"
    first = SqliteResponseStore(path)
    asyncio.run(first.put("resp_1", stored("kept")))
    first.close()
    again = SqliteResponseStore(path)  # a new process would open the same file
    assert asyncio.run(again.get("resp_1")) == stored("kept")
    assert len(again) == 1


def test_sqlite_takes_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    stores = [SqliteResponseStore(path, max_entries=1000) for _ in range(2)]

    def write(k: int) -> None:
        for i in range(50):
            asyncio.run(stores[k % 2].put(f"r{k}-{i}", stored(f"{k}-{i}")))

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(stores[0]) == 200
    assert asyncio.run(stores[1].get("r3-49")) == stored("3-49")
