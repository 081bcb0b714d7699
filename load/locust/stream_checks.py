"""What a load-test client saw of one streamed response, and the checks on it.

Pure parsing and checking, no locust: locust monkey-patches the standard library on import,
so `load/locust/locustfile.py` imports this module and the unit tests import it alone
(`tests/unit/test_stream_checks.py`). The readers turn SSE lines of either API into one
`Stream`, so one `check_output` serves both.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CallSeen:
    """One streamed tool call, as its frames arrived."""

    ids: list[str] = field(default_factory=list)  # every id sent for it: exactly one is right
    name: str = ""
    arguments: list[str] = field(default_factory=list)  # the argument pieces, in order


@dataclass
class Stream:
    """What the client saw of one streamed response."""

    start: float
    arrivals: list[float] = field(default_factory=list)  # when each output-carrying frame came
    answer: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, CallSeen] = field(default_factory=dict)  # by the protocol's index
    finish: str | None = None
    output_tokens: int | None = None
    done: bool = False  # the protocol's terminal frame: `[DONE]` or `message_stop`
    error: str | None = None

    def text(self, answer: str, reasoning: str) -> None:
        if answer or reasoning:
            self.arrived()
            self.answer.append(answer)
            self.reasoning.append(reasoning)

    def arrived(self) -> None:
        self.arrivals.append(time.perf_counter())

    def call(self, index: int) -> CallSeen:
        return self.calls.setdefault(index, CallSeen())

    def problem(self) -> str | None:
        if self.error is not None:
            return f"error event: {self.error}"
        if not self.done:
            return "truncated stream: no [DONE] / message_stop"
        if self.finish is None:
            return "no terminal chunk with a finish/stop reason"
        if self.output_tokens is None:
            return "no usage in the stream"
        return None


def read_openai(lines: Iterable[str], s: Stream) -> None:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            s.done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            s.error = str(chunk["error"].get("message", chunk["error"]))
            return
        if chunk.get("usage"):
            s.output_tokens = int(chunk["usage"]["completion_tokens"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            s.text(choice.get("text") or delta.get("content") or "", delta.get("reasoning_content") or "")
            pieces = delta.get("tool_calls") or []
            if pieces:
                s.arrived()  # a call is output too: a turn that only calls still has a TTFT
            for piece in pieces:
                # As the SDKs accumulate them: the id comes once, names and arguments concatenate.
                call = s.call(int(piece["index"]))
                if piece.get("id"):
                    call.ids.append(piece["id"])
                function = piece.get("function") or {}
                call.name += function.get("name") or ""
                if function.get("arguments"):
                    call.arguments.append(function["arguments"])
            if choice.get("finish_reason"):
                s.finish = choice["finish_reason"]


def read_anthropic(lines: Iterable[str], s: Stream) -> None:
    for line in lines:
        if not line.startswith("data:"):
            continue  # the `event:` line repeats the type the data carries
        frame = json.loads(line[len("data:"):])
        kind = frame.get("type")
        if kind == "error":
            s.error = str(frame["error"].get("message", frame["error"]))
            return
        if kind == "content_block_start" and frame["content_block"]["type"] == "tool_use":
            block = frame["content_block"]
            call = s.call(int(frame["index"]))
            if block.get("id"):
                call.ids.append(block["id"])
            call.name += block.get("name", "")
            s.arrived()
        elif kind == "content_block_delta":
            delta = frame["delta"]
            if delta.get("type") == "input_json_delta":
                s.call(int(frame["index"])).arguments.append(delta.get("partial_json", ""))
                s.arrived()
            else:
                s.text(delta.get("text", ""), delta.get("thinking", ""))
        elif kind == "message_delta":
            s.finish = frame["delta"]["stop_reason"]
            s.output_tokens = int(frame["usage"]["output_tokens"])
        elif kind == "message_stop":
            s.done = True


READERS: dict[str, Callable[[Iterable[str], Stream], None]] = {
    "openai_chat": read_openai,
    "openai_completions": read_openai,
    "anthropic_messages": read_anthropic,
}


def check_output(s: Stream, expect: dict[str, Any], body: dict[str, Any] | None = None) -> str | None:
    """The first way the output breaks the payload's expectations, or None.

    `"json": "schema"` checks the answer against the request's own `response_format` schema
    (`body`), so the payload keeps one copy of it. Streamed calls are always checked for one
    unique id each and arguments that parse as a JSON object; `"calls"` then names them."""
    answer, reasoning = "".join(s.answer), "".join(s.reasoning)
    if "finish" in expect and s.finish != expect["finish"]:
        return f"finish {s.finish!r}, expected {expect['finish']!r}"
    if "answer" in expect and answer != expect["answer"]:
        return f"answer {answer[:80]!r} differs from the expected {expect['answer'][:80]!r}"
    if "reasoning" in expect and reasoning != expect["reasoning"]:
        return f"reasoning {reasoning[:80]!r} differs from the expected one"
    if expect.get("has_reasoning") and not reasoning:
        return "no reasoning"
    leaked = [stop for stop in expect.get("excludes", []) if stop in answer]
    if leaked:
        return f"stop string(s) {leaked} leaked into the answer"
    if expect.get("json"):
        try:
            value = json.loads(answer)
        except ValueError:
            return f"the answer is not JSON: {answer[:80]!r}"
        if not isinstance(value, dict):
            return "the answer is JSON but not an object"
        if expect["json"] == "schema":
            return schema_problem(value, (body or {})["response_format"]["json_schema"]["schema"])
    problem = calls_problem(s)
    if problem is None and "calls" in expect:
        got = [[c.name, "".join(c.arguments)] for _, c in sorted(s.calls.items())]
        wanted = [list(c) for c in expect["calls"]]
        if got != wanted:
            return f"tool calls {json.dumps(got)[:160]} differ from the expected {json.dumps(wanted)[:160]}"
    return problem


def calls_problem(s: Stream) -> str | None:
    """Holds for any model: each call has one id of its own and JSON-object arguments."""
    seen: set[str] = set()
    for index, call in sorted(s.calls.items()):
        if not call.ids:
            return f"tool call {index} ({call.name!r}) has no id"
        if len(call.ids) > 1:
            return f"tool call {index} ({call.name!r}) got {len(call.ids)} ids: {call.ids}"
        if call.ids[0] in seen:
            return f"tool call id {call.ids[0]!r} repeats (call {index}, {call.name!r})"
        seen.add(call.ids[0])
        text = "".join(call.arguments)
        try:
            value = json.loads(text)
        except ValueError:
            return f"tool call {index} ({call.name!r}): arguments are not JSON: {text[:80]!r}"
        if not isinstance(value, dict):
            return f"tool call {index} ({call.name!r}): arguments are JSON but not an object"
    return None


def schema_problem(value: Any, schema: dict[str, Any]) -> str | None:
    # jsonschema comes with Ray (a dependency of the project), so the load extra needs no more.
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return f"the answer breaks the requested schema: {exc.message[:120]}"
    return None
