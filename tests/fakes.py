"""Test doubles for the ingress: a scripted ModelClient and a bare app around one router."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from itertools import pairwise
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ingress.client import ModelCard, ModelClient
from ingress.errors import error_response
from ingress.options import ImageLimits
from ingress.registry import protocol_for
from replicas.contract import (
    Channel,
    EmbeddingRequest,
    EmbeddingResult,
    ErrorKind,
    FinishReason,
    Finished,
    GenerationRequest,
    OutputEvent,
    RerankRequest,
    RerankResult,
    TextDelta,
    TokenizerInfo,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from replicas.errors import ReplicaError

# A script item is an event to yield or an error to raise at that point of the stream.
Step = OutputEvent | ReplicaError
Script = Sequence[Step] | Callable[[GenerationRequest], Sequence[Step]]


def tool_call(index: int, call_id: str, name: str, *pieces: str) -> list[OutputEvent]:
    """One call as the replica emits it: Start, a Delta per piece of the arguments, End.

    `pieces` concatenate to the arguments' JSON text; none means `{}` in one piece. Put the
    calls of a turn after any text and before `Finished(FinishReason.TOOL_CALLS, ...)`.
    """
    pieces = pieces or ("{}",)
    return [
        ToolCallStart(index, call_id, name),
        *(ToolCallDelta(index, piece) for piece in pieces),
        ToolCallEnd(index, "".join(pieces)),
    ]


def one_call_script(usage: Usage) -> list[OutputEvent]:
    """One get_weather call whose arguments arrive in two pieces."""
    return [*tool_call(0, "a1", "get_weather", '{"city": ', '"Paris"}'),
            Finished(FinishReason.TOOL_CALLS, usage)]


def parallel_calls_script(usage: Usage) -> list[OutputEvent]:
    """Reasoning, text, then three calls (one with no arguments), pieces split mid-token."""
    return [
        TextDelta(Channel.REASONING, "Two cities."),
        TextDelta(Channel.ANSWER, "Checking both."),
        *tool_call(0, "a1", "get_weather", '{"city": "Paris"}'),
        *tool_call(1, "b2", "get_weather", '{"ci', 'ty": "Ro', 'me"}'),
        *tool_call(2, "c3", "get_time"),
        Finished(FinishReason.TOOL_CALLS, usage),
    ]


class FakeClient:
    """A ModelClient that replays scripted events; it never matches stops or counts tokens.

    `script` is a list of steps, or a function from the request to one. `cuts` are the
    step indexes where a new batch starts (None: one event per batch). `delay_s` is slept
    before every batch but the first, to make the stream idle. Requests are recorded in
    `requests` (stream) and `counted` (tokenize); `closed_early` counts streams the
    consumer closed before their end, i.e. cancelled generations.
    """

    def __init__(
        self,
        script: Script = (),
        *,
        models: Sequence[ModelCard] = (ModelCard("orchard-tiny", aliases=("tiny",)),),
        cuts: Sequence[int] | None = None,
        delay_s: float = 0.0,
        input_tokens: int = 0,
        embed_error: ReplicaError | None = None,
    ) -> None:
        self._script = script
        self._models = tuple(models)
        self._cuts = cuts
        self._delay_s = delay_s
        self._input_tokens = input_tokens
        self.requests: list[GenerationRequest] = []
        self.embedded: list[EmbeddingRequest] = []
        self.reranked: list[RerankRequest] = []
        self._embed_error = embed_error
        self.counted: list[GenerationRequest] = []
        self.closed_early = 0

    def models(self) -> Sequence[ModelCard]:
        return self._models

    def resolve(self, model: str) -> ModelCard | None:
        return next((c for c in self._models if model == c.id or model in c.aliases), None)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        self.requests.append(request)
        steps = self._script(request) if callable(self._script) else self._script
        completed = False
        try:
            for number, batch in enumerate(_batches(list(steps), self._cuts)):
                if number and self._delay_s:
                    await asyncio.sleep(self._delay_s)
                events: list[OutputEvent] = []
                for step in batch:
                    if isinstance(step, ReplicaError):
                        if events:
                            yield events
                        raise step
                    events.append(step)
                yield events
            completed = True
        finally:
            if not completed:
                self.closed_early += 1

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...]:
        self.counted.append(request)
        return tuple(range(self._input_tokens))

    async def detokenize(self, model: str, token_ids: tuple[int, ...]) -> str:
        return " ".join(f"t{t}" for t in token_ids)

    async def tokenizer_info(self, model: str) -> TokenizerInfo:
        return TokenizerInfo("FakeTokenizer", "<eos>", None, None, "{{ messages }}", 4096, 100)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """`fake_vector(i)` per input (or `dimensions` of it); a text's tokens are its
        characters, token ids count as themselves; `embed_error` is raised instead."""
        self.embedded.append(request)
        if self._embed_error is not None:
            raise self._embed_error
        width = request.dimensions or FAKE_WIDTH
        return EmbeddingResult(tuple(fake_vector(i)[:width] for i in range(len(request.inputs))),
                               sum(len(x) for x in request.inputs))


    async def rerank(self, request: RerankRequest) -> RerankResult:
        """`fake_score` per document (`embed_error` is raised instead); a text's tokens
        are its characters."""
        self.reranked.append(request)
        if self._embed_error is not None:
            raise self._embed_error
        return RerankResult(tuple(fake_score(request.query, d) for d in request.documents),
                            sum(len(request.query) + len(d) for d in request.documents))


def fake_score(query: str, document: str) -> float:
    """The share of the query's words the document holds (FakeClient's relevance)."""
    words = set(query.lower().split())
    return len(words & set(document.lower().split())) / max(len(words), 1)


# FakeClient's vectors: exact in float32 (base64 round-trips them bit for bit).
FAKE_WIDTH = 4


def fake_vector(index: int) -> tuple[float, ...]:
    return (0.5, -0.5, 0.25 * (index + 1), -0.125)


def _batches(steps: list[Step], cuts: Sequence[int] | None) -> list[list[Step]]:
    if cuts is None:
        return [[step] for step in steps]
    bounds = [0, *sorted(cut for cut in cuts if 0 < cut < len(steps)), len(steps)]
    return [steps[start:end] for start, end in pairwise(bounds) if end > start]


def app_for(
    router: APIRouter,
    client: ModelClient,
    validation_message: Callable[[RequestValidationError], str],
) -> FastAPI:
    """A bare app around one router, with the error handling the real app promises.

    `ReplicaError` renders in the protocol chosen by path; malformed bodies are 400
    `invalid_request` (never 422) with `validation_message`'s text.
    """
    app = FastAPI()
    app.state.client = client
    app.state.image_limits = ImageLimits()  # what `create_app` sets from its options
    app.include_router(router)

    @app.exception_handler(ReplicaError)
    async def _replica_error(request: Request, exc: ReplicaError) -> JSONResponse:
        protocol = protocol_for(request.scope)
        return error_response(exc.kind, exc.message, protocol, param=exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        protocol = protocol_for(request.scope)
        return error_response(ErrorKind.INVALID_REQUEST, validation_message(exc), protocol)

    return app


class ScriptedCall:
    """A Ray Serve streaming call as a model client sees it (`handle.method.remote(...)`):
    its answers in order, a float slept before the next, an exception raised where it
    stands; `cancel()` is recorded."""

    def __init__(self, script: Sequence[object]) -> None:
        self._script = list(script)
        self.cancelled = False

    def __aiter__(self) -> "ScriptedCall":
        return self

    async def __anext__(self) -> Any:
        while self._script and isinstance(self._script[0], float):
            await asyncio.sleep(self._script.pop(0))
        if not self._script:
            raise StopAsyncIteration
        item = self._script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True

