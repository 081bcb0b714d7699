"""Replica events -> Anthropic messages, streamed or whole.

`MessageRenderer` is the one mapping: each `feed()` returns the stream events it causes, and
the same calls build the non-streaming message, so concatenated deltas always equal the
non-streamed content. Non-streaming is "start, feed everything, finish, read `message`".
Tool calls are `tool_use` blocks whose arguments stream as `input_json_delta` pieces.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ingress.errors import ANTHROPIC_ERRORS
from ingress.protocol import WARNINGS_FIELD
from ingress.rendering import EventRenderer
from ingress.sse import event_frame
from replicas.contract import (
    Channel,
    Failed,
    Finished,
    FinishReason,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
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
    FinishReason.TOOL_CALLS: "tool_use",
}

_BLOCK_TYPE = {Channel.REASONING: "thinking", Channel.ANSWER: "text"}
_DELTA_TYPE = {"thinking": "thinking_delta", "text": "text_delta"}


def stop_fields(finished: Finished) -> tuple[str, str | None]:
    """`stop_reason` and `stop_sequence` (the user's string) for a finished generation."""
    reason = STOP_REASONS[finished.reason]
    if reason == "stop_sequence" and isinstance(finished.stop, str):
        return reason, finished.stop
    return reason, None


def tool_use_id(bare: str) -> str:
    """The wire id of a call the model made (the replica's ids are bare)."""
    return f"toolu_{bare}"


def usage_body(usage: Usage) -> dict[str, int]:
    # Anthropic counts cache reads apart from `input_tokens` (a client adds the two), so
    # the prompt tokens the replica's prefix cache served are only in cache_read.
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """The call's arguments as the object Anthropic sends; {} if they are not one."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageRenderer(EventRenderer[Frame]):
    """`omit_thinking` (`thinking.display: "omitted"`): thinking blocks open and close as
    usual, with a signature, but carry no text and send no `thinking_delta`."""

    def __init__(self, message_id: str, model: str, *, omit_thinking: bool = False) -> None:
        self._message: dict[str, Any] = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": model,
            "stop_reason": None,
            "stop_sequence": None,
            # Prompt tokens are only known once the replica finishes; message_delta has them.
            "usage": usage_body(Usage(0, 0)),
        }
        self._omit_thinking = omit_thinking
        self._open: str | None = None  # type of the content block being streamed
        self._arguments: list[str] = []  # the open tool_use block's input, as JSON pieces

    @property
    def message(self) -> dict[str, Any]:
        """The non-streaming response body; complete once a `Finished` event was fed."""
        return self._message

    def body(self) -> dict[str, Any]:
        return self._message

    def frame(self, item: Frame) -> str:
        return event_frame(*item)

    def start(self) -> list[Frame]:
        message = copy.deepcopy(self._message)
        return [("message_start", {"type": "message_start", "message": message})]

    def _call_start(self, start: ToolCallStart) -> list[Frame]:
        return self._close_block() + self._open_block("tool_use", start)

    def _call_end(self, end: ToolCallEnd) -> list[Frame]:
        if self._open != "tool_use":
            return []
        self._arguments = [end.arguments]  # the whole text is authoritative
        return self._close_block()

    def _text(self, delta: TextDelta) -> list[Frame]:
        if not delta.text:
            return []  # an empty delta must not open an empty block
        kind = _BLOCK_TYPE[delta.channel]
        frames = [] if self._open == kind else self._close_block() + self._open_block(kind)
        if kind == "thinking" and self._omit_thinking:
            return frames
        index = len(self._message["content"]) - 1
        self._message["content"][index][kind] += delta.text
        frames.append(_delta(index, {"type": _DELTA_TYPE[kind], kind: delta.text}))
        return frames

    def _call_delta(self, delta: ToolCallDelta) -> list[Frame]:
        if self._open != "tool_use" or not delta.arguments:
            return []
        self._arguments.append(delta.arguments)
        index = len(self._message["content"]) - 1
        return [_delta(index, {"type": "input_json_delta", "partial_json": delta.arguments})]

    def _open_block(self, kind: str, call: ToolCallStart | None = None) -> list[Frame]:
        block: dict[str, Any]
        if call is not None:
            block = {"type": kind, "id": tool_use_id(call.id), "name": call.name, "input": {}}
            self._arguments = []
        elif kind == "thinking":
            # Thinking blocks carry a signature in Anthropic's schema; this server signs nothing.
            block = {"type": kind, kind: "", "signature": ""}
        else:
            block = {"type": kind, kind: ""}
        self._message["content"].append(block)
        self._open = kind
        index = len(self._message["content"]) - 1
        start = {"type": "content_block_start", "index": index,
                 "content_block": copy.deepcopy(block)}
        return [("content_block_start", start)]

    def _close_block(self) -> list[Frame]:
        if self._open is None:
            return []
        index = len(self._message["content"]) - 1
        frames: list[Frame] = []
        if self._open == "tool_use":
            self._message["content"][index]["input"] = tool_input("".join(self._arguments))
        if self._open == "thinking":
            # Anthropic ends every thinking block with its signature; clients expect the event.
            frames.append(_delta(index, {"type": "signature_delta", "signature": ""}))
        frames.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None
        return frames

    def _finished(self, finished: Finished) -> list[Frame]:
        reason, sequence = stop_fields(finished)
        usage = usage_body(finished.usage)
        self._message.update(stop_reason=reason, stop_sequence=sequence, usage=usage)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        message_delta = {"type": "message_delta", "delta": delta, "usage": dict(usage)}
        if finished.warnings:
            self._message[WARNINGS_FIELD] = message_delta[WARNINGS_FIELD] = list(finished.warnings)
        return self._close_block() + [
            ("message_delta", message_delta),
            ("message_stop", {"type": "message_stop"}),
        ]

    def _failed(self, failed: Failed) -> list[Frame]:
        # Like Anthropic, a failing stream just ends with an error event; open blocks stay open.
        return [("error", ANTHROPIC_ERRORS.error_body(failed.kind, failed.message))]


def _delta(index: int, delta: dict[str, str]) -> Frame:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
