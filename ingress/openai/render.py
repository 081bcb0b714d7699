"""Replica events -> OpenAI response bodies and stream chunks.

One `CompletionRenderer` serves both paths: streaming renders a chunk per delta as events
arrive, non-streaming feeds every event and renders the body at the end, so the two cannot
disagree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from ingress.errors import OPENAI_ERRORS
from ingress.logprobs import CompletionLogprobs, chat_logprobs
from ingress.protocol import WARNINGS_FIELD
from ingress.rendering import EventRenderer
from ingress.sse import data_frame
from replicas.contract import (
    Channel,
    Failed,
    Finished,
    FinishReason,
    OutputEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    TokenLogprob,
    Usage,
)

# The one table from finish reasons to OpenAI's finish_reason.
FINISH_REASON = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.GRAMMAR_COMPLETE: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",
    FinishReason.TOOL_CALLS: "tool_calls",
}

Kind = Literal["chat", "completion"]
Chunk = dict[str, Any]  # a stream chunk, or the error body that ends a failed stream


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    model: str
    created: int
    kind: Kind

    @classmethod
    def new(cls, request_id: str, model: str, kind: Kind) -> "ResponseMeta":
        return cls(request_id, model, int(time.time()), kind)


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def call_id(bare: str) -> str:
    """The wire id of a call the model made (the replica's ids are bare)."""
    return f"call_{bare}"


class CompletionRenderer(EventRenderer[Chunk]):
    """One choice. `logprobs`: the request asked for them (the body then has the object
    even when empty); `index`, `usage_chunk`: a choice of an n > 1 response, whose usage
    chunk `ChoicesRenderer` sends once for all."""

    def __init__(self, meta: ResponseMeta, include_usage: bool = False, *,
                 logprobs: bool = False, index: int = 0, usage_chunk: bool = True) -> None:
        self.meta = meta
        self._include_usage = include_usage
        self._logprobs = logprobs
        self._index = index
        self._usage_chunk_wanted = usage_chunk
        self._entries: list[TokenLogprob] = []  # the answer's token logprobs, for the body
        self._offsets = CompletionLogprobs()  # completions' text_offset across chunks
        self._answer: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}  # message.tool_calls by call index
        self._end: Finished | None = None  # the terminal event, for the body
        self._sent_role = False

    # ---- streaming ----------------------------------------------------------------------

    def feed(self, event: OutputEvent) -> list[Chunk]:
        if self.done or self._sent_role or self.meta.kind != "chat" or isinstance(event, Failed):
            return super().feed(event)
        # A chat stream's first chunk names the role, whatever event opens it.
        self._sent_role = True
        if isinstance(event, ToolCallStart):
            # A turn that opens with a call has no content, as OpenAI streams it.
            return [self._chunk({"role": "assistant", "content": None,
                                 "tool_calls": [self._start_call(event)]})]
        return [self._chunk({"role": "assistant", "content": ""}), *super().feed(event)]

    def frame(self, item: Chunk) -> str:
        return data_frame(item)

    def _text(self, delta: TextDelta) -> list[Chunk]:
        if delta.channel is Channel.ANSWER:
            self._answer.append(delta.text)
            self._entries.extend(delta.logprobs)
            return [self._text_chunk("content", delta.text, delta.logprobs)]
        # Only the answer's tokens are reported (OpenAI's `content`), not reasoning's.
        self._reasoning.append(delta.text)
        return [self._text_chunk("reasoning_content", delta.text)] if delta.text else []

    def _call_start(self, start: ToolCallStart) -> list[Chunk]:
        if self.meta.kind != "chat":
            return []  # completions have no tools
        return [self._chunk({"tool_calls": [self._start_call(start)]})]

    def _call_delta(self, delta: ToolCallDelta) -> list[Chunk]:
        if self.meta.kind != "chat":
            return []
        function = self._calls[delta.index]["function"]
        if not delta.arguments:
            return []
        function["arguments"] += delta.arguments
        piece = {"index": delta.index, "function": {"arguments": delta.arguments}}
        return [self._chunk({"tool_calls": [piece]})]

    def _call_end(self, end: ToolCallEnd) -> list[Chunk]:
        if self.meta.kind != "chat":
            return []
        # The whole text is authoritative for the body; the stream already has every piece.
        self._calls[end.index]["function"]["arguments"] = end.arguments
        return []

    def _finished(self, finished: Finished) -> list[Chunk]:
        self._end = finished
        chunks = [self._final_chunk(finished)]
        if self._include_usage and self._usage_chunk_wanted:
            chunks.append(self.usage_chunk(finished.usage))
        return chunks

    def _failed(self, failed: Failed) -> list[Chunk]:
        # Once a stream's status is sent, its error is the error body as one more chunk.
        return [OPENAI_ERRORS.error_body(failed.kind, failed.message, failed.param)]

    def _start_call(self, start: ToolCallStart) -> dict[str, Any]:
        """Records the call for the body; returns its first stream delta."""
        function = {"name": start.name, "arguments": ""}
        self._calls[start.index] = {"id": call_id(start.id), "type": "function",
                                    "function": function}
        return {"index": start.index, "id": call_id(start.id), "type": "function",
                "function": dict(function)}

    def _base(self, obj: str) -> dict[str, Any]:
        base: dict[str, Any] = {
            "id": self.meta.id, "object": obj, "created": self.meta.created, "model": self.meta.model,
        }
        if self._include_usage:
            base["usage"] = None
        return base

    def _chunk(self, delta: dict[str, Any], finish: Finished | None = None,
               logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self._index, "logprobs": self._render_logprobs(logprobs)
                                  if logprobs else None, "finish_reason": None}
        if self.meta.kind == "chat":
            choice["delta"] = delta
            body = self._base("chat.completion.chunk")
        else:
            choice["text"] = delta.get("content", "")
            body = self._base("text_completion")
        if finish is not None:
            choice.update(_finish_fields(finish))
        body["choices"] = [choice]
        return body

    def _text_chunk(self, field: str, text: str,
                    logprobs: tuple[TokenLogprob, ...] = ()) -> dict[str, Any]:
        if self.meta.kind == "completion":
            return self._chunk({"content": text}, logprobs=logprobs)
        return self._chunk({field: text}, logprobs=logprobs)

    def _render_logprobs(self, entries: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        if self.meta.kind == "chat":
            return chat_logprobs(entries)
        return self._offsets.render(entries)

    def _final_chunk(self, finished: Finished) -> dict[str, Any]:
        return _with_warnings(self._chunk({}, finished), finished)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.meta.kind == "chat" else "text_completion"
        body = self._base(obj)
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body

    # ---- non-streaming ------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        finished = self._end
        assert finished is not None, "body() before the terminal event"
        obj = "chat.completion" if self.meta.kind == "chat" else "text_completion"
        return _with_warnings({
            "id": self.meta.id,
            "object": obj,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [self.choice()],
            "usage": usage_body(finished.usage),
        }, finished)

    @property
    def finished(self) -> Finished | None:
        return self._end

    def choice(self) -> dict[str, Any]:
        """This choice of the body; complete once its `Finished` was fed."""
        finished = self._end
        assert finished is not None, "choice() before the terminal event"
        answer = "".join(self._answer)
        logprobs = None
        if self._logprobs:
            logprobs = chat_logprobs(self._entries) if self.meta.kind == "chat" \
                else CompletionLogprobs().render(self._entries)
        choice: dict[str, Any] = {"index": self._index, "logprobs": logprobs,
                                  **_finish_fields(finished)}
        if self.meta.kind == "chat":
            content = None if self._calls and not answer else answer
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self._reasoning:
                message["reasoning_content"] = "".join(self._reasoning)
            if self._calls:
                message["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
            choice = {"index": self._index, "message": message,
                      **{k: v for k, v in choice.items() if k != "index"}}
        else:
            choice["text"] = answer
        return choice


def _with_warnings(body: dict[str, Any], finished: Finished) -> dict[str, Any]:
    if finished.warnings:
        body[WARNINGS_FIELD] = list(finished.warnings)
    return body


def _finish_fields(finished: Finished) -> dict[str, Any]:
    # matched_stop (SGLang) and stop_reason (vLLM) both carry the user's stop string, or the
    # stop token id; clients read either.
    stop = finished.stop if finished.reason in (FinishReason.STOP_SEQUENCE, FinishReason.STOP_TOKEN) else None
    return {"finish_reason": FINISH_REASON[finished.reason], "matched_stop": stop, "stop_reason": stop}
