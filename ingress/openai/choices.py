"""`n > 1`, or several completions prompts: independent generations as one OpenAI response.

Choice `i` is prompt `i // n`'s generation `i % n`, as OpenAI orders them.

`FanOut` starts choice 0 first and the others once its first events arrive: a request the
replica refuses fails once, with its real status, and the others find the prompt's prefix
in the replica's cache. It merges the streams as they come, each event tagged with its
choice (`ChoiceEvent`); `ChoicesRenderer` renders each choice with its own
`CompletionRenderer` (`index` set), so a choice's chunks and body are exactly those of
n = 1. Usage counts the prompt once and sums the completions. One choice failing fails the
response (the others are cancelled).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Sequence, cast

from ingress.client import ModelClient, WrappedClient
from ingress.errors import OPENAI_ERRORS
from ingress.openai.render import Chunk, CompletionRenderer, ResponseMeta, usage_body
from ingress.protocol import WARNINGS_FIELD
from ingress.rendering import EventRenderer
from ingress.sse import data_frame
from replicas.contract import (
    Failed,
    Finished,
    GenerationRequest,
    OutputEvent,
    Prompt,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    is_terminal,
)

MAX_CHOICES = 8  # `n` above this is a 400: each choice is a full generation
# Prompts in one completions request (evaluation harnesses batch them); with `n`, their
# choices together are bounded the same way.
MAX_PROMPTS = 64


@dataclass(frozen=True)
class ChoiceEvent:
    """One choice's event. It travels through the shared stream loop (`ingress.streaming`)
    as an opaque item that only `ChoicesRenderer` reads."""

    index: int
    event: OutputEvent


class FanOut(WrappedClient):
    """The inner client, each `stream` run `n` times per prompt (request ids `ID-0` ..);
    `prompts`: the request's prompts, when there are several. `warnings` go into every
    choice's `Finished` (the shared loop sees raw events only)."""

    def __init__(self, inner: ModelClient, n: int, warnings: tuple[str, ...] = (),
                 prompts: Sequence[Prompt] = ()) -> None:
        super().__init__(inner)
        self._per_prompt = n
        self._prompts = tuple(prompts)
        self._n = n * max(1, len(self._prompts))
        self._warnings = warnings

    def _choice(self, request: GenerationRequest, index: int) -> GenerationRequest:
        prompt = self._prompts[index // self._per_prompt] if self._prompts else request.prompt
        return dataclasses.replace(request, request_id=f"{request.request_id}-{index}",
                                   prompt=prompt)

    def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        return cast(AsyncIterator[list[OutputEvent]], self._merged(request))

    def _tag(self, index: int, events: list[OutputEvent]) -> list[ChoiceEvent]:
        warned = [dataclasses.replace(e, warnings=self._warnings + e.warnings)
                  if self._warnings and isinstance(e, Finished) else e for e in events]
        return [ChoiceEvent(index, e) for e in warned]

    async def _merged(self, request: GenerationRequest
                      ) -> AsyncGenerator[list[ChoiceEvent | OutputEvent], None]:
        streams = [self._inner.stream(self._choice(request, i)).__aiter__()
                   for i in range(self._n)]
        pending: dict[asyncio.Future[list[OutputEvent]], int] = {}
        started = [False] * self._n
        try:
            pending[asyncio.ensure_future(anext(streams[0]))] = 0
            started[0] = True
            while pending:
                ready, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                batch: list[ChoiceEvent | OutputEvent] = []
                for future in ready:
                    index = pending.pop(future)
                    try:
                        events = future.result()
                    except StopAsyncIteration:
                        continue
                    failed = next((e for e in events if isinstance(e, Failed)), None)
                    if failed is not None:  # the whole response fails with it
                        yield [failed]
                        return
                    batch.extend(self._tag(index, events))
                    if not any(is_terminal(e) for e in events):
                        pending[asyncio.ensure_future(anext(streams[index]))] = index
                if not all(started):  # choice 0 answered: the rest start now
                    for i in range(1, self._n):
                        started[i] = True
                        pending[asyncio.ensure_future(anext(streams[i]))] = i
                if batch:
                    yield batch
        finally:
            for future in pending:
                future.cancel()
            if pending:
                await asyncio.wait(pending)
            for stream in streams:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()


class ChoicesRenderer(EventRenderer[Chunk]):
    """n choices, one `CompletionRenderer` each; done once every choice has finished."""

    def __init__(self, meta: ResponseMeta, n: int, include_usage: bool = False, *,
                 logprobs: bool = False, prompts: int = 1) -> None:
        """`n` choices per prompt, `prompts` prompts."""
        self.meta = meta
        self._include_usage = include_usage
        self._per_prompt = n
        n *= prompts
        self._choices = [CompletionRenderer(meta, include_usage, logprobs=logprobs, index=i,
                                            usage_chunk=False) for i in range(n)]

    def feed(self, event: OutputEvent | ChoiceEvent) -> list[Chunk]:  # type: ignore[override]
        if self.done:
            return []
        if not isinstance(event, ChoiceEvent):
            return super().feed(event)  # a failure of the whole response
        choice = self._choices[event.index]
        chunks = choice.feed(event.event)
        if choice.failure is not None:
            self.done, self.failure = True, choice.failure
        elif all(c.finished is not None for c in self._choices):
            self.done = True
            if self._include_usage:
                chunks.append(self._choices[0].usage_chunk(self._usage()))
        return chunks

    def frame(self, item: Chunk) -> str:
        return data_frame(item)

    def _usage(self) -> Usage:
        ends = [c.finished for c in self._choices if c.finished is not None]
        # Each prompt once (its first choice's count), every completion.
        firsts = ends[::self._per_prompt]
        return Usage(sum(e.usage.prompt_tokens for e in firsts),
                     sum(e.usage.completion_tokens for e in ends),
                     sum(e.usage.reasoning_tokens for e in ends),
                     sum(e.usage.cached_tokens for e in firsts))

    def body(self) -> dict[str, Any]:
        chat = self.meta.kind == "chat"
        body: dict[str, Any] = {
            "id": self.meta.id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [c.choice() for c in self._choices],
            "usage": usage_body(self._usage()),
        }
        warnings = list(dict.fromkeys(w for c in self._choices if c.finished is not None
                                      for w in c.finished.warnings))
        if warnings:
            body[WARNINGS_FIELD] = warnings
        return body

    # Raw events other than a failure never reach this renderer: `feed` takes ChoiceEvents.
    def _text(self, delta: TextDelta) -> list[Chunk]:
        return []

    def _call_start(self, start: ToolCallStart) -> list[Chunk]:
        return []

    def _call_delta(self, delta: ToolCallDelta) -> list[Chunk]:
        return []

    def _call_end(self, end: ToolCallEnd) -> list[Chunk]:
        return []

    def _finished(self, finished: Finished) -> list[Chunk]:
        return []

    def _failed(self, failed: Failed) -> list[Chunk]:
        return [OPENAI_ERRORS.error_body(failed.kind, failed.message, failed.param)]
