"""Usage per tenant and model in the Responses store's database: SQLite and a real Redis
server, each surviving a restart (a new store over the same file; Redis killed -9 and
started again over its append-only file)."""

from __future__ import annotations

import asyncio
from pathlib import Path


from deployments.responses.usage import RedisUsageStore, SqliteUsageStore
from ingress.tenancy.usage import UsageCounts
from tests.redis_server import RedisServer

ONE = UsageCounts(requests=1, prompt_tokens=30, cached_tokens=4, completion_tokens=7,
                  preemptions=1)


def test_sqlite_usage_adds_up_and_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "app.sqlite3"

    async def before() -> None:
        store = SqliteUsageStore(path)
        await asyncio.gather(*(store.add("ci", "tiny", ONE) for _ in range(5)))
        await store.add("agents", "tiny", ONE)
        store.close()

    async def after() -> dict[tuple[str, str], UsageCounts]:
        store = SqliteUsageStore(path)  # a new process's store over the same file
        try:
            return await store.report()
        finally:
            store.close()

    asyncio.run(before())
    assert asyncio.run(after()) == {
        ("ci", "tiny"): UsageCounts(5, 150, 20, 35, 5), ("agents", "tiny"): ONE}


def test_redis_usage_adds_up_and_survives_a_server_restart(server: RedisServer) -> None:
    async def add() -> None:
        store = RedisUsageStore(server.url, "test:usage")
        await asyncio.gather(*(store.add("ci", "org/model", ONE) for _ in range(3)))
        await store.aclose()

    async def report() -> dict[tuple[str, str], UsageCounts]:
        store = RedisUsageStore(server.url, "test:usage")
        try:
            return await store.report()
        finally:
            await store.aclose()

    asyncio.run(add())
    server.kill()
    server.start()
    assert asyncio.run(report()) == {("ci", "org/model"): UsageCounts(3, 90, 12, 21, 3)}
