"""The per-request output pipeline: token ids in, output events out.

detokenizer -> channel router -> stop matcher (answer channel only) -> TextDelta events.
Like each stage it is `feed()` plus `finish()`; non-streaming is the same calls.
"""

from __future__ import annotations

from replicas.contract import Channel, Finished, FinishReason, OutputEvent, TextDelta, Usage
from replicas.detokenizer import Decode, Detokenizer
from replicas.pipeline.channels import ChannelFormat, ChannelRouter
from replicas.pipeline.stops import StopMatcher


class RequestDecoder:
    def __init__(
        self,
        decode: Decode,
        fmt: ChannelFormat,
        initial: Channel,
        state: str | None,
        stops: tuple[str, ...],
        include_stop: bool,
        prompt_tokens: int,
    ) -> None:
        self._detok = Detokenizer(decode)
        self._router = ChannelRouter(fmt, initial, state=state)
        self._stops = StopMatcher(stops, include_stop)
        self._prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.reasoning_tokens = 0

    @property
    def matched_stop(self) -> str | None:
        """Set once a stop string completed; the request must end now."""
        return self._stops.matched

    def count(self, token_id: int) -> None:
        """A generated token that produces no text (EOS, a stop token id)."""
        del token_id
        self.completion_tokens += 1

    def feed(self, token_id: int) -> list[OutputEvent]:
        self.completion_tokens += 1
        before = self._router.channel
        events = self._route(self._detok.feed(token_id))
        # A token that opens or closes reasoning, or sits inside it, is a reasoning token.
        if Channel.REASONING in (before, self._router.channel):
            self.reasoning_tokens += 1
        return events

    def finish(self, reason: FinishReason, stop: str | int | None = None) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        if self._stops.matched is None and reason is not FinishReason.CANCELLED:
            events = self._route(self._detok.finish())
            if self._stops.matched is None:
                events.extend(self._answer_or_reasoning(self._router.finish()))
            if self._stops.matched is None:
                tail = self._stops.finish(reason)
                if tail:
                    events.append(TextDelta(Channel.ANSWER, tail))
        if self._stops.matched is not None:
            reason, stop = FinishReason.STOP_SEQUENCE, self._stops.matched
        usage = Usage(self._prompt_tokens, self.completion_tokens, self.reasoning_tokens)
        events.append(Finished(reason, usage, stop))
        return _merge(events)

    def _route(self, text: str) -> list[OutputEvent]:
        if not text or self._stops.matched is not None:
            return []
        return self._answer_or_reasoning(self._router.feed(text))

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


def _merge(events: list[OutputEvent]) -> list[OutputEvent]:
    """Join adjacent deltas of one channel, so a flush does not become many tiny chunks."""
    merged: list[OutputEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if (isinstance(event, TextDelta) and isinstance(last, TextDelta)
                and last.channel is event.channel):
            merged[-1] = TextDelta(event.channel, last.text + event.text)
        else:
            merged.append(event)
    return merged
