"""The ingress's ModelClient over Ray Serve deployment handles."""

from __future__ import annotations

from typing import AsyncIterator, Sequence

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from ingress.client import ModelCard
from replicas.contract import Failed, GenerationRequest, OutputEvent, is_terminal
from replicas.errors import InternalError, OverloadedError, error_for


class RayModelClient:
    def __init__(self, cards: Sequence[ModelCard], handles: dict[str, DeploymentHandle]) -> None:
        self._cards = list(cards)
        self._by_name = {name: card for card in cards for name in (card.id, *card.aliases)}
        # Streaming handles are built once per model; options() is not free.
        self._streams = {mid: h.options(stream=True) for mid, h in handles.items()}
        self._calls = handles

    def models(self) -> Sequence[ModelCard]:
        return self._cards

    def resolve(self, model: str) -> ModelCard | None:
        return self._by_name.get(model)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        gen = self._streams[request.model].stream.remote(request)
        done = False
        try:
            async for batch in gen:
                done = any(is_terminal(e) for e in batch)
                yield batch
        except BackPressureError as exc:
            raise OverloadedError(f"the model '{request.model}' is at capacity; retry later") from exc
        except (RayActorError, RayTaskError) as exc:
            raise InternalError(f"the replica serving '{request.model}' failed") from exc
        finally:
            if not done:
                gen.cancel()  # the client left: cancel downstream within a decode step

    async def count_tokens(self, request: GenerationRequest) -> int:
        try:
            result = await self._calls[request.model].count_tokens.remote(request)
        except BackPressureError as exc:
            raise OverloadedError(f"the model '{request.model}' is at capacity") from exc
        if isinstance(result, Failed):
            raise error_for(result.kind, result.message)
        return int(result)
