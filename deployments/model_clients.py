"""The ingress's two `ModelClient`s: over the replica in this process (`LocalModelClient`,
the colocated layout) and over Ray Serve deployment handles (`RayModelClient`, two hops).

Both turn every failure of the model side into the error taxonomy before the adapters see
it: a proper error status before the first byte, the protocol's error event mid-stream,
never a cut stream. Both answer a full model with the same overloaded message.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncGenerator, Protocol, Sequence, TypeVar, cast

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from deployments.config import IngressSettings
from ingress.client import ModelCard
from replicas.contract import (
    ErrorKind,
    Failed,
    GenerationRequest,
    OutputEvent,
    TokenizerInfo,
    is_terminal,
)
from replicas.errors import InternalError, OverloadedError, from_event

log = logging.getLogger(__name__)

# Serve queues a request for a deployment with no running replica (its node left, or it is
# still starting) without limit; past this wait the client gets a 503 it can retry. The
# value is the config's default (`ingress.replica_wait_s`), kept there only.
REPLICA_WAIT_S: float | None = IngressSettings.model_fields["replica_wait_s"].default


class LocalReplica(Protocol):
    """What the client needs of `ModelReplica`."""

    def stream(self, request: GenerationRequest) -> AsyncGenerator[list[OutputEvent], None]: ...
    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...] | Failed: ...
    async def detokenize(self, token_ids: tuple[int, ...]) -> str | Failed: ...
    def tokenizer_info(self) -> TokenizerInfo: ...


class LocalModelClient:
    """The ingress's ModelClient over the replica in this process.

    Admission is here, not in Serve's queue: past `max_ongoing` live streams a request gets
    the API's own overloaded error (529 / 503 with Retry-After) instead of waiting behind
    Ray's router, as `RayModelClient` does with Serve's backpressure.
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

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...]:
        return _answer(await self._replica.tokenize(request, add_special_tokens))

    async def detokenize(self, model: str, token_ids: tuple[int, ...]) -> str:
        return _answer(await self._replica.detokenize(token_ids))

    async def tokenizer_info(self, model: str) -> TokenizerInfo:
        return self._replica.tokenizer_info()


class RayModelClient:
    """The ingress's ModelClient over Serve handles: a model by id or alias, a bounded wait
    for a replica to accept, Ray's failures as the taxonomy's."""

    def __init__(self, cards: Sequence[ModelCard], handles: dict[str, DeploymentHandle], *,
                 replica_wait_s: float | None = REPLICA_WAIT_S) -> None:
        self._cards = list(cards)
        self._replica_wait_s = replica_wait_s
        self._by_name = {name: card for card in cards for name in (card.id, *card.aliases)}
        # Streaming handles are built once per model; options() is not free.
        self._streams = {mid: h.options(stream=True) for mid, h in handles.items()}
        self._calls = handles

    def models(self) -> Sequence[ModelCard]:
        return self._cards

    def resolve(self, model: str) -> ModelCard | None:
        return self._by_name.get(model)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[list[OutputEvent], None]:
        # A handle with stream=True answers with a generator; its type does not say so.
        gen = cast(DeploymentResponseGenerator, self._streams[request.model].stream.remote(request))
        done = False
        try:
            if not await self._accepted(gen):
                yield [Failed(ErrorKind.OVERLOADED, _unplaced(request.model, self._replica_wait_s))]
                return  # `finally` cancels the request still queued in the handle
            async for batch in gen:
                if not batch:
                    continue  # the replica's "accepted" marker carries no events
                done = any(is_terminal(e) for e in batch)
                yield batch
        except (BackPressureError, DeploymentUnavailableError) as exc:
            done = True
            yield [Failed(ErrorKind.OVERLOADED, _overloaded(request.model, exc))]
        except RayError as exc:  # the replica died or its call failed
            done = True
            _log_failure(request, exc)
            yield [Failed(ErrorKind.INTERNAL, f"the replica serving '{request.model}' failed")]
        finally:
            if not done:
                gen.cancel()  # the client left: cancel downstream within a decode step

    async def _accepted(self, gen: DeploymentResponseGenerator) -> bool:
        """Whether a replica took the request (it sends an empty batch first) in time."""
        try:
            await asyncio.wait_for(gen.__anext__(), self._replica_wait_s)
        except TimeoutError:
            return False
        return True

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(await self._call(request.model, "tokenize", request, add_special_tokens))

    async def detokenize(self, model: str, token_ids: tuple[int, ...]) -> str:
        return str(await self._call(model, "detokenize", token_ids))

    async def tokenizer_info(self, model: str) -> TokenizerInfo:
        info = await self._call(model, "tokenizer_info")
        assert isinstance(info, TokenizerInfo)
        return info

    async def _call(self, model: str, method: str, *args: Any) -> Any:
        """One call of a replica's `method` (no stream): its answer, Serve's and Ray's
        failures as the taxonomy's, a `Failed` answer as its error."""
        response = getattr(self._calls[model], method).remote(*args)
        try:
            result = await asyncio.wait_for(response, self._replica_wait_s)
        except (BackPressureError, DeploymentUnavailableError) as exc:
            raise OverloadedError(_overloaded(model, exc)) from exc
        except TimeoutError as exc:
            response.cancel()
            raise OverloadedError(_unplaced(model, self._replica_wait_s)) from exc
        except RayError as exc:
            # Ray's text carries the replica's traceback: DEBUG only, as `_log_failure`.
            log.warning("%s on '%s' failed: %s", method, model, type(exc).__name__)
            log.debug("%s on '%s' failure detail: %s", method, model, exc)
            raise InternalError(f"the replica serving '{model}' failed") from exc
        return _answer(result)


_T = TypeVar("_T")


def _answer(result: _T | Failed) -> _T:
    if isinstance(result, Failed):
        raise from_event(result)
    return result


def at_capacity(model: str) -> str:
    return f"the model '{model}' is at capacity; retry later"


def _overloaded(model: str, exc: Exception) -> str:
    if isinstance(exc, BackPressureError):
        return at_capacity(model)
    return f"the model '{model}' has no replica available right now; retry later"


def _unplaced(model: str, wait_s: float | None) -> str:
    return (f"no replica of the model '{model}' took the request within {wait_s:g} s (all "
            "busy, starting, or no node to run on); retry later")


def _log_failure(request: GenerationRequest, exc: RayError) -> None:
    # Ray's text carries the replica's traceback and possibly the request: DEBUG only.
    log.warning("request %s to '%s' failed: %s", request.request_id, request.model,
                type(exc).__name__)
    log.debug("request %s failure detail: %s", request.request_id, exc)
