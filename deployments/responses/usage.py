"""Usage per tenant and model, kept where the Responses store keeps its responses, so it
survives restarts: a table in the same SQLite file, or a hash under the same Redis prefix.

SQLite: each HTTP-serving replica on a node adds to the file itself (SQLite serializes the
writers), so replicas on other nodes keep their own counts there; Redis: one hash that
every replica on every node adds to (`HINCRBY`, atomic). `store: memory` keeps it in the
process (`ingress.tenancy.usage.MemoryUsageStore`).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from deployments.config import ResponsesSettings
from deployments.responses.store import sqlite_path
from ingress.responses.store import store_unavailable
from ingress.tenancy.usage import COUNTS, MemoryUsageStore, UsageCounts, UsageStore

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    {", ".join(f"{name} INTEGER NOT NULL DEFAULT 0" for name in COUNTS)},
    PRIMARY KEY (tenant, model)
);
"""
_ADD = (f"INSERT INTO usage (tenant, model, {', '.join(COUNTS)}) "
        f"VALUES (?, ?, {', '.join('?' for _ in COUNTS)}) "
        f"ON CONFLICT (tenant, model) DO UPDATE SET "
        f"{', '.join(f'{n} = {n} + excluded.{n}' for n in COUNTS)}")


class SqliteUsageStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None,
                                   timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    async def add(self, tenant: str, model: str, counts: UsageCounts) -> None:
        try:
            await asyncio.to_thread(self._add, tenant, model, counts)
        except sqlite3.OperationalError as error:
            raise store_unavailable(error) from error

    def _add(self, tenant: str, model: str, counts: UsageCounts) -> None:
        with self._lock:
            self._db.execute(_ADD, (tenant, model, *(getattr(counts, n) for n in COUNTS)))

    async def report(self) -> dict[tuple[str, str], UsageCounts]:
        try:
            return await asyncio.to_thread(self._report)
        except sqlite3.OperationalError as error:
            raise store_unavailable(error) from error

    def _report(self) -> dict[tuple[str, str], UsageCounts]:
        with self._lock:
            rows = self._db.execute(f"SELECT tenant, model, {', '.join(COUNTS)} FROM usage")
            return {(row[0], row[1]): UsageCounts(*row[2:]) for row in rows.fetchall()}

    def close(self) -> None:
        with self._lock:
            self._db.close()


# Tenant and model names join a hash field with a separator no config name holds.
_SEP = "\x1f"


class RedisUsageStore:
    def __init__(self, url: str, key: str) -> None:
        self.key = key
        self._redis = aioredis.Redis.from_url(url, socket_connect_timeout=2.0,
                                              socket_timeout=5.0)

    async def add(self, tenant: str, model: str, counts: UsageCounts) -> None:
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                for name in COUNTS:
                    pipe.hincrby(self.key, _SEP.join((tenant, model, name)),
                                 getattr(counts, name))
                await pipe.execute()
        except RedisError as error:
            raise store_unavailable(error) from error

    async def report(self) -> dict[tuple[str, str], UsageCounts]:
        try:
            fields = await self._redis.hgetall(self.key)
        except RedisError as error:
            raise store_unavailable(error) from error
        values: dict[tuple[str, str], dict[str, int]] = {}
        for field, value in fields.items():
            text = field.decode() if isinstance(field, bytes) else field
            tenant, model, name = text.split(_SEP)
            values.setdefault((tenant, model), {})[name] = int(value)
        return {key: UsageCounts(**{n: v.get(n, 0) for n in COUNTS})
                for key, v in values.items()}

    async def aclose(self) -> None:
        await self._redis.aclose()


def usage_store(settings: ResponsesSettings, app: str) -> UsageStore:
    """The usage store beside the configured Responses store (`responses:`)."""
    if settings.store == "memory":
        return MemoryUsageStore()
    if settings.store == "redis":
        assert settings.url is not None  # the settings' own check
        prefix = settings.key_prefix or f"orchard:responses:{app}:"
        return RedisUsageStore(settings.url, prefix + "usage")
    return SqliteUsageStore(sqlite_path(settings, app))
