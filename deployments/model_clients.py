"""The ingress's two `ModelClient`s: over the replica in this process (`LocalModelClient`,
the colocated layout) and over Ray Serve deployment handles (`RayModelClient`, two hops).

Both turn every failure of the model side into the error taxonomy before the adapters see
it: a proper error status before the first byte, the protocol's error event mid-stream,
never a cut stream. Both answer a full model with the same overloaded message.

`RayModelClient` also survives its replica: a stream whose replica dies, freezes or loses a
shard goes on on another replica (or the replacement), which prefills what was already
sent and continues (`GenerationRequest.resume`), so the client sees one stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Callable, Protocol, Sequence, TypeVar, cast

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from deployments.config import IngressSettings
from deployments.routing.headroom import MemoryShed
from ingress.client import ModelCard, ModelStates
from ingress.errors import ModelLoadingError
from replicas.contract import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorKind,
    Failed,
    GenerationRequest,
    OutputEvent,
    RerankRequest,
    RerankResult,
    TokenIds,
    TokenLogprob,
    TokenizerInfo,
    is_terminal,
)
from replicas.errors import InternalError, OverloadedError, from_event

log = logging.getLogger(__name__)

# Serve queues a request for a deployment with no running replica (its node left, or it is
# still starting) without limit; past this wait the client gets a 503 it can retry. The
# value is the config's default (`ingress.replica_wait_s`), kept there only.
REPLICA_WAIT_S: float | None = IngressSettings.model_fields["replica_wait_s"].default
_STATE_POLL_S = 0.5  # how often a request waiting on a loading model asks again


# The longest pause between tries at a replica that keeps refusing a resumed stream.
_MAX_PAUSE_S = 2.0


@dataclass(frozen=True)
class ResumePolicy:
    """How far a stream may go to outlive its replica (`ingress.resume_*`)."""

    attempts: int = IngressSettings.model_fields["resume_attempts"].default
    wait_s: float = IngressSettings.model_fields["resume_wait_s"].default
    # Between attempts: a dead replica is dropped from Serve's routing a moment after its
    # first failed call, and a replacement needs seconds to load.
    backoff_s: float = 0.5


class LocalReplica(Protocol):
    """What the client needs of `ModelReplica`."""

    def stream(self, request: GenerationRequest) -> AsyncGenerator[list[OutputEvent], None]: ...
    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...] | Failed: ...
    async def detokenize(self, token_ids: tuple[int, ...]) -> str | Failed: ...
    def tokenizer_info(self) -> TokenizerInfo: ...
    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | Failed: ...
    async def rerank(self, request: RerankRequest) -> RerankResult | Failed: ...


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

    def set_cards(self, cards: list[ModelCard]) -> None:
        """The card with the adapters loaded at run time (`deployments/adapter_admin.py`)."""
        self._card = cards[0]

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

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        if self._live >= self._max_ongoing:  # the same admission as a generation
            raise OverloadedError(at_capacity(request.model))
        self._live += 1
        try:
            return _answer(await self._replica.embed(request))
        finally:
            self._live -= 1

    async def rerank(self, request: RerankRequest) -> RerankResult:
        if self._live >= self._max_ongoing:  # the same admission as a generation
            raise OverloadedError(at_capacity(request.model))
        self._live += 1
        try:
            return _answer(await self._replica.rerank(request))
        finally:
            self._live -= 1


class RayModelClient:
    """The ingress's ModelClient over Serve handles: a model by id or alias, a bounded wait
    for a replica to accept, Ray's failures as the taxonomy's."""

    def __init__(self, cards: Sequence[ModelCard], handles: dict[str, DeploymentHandle], *,
                 replica_wait_s: float | None = REPLICA_WAIT_S,
                 resume: ResumePolicy = ResumePolicy(),
                 on_resume: Callable[[str], None] | None = None,
                 states: ModelStates | None = None) -> None:
        """`on_resume(model)`: called once per stream moved to another replica (metrics).
        `states`: which models are still loading (`deployments.model_states`); their
        requests wait for them within `replica_wait_s`, then are refused as loading. None:
        every model is taken as ready."""
        self._cards = list(cards)
        self._states = states
        self._replica_wait_s = replica_wait_s
        self._resume = resume
        self._on_resume = on_resume
        self._by_name = {name: card for card in cards for name in (card.id, *card.aliases)}
        # Streaming handles are built once per model; options() is not free.
        self._streams = {mid: h.options(stream=True) for mid, h in handles.items()}
        self._calls = handles

    def models(self) -> Sequence[ModelCard]:
        return self._cards

    def set_cards(self, cards: list[ModelCard]) -> None:
        """The cards with the adapters loaded at run time (`deployments/adapter_admin.py`):
        swapped whole, so a request reads either the old set or the new."""
        by_name = {name: card for card in cards for name in (card.id, *card.aliases)}
        self._cards, self._by_name = list(cards), by_name

    def resolve(self, model: str) -> ModelCard | None:
        return self._by_name.get(model)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[list[OutputEvent], None]:
        """The request's events, through as many replicas as it takes (`ResumePolicy`).

        A replica that served part of the stream and failed counts against
        `resume_attempts`; one that refused it outright (it failed already, and Serve has
        not replaced it yet) costs only time, with a growing pause, within `resume_wait_s`,
        which starts at the first failure."""
        await self._ready(request.model)
        loop = asyncio.get_running_loop()
        sent = _Sent()
        attempt = dataclasses.replace(request, report_tokens=True)
        resumes, pause = 0, self._resume.backoff_s
        deadline: float | None = None
        while True:
            before = sent.progress()
            # A resume waits for a replica as long as the policy allows: the replacement
            # of the only one takes seconds to load.
            wait = self._replica_wait_s if deadline is None else max(0.0, deadline - loop.time())
            lost = None
            async for item in self._attempt(attempt, sent, wait, resumed=deadline is not None):
                if isinstance(item, _Lost):
                    lost = item
                else:
                    yield item
            if lost is None:
                return
            if deadline is None:
                deadline = loop.time() + self._resume.wait_s
            if sent.progress() != before:  # this replica served some of it, then failed
                resumes, pause = resumes + 1, self._resume.backoff_s
                log.warning("request %s to '%s': its replica failed (%s) after %d tokens",
                            request.request_id, request.model, lost.why, len(sent.ids))
            left = deadline - loop.time()
            if resumes > self._resume.attempts or left <= pause:
                log.warning("request %s to '%s': not resumed (%s; %d resumes, %.0f s left)",
                            request.request_id, request.model, lost.why, resumes, left)
                yield [Failed(ErrorKind.INTERNAL, f"the replica serving '{request.model}' failed")]
                return
            if self._on_resume is not None:
                self._on_resume(request.model)
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_S)
            resume = sent.resume()
            attempt = dataclasses.replace(attempt, resume=resume, resume_logprobs=sent.held)

    async def _attempt(self, request: GenerationRequest, sent: "_Sent", wait_s: float | None,
                       *, resumed: bool) -> AsyncGenerator["list[OutputEvent] | _Lost", None]:
        """One replica's part of a stream: its batches without their token ids (noted in
        `sent`), or `_Lost` when the replica failed under it."""
        # A handle with stream=True answers with a generator; its type does not say so.
        gen = cast(DeploymentResponseGenerator, self._streams[request.model].stream.remote(request))
        done = False
        try:
            if not await self._accepted(gen, wait_s):  # `finally` cancels it, still queued
                if resumed:  # no replica yet (the replacement loads): try again
                    yield _Lost("no replica took the resumed stream")
                else:
                    yield [Failed(ErrorKind.OVERLOADED,
                                  _unplaced(request.model, self._replica_wait_s))]
                return
            async for batch in gen:
                events = sent.take(batch)
                fault = next((i for i, e in enumerate(events)
                              if isinstance(e, Failed) and e.replica_fault), None)
                if fault is not None:  # the replica's own failure: resume elsewhere
                    done = True
                    if fault:  # what it sent before failing is the client's
                        sent.answered = True
                        yield events[:fault]
                    yield _Lost(cast(Failed, events[fault]).message)
                    return
                if events:
                    done = any(is_terminal(e) for e in events)
                    sent.answered = True
                    yield events
        except (BackPressureError, DeploymentUnavailableError) as exc:
            done = True
            if resumed:
                yield _Lost(type(exc).__name__)
            else:
                yield [Failed(ErrorKind.OVERLOADED, _overloaded(request.model, exc))]
        except RayError as exc:  # the replica died or its call failed
            done = True
            _log_failure(request, exc)
            yield _Lost(type(exc).__name__)
        finally:
            if not done:
                gen.cancel()  # the client left: cancel downstream within a decode step

    async def _ready(self, model: str) -> None:
        """Waits, within the replica wait, while no replica of the model runs (it loads, or a
        rolling update restarts it); past the wait, `ModelLoadingError` (the protocol's
        overloaded status with Retry-After), at once where its replicas failed to start. Waiting rather than refusing at once keeps a
        rescale or rolling update free of errors: its requests go on once a replica runs."""
        if self._states is None:
            return
        loop = asyncio.get_running_loop()
        wait_s = self._replica_wait_s
        deadline = None if wait_s is None else loop.time() + wait_s
        while (state := (await self._states.states()).get(model)) in ("loading", "failed"):
            if state == "failed":  # no use waiting: Serve's next try is far off
                raise ModelLoadingError(model, failed=True)
            if deadline is not None and loop.time() >= deadline:
                raise ModelLoadingError(model)
            await asyncio.sleep(_STATE_POLL_S if deadline is None
                                else min(_STATE_POLL_S, max(0.0, deadline - loop.time())))

    async def _accepted(self, gen: DeploymentResponseGenerator, wait_s: float | None) -> bool:
        """Whether a replica took the request (it sends an empty batch first) in time."""
        try:
            await asyncio.wait_for(gen.__anext__(), wait_s)
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

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """One replica's vectors. Streamed like a generation, so the wait for a replica is
        bounded on its "accepted" marker and not on the forwards that follow it."""
        answer = await self._forwards(request.model, "embed", request)
        assert isinstance(answer, EmbeddingResult)
        return answer

    async def rerank(self, request: RerankRequest) -> RerankResult:
        """One replica's scores, streamed as `embed`'s vectors are."""
        answer = await self._forwards(request.model, "rerank", request)
        assert isinstance(answer, RerankResult)
        return answer

    async def _forwards(self, model: str, method: str, request: Any) -> Any:
        """A replica's answer to a forwards-only call (`embed`, `rerank`): its "accepted"
        marker awaited within the replica wait, then the answer."""
        await self._ready(model)
        gen = cast(DeploymentResponseGenerator,
                   getattr(self._streams[model], method).remote(request))
        done = False
        try:
            if not await self._accepted(gen, self._replica_wait_s):
                raise OverloadedError(_unplaced(model, self._replica_wait_s))
            result = await gen.__anext__()
            done = True
        except (BackPressureError, DeploymentUnavailableError) as exc:
            done = True
            raise OverloadedError(_overloaded(model, exc)) from exc
        except RayError as exc:
            done = True
            _log_call_failure(method, model, exc)
            raise InternalError(f"the replica serving '{model}' failed") from exc
        finally:
            if not done:
                gen.cancel()  # refused, or the client left: the replica stops its forwards
        return _answer(result)

    async def _call(self, model: str, method: str, *args: Any) -> Any:
        """One call of a replica's `method` (no stream): its answer, Serve's and Ray's
        failures as the taxonomy's, a `Failed` answer as its error."""
        await self._ready(model)
        response = getattr(self._calls[model], method).remote(*args)
        try:
            result = await asyncio.wait_for(response, self._replica_wait_s)
        except (BackPressureError, DeploymentUnavailableError) as exc:
            raise OverloadedError(_overloaded(model, exc)) from exc
        except TimeoutError as exc:
            response.cancel()
            raise OverloadedError(_unplaced(model, self._replica_wait_s)) from exc
        except RayError as exc:
            _log_call_failure(method, model, exc)
            raise InternalError(f"the replica serving '{model}' failed") from exc
        return _answer(result)


@dataclass(frozen=True)
class _Lost:
    """The replica failed under a stream: why, in a few words."""

    why: str


class _Sent:
    """What a stream's client has received so far: the token ids behind it, and whether
    anything reached it at all (before that, a retry starts over; after, it resumes)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        # The logprob entries the replica still held after the last batch (their text not
        # sent yet): the next replica sends them with its first text.
        self.held: tuple[TokenLogprob, ...] = ()
        self.answered = False

    def take(self, batch: list[OutputEvent]) -> list[OutputEvent]:
        """The batch's events for the client; its token ids are noted here. A batch comes
        whole, so its ids and its events are received together."""
        events: list[OutputEvent] = [e for e in batch if not isinstance(e, TokenIds)]
        if len(events) < len(batch):
            marks = [e for e in batch if isinstance(e, TokenIds)]
            self.ids.extend(i for e in marks for i in e.ids)
            self.held = marks[-1].held
        return events

    def resume(self) -> tuple[int, ...] | None:
        """What the next replica continues from; None starts it over, and then the ids
        sent so far are forgotten, since the next replica sends them again."""
        if not self.answered:
            self.ids.clear()
            self.held = ()
            return None
        return tuple(self.ids)

    def progress(self) -> tuple[int, bool]:
        return len(self.ids), self.answered


_T = TypeVar("_T")


def _answer(result: _T | Failed) -> _T:
    if isinstance(result, Failed):
        raise from_event(result)
    return result


def at_capacity(model: str) -> str:
    return f"the model '{model}' is at capacity; retry later"


def _overloaded(model: str, exc: Exception) -> str:
    if isinstance(exc, MemoryShed):  # the router's: no replica has KV memory for it
        return str(exc)
    if isinstance(exc, BackPressureError):
        return at_capacity(model)
    return f"the model '{model}' has no replica available right now; retry later"


def _unplaced(model: str, wait_s: float | None) -> str:
    return (f"no replica of the model '{model}' took the request within {wait_s:g} s (all "
            "busy, starting, or no node to run on); retry later")


def _log_call_failure(method: str, model: str, exc: RayError) -> None:
    # Ray's text carries the replica's traceback: DEBUG only, as `_log_failure`.
    log.warning("%s on '%s' failed: %s", method, model, type(exc).__name__)
    log.debug("%s on '%s' failure detail: %s", method, model, exc)


def _log_failure(request: GenerationRequest, exc: RayError) -> None:
    # Ray's text carries the replica's traceback and possibly the request: DEBUG only.
    log.warning("request %s to '%s' failed: %s", request.request_id, request.model,
                type(exc).__name__)
    log.debug("request %s failure detail: %s", request.request_id, exc)
