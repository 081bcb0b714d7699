"""The per-request output pipeline: token ids in, output events out.

detokenizer -> channel router (one `ChannelTracker` per request, shared with its
controller) -> stop matcher (answer channel only) -> TextDelta events, and, with tool
parsing on, the router's TOOL channel -> tool-call parser -> ToolCall* events. Like each
stage it is `feed()` plus `finish()`; non-streaming is the same calls.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from replicas.contract import (
    Channel,
    Finished,
    FinishReason,
    OutputEvent,
    TextDelta,
    ToolCallStart,
    Usage,
)
from replicas.families.channel_format import ChannelFormat
from replicas.pipeline.channels import Routed
from replicas.pipeline.detokenizer import Decode
from replicas.pipeline.stops import StopMatcher
from replicas.pipeline.tool_calls.parser import ToolCallParser, ToolParsing
from replicas.pipeline.tracker import ChannelTracker

_log = logging.getLogger(__name__)

# A turn that ends by itself after a call ended to let the tools run.
_CALL_ENDINGS = (FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.GRAMMAR_COMPLETE)


class RequestDecoder:
    """One request's output pipeline.

    `tools`: None keeps tool-call markup as plain text. With a `ToolParsing` (e.g.
    `ToolParsing.from_specs(get_tool_format(name), request.tools)`), `fmt` must already be
    composed with its tool format (`compose.with_tools`, done once per request by
    `replicas.pipeline.prepare`); each call's text leaves as ToolCallStart/Delta/End events and
    never reaches the stop matcher, text after the first call is dropped (the contract's
    event order), and a turn that ends by itself after a call finishes with
    `FinishReason.TOOL_CALLS`. A `RequestController` for the same request routes with the
    same composed format, and `tracker` (the request's `ChannelTracker`, else one of its
    own) so each token is detokenized and routed once for both.
    """

    def __init__(
        self,
        decode: Decode,
        fmt: ChannelFormat,
        initial: Channel,
        state: str | None,
        stops: tuple[str, ...],
        include_stop: bool,
        prompt_tokens: int,
        tools: ToolParsing | None = None,
        tracker: ChannelTracker | None = None,
    ) -> None:
        self._tracker = tracker or ChannelTracker(decode, fmt, initial, state)
        self._cursor = self._tracker.cursor()
        self._router = self._tracker.router
        self._stops = StopMatcher(stops, include_stop)
        self._calls = ToolCallParser(tools) if tools is not None else None
        self._answer_closed = False  # a call started: no more text, stops are done
        self._dropped = False
        self._prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.reasoning_tokens = 0

    @property
    def matched_stop(self) -> str | None:
        """Set once a stop string completed; the request must end now."""
        return self._stops.matched

    @property
    def tool_calls(self) -> int:
        """How many tool calls have started so far."""
        return self._calls.calls if self._calls is not None else 0

    def count(self, token_id: int) -> None:
        """A generated token that produces no text (EOS, a stop token id)."""
        del token_id
        self.completion_tokens += 1

    def feed(self, token_id: int) -> list[OutputEvent]:
        self.completion_tokens += 1
        routing = self._cursor.read(token_id)
        events = self._route(routing.pieces)
        # A token that opens or closes reasoning, or sits inside it, is a reasoning token.
        if Channel.REASONING in (routing.before, routing.after):
            self.reasoning_tokens += 1
        return events

    def finish(self, reason: FinishReason, stop: str | int | None = None,
               cached_tokens: int = 0, preemptions: int = 0) -> list[OutputEvent]:
        """`cached_tokens`: prompt tokens the prefix cache served, `preemptions`: times the
        request left the batch for KV memory (the engine knows both)."""
        events: list[OutputEvent] = []
        if self._stops.matched is None and reason is not FinishReason.CANCELLED:
            tracker = self._tracker
            events = self._route(self._router.feed_with_calls(tracker.detokenizer.finish()))
            if self._stops.matched is None:
                if self._calls is None:
                    events.extend(self._answer_or_reasoning(self._router.finish()))
                else:
                    events.extend(self._dispatch(self._router.finish_with_calls()))
                    if self._stops.matched is None:
                        events.extend(self._tool_events(self._calls.finish()))
            if self._stops.matched is None and not self._answer_closed:
                tail = self._stops.finish(reason)
                if tail:
                    events.append(TextDelta(Channel.ANSWER, tail))
        if self._stops.matched is not None:
            reason, stop = FinishReason.STOP_SEQUENCE, self._stops.matched
        elif self.tool_calls and reason in _CALL_ENDINGS:
            reason = FinishReason.TOOL_CALLS
        usage = Usage(self._prompt_tokens, self.completion_tokens, self.reasoning_tokens,
                      cached_tokens, preemptions)
        events.append(Finished(reason, usage, stop))
        return _merge(events)

    def _route(self, pieces: Sequence[Routed]) -> list[OutputEvent]:
        if not pieces or self._stops.matched is not None:
            return []
        if self._calls is None:  # no tool states: the router gives text pieces only
            return self._answer_or_reasoning([p for p in pieces if isinstance(p, TextDelta)])
        return self._dispatch(pieces)

    def _answer_or_reasoning(self, pieces: list[TextDelta]) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for piece in pieces:
            if piece.channel is not Channel.ANSWER:
                events.append(piece)
                continue
            out = self._stops.feed(piece.text)
            if out.text:
                events.append(TextDelta(Channel.ANSWER, out.text))
            if out.matched is not None:
                break  # nothing after a stop is ever emitted, in any channel
        return events

    def _dispatch(self, pieces: Sequence[Routed]) -> list[OutputEvent]:
        """Router output with tool parsing on: TOOL text and boundaries to the parser."""
        assert self._calls is not None
        events: list[OutputEvent] = []
        for piece in pieces:
            if isinstance(piece, TextDelta) and piece.channel is not Channel.TOOL:
                events.extend(self._text(piece))
            else:
                events.extend(self._tool_events(self._calls.feed(
                    piece.text if isinstance(piece, TextDelta) else piece
                )))
            if self._stops.matched is not None:
                break
        return events

    def _tool_events(self, events: list[OutputEvent]) -> list[OutputEvent]:
        """The parser's events; its text (malformed markup) is answer text like any other."""
        out: list[OutputEvent] = []
        for event in events:
            if isinstance(event, TextDelta):
                out.extend(self._text(event))
                if self._stops.matched is not None:
                    break
                continue
            if isinstance(event, ToolCallStart) and not self._answer_closed:
                # The answer can only end here: a held possible stop prefix is answer text.
                self._answer_closed = True
                tail = self._stops.finish(FinishReason.EOS)
                if tail:
                    out.append(TextDelta(Channel.ANSWER, tail))
            out.append(event)
        return out

    def _text(self, piece: TextDelta) -> list[OutputEvent]:
        if self._answer_closed:  # the contract: all text comes before the first call
            if piece.text.strip() and not self._dropped:
                self._dropped = True  # once per request: a runaway model must not flood the log
                _log.warning("%s text after a tool call is dropped", piece.channel.value)
            return []
        return self._answer_or_reasoning([piece])


def _merge(events: list[OutputEvent]) -> list[OutputEvent]:
    """Join adjacent deltas of one channel, so a flush does not become many tiny chunks.
    Tool-call events are never merged: each one is its own protocol event."""
    merged: list[OutputEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if (isinstance(event, TextDelta) and isinstance(last, TextDelta)
                and last.channel is event.channel):
            merged[-1] = TextDelta(event.channel, last.text + event.text)
        else:
            merged.append(event)
    return merged
