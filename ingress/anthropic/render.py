"""Replica events -> Anthropic messages, streamed or whole.

`MessageRenderer` is the one mapping: each `feed()` returns the stream events it causes, and
the same calls build the non-streaming message, so concatenated deltas always equal the
non-streamed content. Non-streaming is "start, feed everything, finish, read `message`".
"""

from __future__ import annotations

import copy
from typing import Any

from ingress.errors import Protocol, error_body
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    OutputEvent,
    TextDelta,
)

# An Anthropic stream event: its name (the SSE `event:` line) and its JSON payload.
Frame = tuple[str, dict[str, Any]]

# The one table from replica finish reasons to Anthropic's stop_reason. Only a stop string
# is reported as "stop_sequence": Anthropic has no notion of stop tokens, and a grammar or
# a cancellation ending the answer is a natural end of turn.
STOP_REASONS: dict[FinishReason, str] = {
    FinishReason.EOS: "end_turn",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.STOP_TOKEN: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.GRAMMAR_COMPLETE: "end_turn",
    FinishReason.CANCELLED: "end_turn",
}

_BLOCK_TYPE = {Channel.REASONING: "thinking", Channel.ANSWER: "text"}
_DELTA_TYPE = {"thinking": "thinking_delta", "text": "text_delta"}


def stop_fields(finished: Finished) -> tuple[str, str | None]:
    """`stop_reason` and `stop_sequence` (the user's string) for a finished generation."""
    reason = STOP_REASONS[finished.reason]
    if reason == "stop_sequence" and isinstance(finished.stop, str):
        return reason, finished.stop
    return reason, None


class MessageRenderer:
    def __init__(self, message_id: str, model: str) -> None:
        self._message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            # Prompt tokens are only known once the replica finishes; message_delta has them.
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        self._open: str | None = None  # type of the content block being streamed
        self.failure: Failed | None = None
        self.done = False

    @property
    def message(self) -> dict[str, Any]:
        """The non-streaming response body; complete once a `Finished` event was fed."""
        return self._message

    def start(self) -> list[Frame]:
        message = copy.deepcopy(self._message)
        return [("message_start", {"type": "message_start", "message": message})]

    def feed(self, event: OutputEvent) -> list[Frame]:
        if self.done:
            return []  # the contract ends a stream at its terminal event
        if isinstance(event, TextDelta):
            return self._text(event)
        if isinstance(event, Finished):
            return self._finished(event)
        return self._failed(event)

    def finish(self) -> list[Frame]:
        """End of the event stream; a stream that stopped short of a terminal event failed."""
        if self.done:
            return []
        return self._failed(Failed(ErrorKind.INTERNAL, "the model stream ended unexpectedly"))

    def _text(self, delta: TextDelta) -> list[Frame]:
        if not delta.text:
            return []  # an empty delta must not open an empty block
        kind = _BLOCK_TYPE[delta.channel]
        frames = [] if self._open == kind else self._close_block() + self._open_block(kind)
        index = len(self._message["content"]) - 1
        self._message["content"][index][kind] += delta.text
        frames.append(_delta(index, {"type": _DELTA_TYPE[kind], kind: delta.text}))
        return frames

    def _open_block(self, kind: str) -> list[Frame]:
        # Thinking blocks carry a signature in Anthropic's schema; this server signs nothing.
        block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
        self._message["content"].append(block)
        self._open = kind
        index = len(self._message["content"]) - 1
        start = {"type": "content_block_start", "index": index, "content_block": dict(block)}
        return [("content_block_start", start)]

    def _close_block(self) -> list[Frame]:
        if self._open is None:
            return []
        index = len(self._message["content"]) - 1
        frames: list[Frame] = []
        if self._open == "thinking":
            # Anthropic ends every thinking block with its signature; clients expect the event.
            frames.append(_delta(index, {"type": "signature_delta", "signature": ""}))
        frames.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None
        return frames

    def _finished(self, finished: Finished) -> list[Frame]:
        self.done = True
        reason, sequence = stop_fields(finished)
        usage = {
            "input_tokens": finished.usage.prompt_tokens,
            "output_tokens": finished.usage.completion_tokens,
        }
        self._message.update(stop_reason=reason, stop_sequence=sequence, usage=usage)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return self._close_block() + [
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": dict(usage)}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def _failed(self, failed: Failed) -> list[Frame]:
        # Like Anthropic, a failing stream just ends with an error event; open blocks stay open.
        self.done = True
        self.failure = failed
        return [("error", error_body(failed.kind, failed.message, Protocol.ANTHROPIC))]


def _delta(index: int, delta: dict[str, str]) -> Frame:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
