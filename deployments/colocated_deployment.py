"""Colocated serving (`ingress.colocate`): the model's own replicas serve HTTP.

The default app relays every chunk proxy -> ingress replica -> model replica, two Ray hops
and three processes per token. With one model, the ingress adapters can run in the model
replica's process over the engine directly: the proxy is the only hop left. On a small
machine that CPU goes back to decoding (load/RESULTS.md, issue 2).
"""

from __future__ import annotations

import os
from contextlib import aclosing
from typing import Any, AsyncGenerator, Protocol, Sequence

from fastapi import FastAPI
from ray import serve

from deployments.config import ModelSettings
from deployments.handle_client import at_capacity
from deployments.ingress_deployment import EdgeArgs
from deployments.model_deployment import ReplicaOwner
from deployments.observability import request_observer
from deployments.response_store import response_store
from ingress.app import create_app
from ingress.client import ModelCard
from replicas.contract import ErrorKind, Failed, GenerationRequest, OutputEvent
from replicas.errors import from_event


class LocalReplica(Protocol):
    """What the client needs of `ModelReplica`."""

    def stream(self, request: GenerationRequest) -> AsyncGenerator[list[OutputEvent], None]: ...
    async def count_tokens(self, request: GenerationRequest) -> int | Failed: ...


class LocalModelClient:
    """The ingress's ModelClient over the replica in this process.

    Admission is here, not in Serve's queue: past `max_ongoing` live streams a request gets
    the API's own overloaded error (529 / 503 with Retry-After) instead of waiting behind
    Ray's router, as the handle client does with Serve's backpressure.
    """

    def __init__(self, replica: LocalReplica, card: ModelCard, max_ongoing: int) -> None:
        self._replica = replica
        self._card = card
        self._max_ongoing = max_ongoing
        self._live = 0

    @property
    def live(self) -> int:
        return self._live

    def models(self) -> Sequence[ModelCard]:
        return [self._card]

    def resolve(self, model: str) -> ModelCard | None:
        return self._card if model in (self._card.id, *self._card.aliases) else None

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[list[OutputEvent], None]:
        if self._live >= self._max_ongoing:
            yield [Failed(ErrorKind.OVERLOADED, at_capacity(request.model))]
            return
        self._live += 1
        try:
            # Closed with us, not when collected: closing the replica's stream cancels.
            async with aclosing(self._replica.stream(request)) as events:
                async for batch in events:
                    yield batch
        finally:
            self._live -= 1

    async def count_tokens(self, request: GenerationRequest) -> int:
        result = await self._replica.count_tokens(request)
        if isinstance(result, Failed):
            raise from_event(result)
        return result


@serve.deployment
@serve.ingress()
class ColocatedModel(ReplicaOwner):
    def __init__(self, settings: dict[str, Any], card: dict[str, Any],
                 edge: EdgeArgs = EdgeArgs()) -> None:
        config = ModelSettings.model_validate(settings)
        super().__init__(config, edge.ingress.max_stops, edge.observability)
        self._client = LocalModelClient(self._replica, ModelCard(**card),
                                        config.max_ongoing_requests)
        self._options = edge.options(os.environ)
        scaled = config.autoscaling_config is not None
        self._store = response_store("auto" if scaled else config.num_replicas)
        self._observer = request_observer(edge.observability)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Built in the replica, after __init__, so the app holds this replica's engine.
        return create_app(self._client, self._options, response_store=self._store,
                          observer=self._observer)
