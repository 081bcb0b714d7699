"""The Responses API's store, shared by every replica that serves HTTP.

`previous_response_id` must find a response whichever replica stored it, so with more than
one HTTP-serving replica the store lives in one named Ray actor that they all reach. With
one replica the ingress's own in-process store is as good and costs no extra process.
"""

from __future__ import annotations

from typing import Any

import ray

from ingress.responses.store import MemoryResponseStore, ResponseStore, StoredResponse

# One store per Serve application (its name), so two apps on a cluster stay apart.
_ACTOR_NAME = "orchard-responses-{app}"


@ray.remote(num_cpus=0, max_restarts=-1)
class _StoreActor:
    """A `MemoryResponseStore` (its count, byte and age bounds) in one actor. Async, so
    many ingress replicas are served concurrently without a thread per call."""

    def __init__(self) -> None:
        self._store = MemoryResponseStore()

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._store.get(response_id)

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await self._store.put(response_id, stored)


class RayResponseStore:
    def __init__(self, app: str) -> None:
        # get_if_exists: every replica asks for the same name, the first one creates it.
        # Detached, so it outlives the replica that happened to create it.
        self._actor: Any = _StoreActor.options(  # type: ignore[attr-defined]
            name=_ACTOR_NAME.format(app=app), namespace="orchard", get_if_exists=True,
            lifetime="detached").remote()

    async def get(self, response_id: str) -> StoredResponse | None:
        stored: StoredResponse | None = await self._actor.get.remote(response_id)
        return stored

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await self._actor.put.remote(response_id, stored)


def response_store(http_replicas: int | str) -> ResponseStore | None:
    """The shared store where more than one replica serves HTTP; None (the ingress's own
    in-process store) where exactly one does."""
    if http_replicas == 1:
        return None
    from ray import serve

    return RayResponseStore(serve.get_replica_context().app_name)
