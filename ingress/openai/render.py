"""Replica events -> OpenAI response bodies and stream chunks.

One `ResponseBuilder` serves both paths: streaming renders a chunk per delta as events
arrive, non-streaming feeds every event and renders the body at the end, so the two cannot
disagree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from replicas.contract import Channel, Finished, FinishReason, OutputEvent, TextDelta, Usage

# The one table from finish reasons to OpenAI's finish_reason.
FINISH_REASON = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.GRAMMAR_COMPLETE: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",
}

Kind = Literal["chat", "completion"]


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
    }


class ResponseBuilder:
    def __init__(self, meta: ResponseMeta, include_usage: bool = False) -> None:
        self.meta = meta
        self._include_usage = include_usage
        self._answer: list[str] = []
        self._reasoning: list[str] = []
        self.finished: Finished | None = None
        self._sent_role = False

    # ---- streaming ----------------------------------------------------------------------

    def feed(self, event: OutputEvent) -> list[dict[str, Any]]:
        """Chunks for one event (a Failed event is the caller's to render)."""
        chunks: list[dict[str, Any]] = []
        if self.meta.kind == "chat" and not self._sent_role:
            self._sent_role = True
            chunks.append(self._chunk({"role": "assistant", "content": ""}))
        if isinstance(event, TextDelta) and event.text:
            if event.channel is Channel.ANSWER:
                self._answer.append(event.text)
                chunks.append(self._text_chunk("content", event.text))
            else:
                self._reasoning.append(event.text)
                chunks.append(self._text_chunk("reasoning_content", event.text))
        elif isinstance(event, Finished):
            self.finished = event
            chunks.append(self._final_chunk(event))
            if self._include_usage:
                chunks.append(self._usage_chunk(event.usage))
        return chunks

    def _base(self, obj: str) -> dict[str, Any]:
        base: dict[str, Any] = {
            "id": self.meta.id, "object": obj, "created": self.meta.created, "model": self.meta.model,
        }
        if self._include_usage:
            base["usage"] = None
        return base

    def _chunk(self, delta: dict[str, Any], finish: Finished | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
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

    def _text_chunk(self, field: str, text: str) -> dict[str, Any]:
        if self.meta.kind == "completion":
            return self._chunk({"content": text})
        return self._chunk({field: text})

    def _final_chunk(self, finished: Finished) -> dict[str, Any]:
        return self._chunk({}, finished)

    def _usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.meta.kind == "chat" else "text_completion"
        body = self._base(obj)
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body

    # ---- non-streaming ------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        finished = self.finished
        assert finished is not None, "body() before the terminal event"
        answer = "".join(self._answer)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, **_finish_fields(finished)}
        if self.meta.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": answer}
            if self._reasoning:
                message["reasoning_content"] = "".join(self._reasoning)
            choice = {"index": 0, "message": message, **{k: v for k, v in choice.items() if k != "index"}}
            obj = "chat.completion"
        else:
            choice["text"] = answer
            obj = "text_completion"
        return {
            "id": self.meta.id,
            "object": obj,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [choice],
            "usage": usage_body(finished.usage),
        }


def _finish_fields(finished: Finished) -> dict[str, Any]:
    # matched_stop (SGLang) and stop_reason (vLLM) both carry the user's stop string, or the
    # stop token id; clients read either.
    stop = finished.stop if finished.reason in (FinishReason.STOP_SEQUENCE, FinishReason.STOP_TOKEN) else None
    return {"finish_reason": FINISH_REASON[finished.reason], "matched_stop": stop, "stop_reason": stop}
