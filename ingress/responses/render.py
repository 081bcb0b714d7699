"""Replica events -> a Responses API `response` object and its stream events.

`ResponseRenderer` is the one mapping: `start()`, then `feed()` per event, then `finish()`,
each returning the stream events they cause (numbered by `sequence_number`). The same
calls build `response`, the non-streaming body, so streamed deltas always add up to it.
Output items open as events arrive: a `reasoning` item for reasoning text, a `message` for
the answer, one `function_call` per tool call, in the order the model wrote them.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from ingress.logprobs import chat_content
from ingress.protocol import WARNINGS_FIELD
from ingress.rendering import EventRenderer
from ingress.sse import event_frame
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)

Event = dict[str, Any]

# The documented `response.error.code`s: a bad prompt, or the server's fault.
_ERROR_CODE = {ErrorKind.INVALID_REQUEST: "invalid_prompt",
               ErrorKind.CONTEXT_LENGTH: "invalid_prompt"}



def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


@dataclass
class _Item:
    """An output item being streamed: its body in `output`, its text so far."""

    index: int
    body: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's, if asked

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ResponseRenderer(EventRenderer[Event]):
    def __init__(self, response_id: str, model: str, echo: Mapping[str, Any], *,
                 reasoning_summary: bool = False, warnings: tuple[str, ...] = ()) -> None:
        self._response: dict[str, Any] = {
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "error": None,
            "incomplete_details": None, "usage": None, **echo,
        }
        if warnings:
            self._response[WARNINGS_FIELD] = list(warnings)
        self._summary = reasoning_summary
        self._sequence = 0
        self._open: _Item | None = None  # the reasoning or message item being written
        self._calls: dict[int, _Item] = {}  # tool call index -> its open function_call

    @property
    def response(self) -> dict[str, Any]:
        """The response object; complete once a terminal event was fed."""
        return self._response

    def body(self) -> dict[str, Any]:
        return self._response

    def frame(self, item: Event) -> str:
        return event_frame(item["type"], item)

    def start(self) -> list[Event]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    # ---- text items -----------------------------------------------------------------

    def _text(self, delta: TextDelta) -> list[Event]:
        kind = "message" if delta.channel is Channel.ANSWER else "reasoning"
        if not delta.text and (self._open is None or self._open.body["type"] != kind):
            return []  # logprobs of tokens that wrote no text here (a call's markup)
        events: list[Event] = []
        if self._open is None or self._open.body["type"] != kind:
            events += self._close_text("completed")
            events += self._open_message() if kind == "message" else self._open_reasoning()
        item = self._open
        assert item is not None
        item.parts.append(delta.text)
        where = self._where(item)
        if kind == "message":
            entries = chat_content(delta.logprobs)
            item.logprobs += entries
            events.append(self._event("response.output_text.delta", **where, content_index=0,
                                      delta=delta.text, logprobs=entries))
        elif self._summary:
            events.append(self._event("response.reasoning_summary_text.delta", **where,
                                      summary_index=0, delta=delta.text))
        else:
            events.append(self._event("response.reasoning_text.delta", **where,
                                      content_index=0, delta=delta.text))
        return events

    def _open_message(self) -> list[Event]:
        item = self._add({"type": "message", "id": f"msg_{uuid.uuid4().hex}",
                          "role": "assistant", "status": "in_progress", "content": []})
        self._open = item
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._added(item), self._event("response.content_part.added",
                                                **self._where(item), content_index=0, part=part)]

    def _open_reasoning(self) -> list[Event]:
        item = self._add({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                          **({} if self._summary else {"content": []})})
        self._open = item
        added = self._added(item)
        if self._summary:
            part = {"type": "summary_text", "text": ""}
            opened = self._event("response.reasoning_summary_part.added", **self._where(item),
                                 summary_index=0, part=part)
        else:
            part = {"type": "reasoning_text", "text": ""}
            opened = self._event("response.content_part.added", **self._where(item),
                                 content_index=0, part=part)
        return [added, opened]

    def _close_text(self, status: str, *, events: bool = True) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        text, where = item.text, self._where(item)
        body = item.body
        if body["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [],
                    "logprobs": item.logprobs}
            body.update(content=[part], status=status)
            closing = [
                self._event("response.output_text.done", **where, content_index=0, text=text,
                            logprobs=item.logprobs),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ] if events else []
        elif self._summary:
            part = {"type": "summary_text", "text": text}
            body.update(summary=[part])
            closing = [
                self._event("response.reasoning_summary_text.done", **where, summary_index=0,
                            text=text),
                self._event("response.reasoning_summary_part.done", **where, summary_index=0,
                            part=part),
            ] if events else []
        else:
            part = {"type": "reasoning_text", "text": text}
            body.update(content=[part])
            closing = [
                self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ] if events else []
        return closing + ([self._done(item)] if events else [])

    # ---- function calls --------------------------------------------------------------

    def _call_start(self, start: ToolCallStart) -> list[Event]:
        events = self._close_text("completed")
        item = self._add({"type": "function_call", "id": f"fc_{start.id}",
                          "call_id": f"call_{start.id}", "name": start.name, "arguments": "",
                          "status": "in_progress"})
        self._calls[start.index] = item
        return events + [self._added(item)]

    def _call_delta(self, delta: ToolCallDelta) -> list[Event]:
        item = self._calls.get(delta.index)
        if item is None or not delta.arguments:
            return []
        item.parts.append(delta.arguments)
        return [self._event("response.function_call_arguments.delta", **self._where(item),
                            delta=delta.arguments)]

    def _call_end(self, end: ToolCallEnd) -> list[Event]:
        item = self._calls.pop(end.index, None)
        if item is None:
            return []
        item.parts = [end.arguments]  # the contract's whole text, equal to the deltas joined
        return self._close_call(item, "completed")

    def _close_call(self, item: _Item, status: str) -> list[Event]:
        item.body.update(arguments=item.text, status=status)
        return [self._event("response.function_call_arguments.done", **self._where(item),
                            name=item.body["name"], arguments=item.text), self._done(item)]

    # ---- the end -----------------------------------------------------------------------

    def _finished(self, finished: Finished) -> list[Event]:
        complete = finished.reason is not FinishReason.LENGTH
        status = "completed" if complete else "incomplete"
        events = self._close_text(status)
        for index in sorted(self._calls):  # cut off by the length limit mid-call
            events += self._close_call(self._calls.pop(index), "incomplete")
        self._response.update(status=status, usage=usage_body(finished.usage),
                              completed_at=int(time.time()))
        if not complete:
            self._response["incomplete_details"] = {"reason": "max_output_tokens"}
        if finished.warnings:
            self._response[WARNINGS_FIELD] = [*self._response.get(WARNINGS_FIELD, []),
                                              *finished.warnings]
        return events + [self._lifecycle(f"response.{status}")]

    def _failed(self, failed: Failed) -> list[Event]:
        # Items stay as far as they got, without their closing events.
        self._close_text("in_progress", events=False)
        for item in self._calls.values():
            item.body.update(arguments=item.text)
        self._calls.clear()
        code = _ERROR_CODE.get(failed.kind, "server_error")
        self._response.update(status="failed", error={"code": code, "message": failed.message})
        return [self._lifecycle("response.failed")]

    # ---- helpers -----------------------------------------------------------------------

    def _add(self, body: dict[str, Any]) -> _Item:
        self._response["output"].append(body)
        return _Item(len(self._response["output"]) - 1, body)

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.body["id"], "output_index": item.index}

    def _added(self, item: _Item) -> Event:
        return self._event("response.output_item.added", output_index=item.index,
                           item=copy.deepcopy(item.body))

    def _done(self, item: _Item) -> Event:
        return self._event("response.output_item.done", output_index=item.index,
                           item=copy.deepcopy(item.body))

    def _lifecycle(self, kind: str) -> Event:
        return self._event(kind, response=copy.deepcopy(self._response))

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
