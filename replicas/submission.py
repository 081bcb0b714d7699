"""A request as the engine runs it (`Submission`, built by `replicas.prepare` off the
engine thread) and where its events go (`EventSink`, `deliver`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from replicas.contract import OutputEvent, SamplingParams
from replicas.control import RequestController
from replicas.pipeline.decoding import RequestDecoder


class EventSink(Protocol):
    """Where one request's events go; `push` runs on `loop`, never on the engine thread."""

    loop: asyncio.AbstractEventLoop

    def push(self, events: list[OutputEvent]) -> None: ...


@dataclass
class Submission:
    """A validated request, ready for the batch. Built off the engine thread, pure Python."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]  # the user's; EOS ids come from the model
    decoder: RequestDecoder
    controller: RequestController | None
    sink: EventSink
    boundary: int = 0  # prompt tokens before the last message: their KV is kept once prefilled
    reserved: int = 0  # KV bytes set aside at admission (set by the engine)


def deliver(outbox: list[tuple[EventSink, list[OutputEvent]]]) -> None:
    """One thread hop per event loop per step, however many requests it carries."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[EventSink, list[OutputEvent]]]] = {}
    for sink, events in outbox:
        by_loop.setdefault(sink.loop, []).append((sink, events))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_push_all, items)
        except RuntimeError:  # the loop closed: its requests are gone
            pass


def _push_all(items: list[tuple[EventSink, list[OutputEvent]]]) -> None:
    for sink, events in items:
        sink.push(events)
