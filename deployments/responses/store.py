"""The Responses API's store, shared by every replica that serves HTTP.

`previous_response_id` must find a response whichever replica stored it, so with more than
one HTTP-serving replica the store lives in one named Ray actor that they all reach. With
one replica the store lives in that replica. Either way the configured store (`responses:`)
is a SQLite file by default, so a restart of the replica or of the actor loses nothing.

`store: redis` needs neither: the server is already shared, by replicas on any node, so each
replica talks to it directly (no actor, no hop, no node that must stay up).
"""

from __future__ import annotations

from typing import Any

import ray

from pathlib import Path

from deployments.config import ResponsesSettings
from deployments.responses.redis import RedisResponseStore
from deployments.responses.sqlite import SqliteResponseStore
from ingress.responses.store import MemoryResponseStore, ResponseStore, StoredResponse
from replicas.builtin.build import orchard_cache

# One store per Serve application (its name), so two apps on a cluster stay apart.
_ACTOR_NAME = "orchard-responses-{app}"


@ray.remote(num_cpus=0, max_restarts=-1)
class _StoreActor:
    """A `MemoryResponseStore` (its count, byte and age bounds) in one actor. Async, so
    many ingress replicas are served concurrently without a thread per call."""

    def __init__(self, settings: ResponsesSettings, app: str) -> None:
        self._store = configured_store(settings, app)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._store.get(response_id)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await self._store.put(response_id, stored)


class RayResponseStore:
    def __init__(self, settings: ResponsesSettings, app: str) -> None:
        # get_if_exists: every replica asks for the same name, the first one creates it.
        # Detached, so it outlives the replica that happened to create it; restarted by Ray
        # if it dies, over the same file.
        self._actor: Any = _StoreActor.options(  # type: ignore[attr-defined]
            name=_ACTOR_NAME.format(app=app), namespace="orchard", get_if_exists=True,
            lifetime="detached").remote(settings, app)

    async def get(self, response_id: str) -> StoredResponse | None:
        stored: StoredResponse | None = await self._actor.get.remote(response_id)
        return stored

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await self._actor.put.remote(response_id, stored)


def configured_store(settings: ResponsesSettings, app: str) -> ResponseStore:
    bounds = dict(max_entries=settings.max_entries, max_bytes=settings.max_bytes,
                  ttl_s=settings.ttl_s)
    if settings.store == "memory":
        return MemoryResponseStore(**bounds)  # type: ignore[arg-type]
    if settings.store == "redis":
        assert settings.url is not None  # the settings' own check
        prefix = settings.key_prefix or f"orchard:responses:{app}:"
        return RedisResponseStore(settings.url, prefix, **bounds)  # type: ignore[arg-type]
    return SqliteResponseStore(sqlite_path(settings, app), **bounds)  # type: ignore[arg-type]


def sqlite_path(settings: ResponsesSettings, app: str) -> Path:
    """`store: sqlite`'s file (usage per tenant is a table in it: `usage.py`)."""
    return Path(settings.path).expanduser() if settings.path else \
        orchard_cache("responses") / f"{app}.sqlite3"


def response_store(http_replicas: int | str,
                   settings: ResponsesSettings = ResponsesSettings()) -> ResponseStore:
    """The configured store in this replica where exactly one replica serves HTTP or the
    store is Redis, else the one store actor they all share."""
    from ray import serve

    app = serve.get_replica_context().app_name
    if http_replicas == 1 or settings.store == "redis":
        return configured_store(settings, app)
    return RayResponseStore(settings, app)
