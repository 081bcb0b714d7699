"""`load/locust/stream_checks.py` on SSE frames recorded from Orchard (tool calls in both APIs),
passing and failing: the Locust runs against orchard-tiny only ever see passing output, so
these show that every check can fail a request, with a message that says why."""

from __future__ import annotations

import json
from typing import Any

import pytest

from load.locust.stream_checks import READERS, Stream, check_output

PARIS = ["get_weather", '{"city": "Paris"}']
TOKYO = ["get_weather", '{"city": "Tokyo"}']
ROME = ["get_weather", '{"city": "Rome"}']


def oai_chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
              usage: dict[str, int] | None = None) -> str:
    choices = [] if delta is None else [{"index": 0, "logprobs": None, "finish_reason": finish,
                                         "delta": delta}]
    return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                                  "model": "orchard-tiny", "usage": usage, "choices": choices})


def oai_start(index: int, call_id: str | None, name: str) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "type": "function",
                            "function": {"name": name, "arguments": ""}}
    if call_id is not None:
        call["id"] = call_id
    return {"tool_calls": [call]}


def oai_args(index: int, piece: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


def openai_frames(calls: list[tuple[str | None, str, list[str]]], text: str = "",
                  finish: str = "tool_calls") -> list[str]:
    """A chat stream as Orchard sends it: role, text, then each call's start and pieces."""
    lines = [oai_chunk({"role": "assistant", "content": ""})]
    lines += [oai_chunk({"content": text})] if text else []
    for index, (call_id, name, pieces) in enumerate(calls):
        lines.append(oai_chunk(oai_start(index, call_id, name)))
        lines += [oai_chunk(oai_args(index, piece)) for piece in pieces]
    lines.append(oai_chunk({}, finish=finish))
    lines.append(oai_chunk(None, usage={"prompt_tokens": 223, "completion_tokens": 25,
                                        "total_tokens": 248}))
    return [*lines, "data: [DONE]"]


def sse(event: dict[str, Any]) -> list[str]:
    return [f"event: {event['type']}", "data: " + json.dumps(event), ""]


def anthropic_frames(calls: list[tuple[str | None, str, list[str]]], text: str = "",
                     finish: str = "tool_use") -> list[str]:
    lines = sse({"type": "message_start", "message": {"id": "msg_1", "content": []}})
    index = 0
    if text:
        lines += sse({"type": "content_block_start", "index": 0,
                      "content_block": {"type": "text", "text": ""}})
        lines += sse({"type": "content_block_delta", "index": 0,
                      "delta": {"type": "text_delta", "text": text}})
        lines += sse({"type": "content_block_stop", "index": 0})
        index = 1
    for offset, (call_id, name, pieces) in enumerate(calls):
        block: dict[str, Any] = {"type": "tool_use", "name": name, "input": {}}
        if call_id is not None:
            block["id"] = call_id
        lines += sse({"type": "content_block_start", "index": index + offset, "content_block": block})
        for piece in pieces:
            lines += sse({"type": "content_block_delta", "index": index + offset,
                          "delta": {"type": "input_json_delta", "partial_json": piece}})
        lines += sse({"type": "content_block_stop", "index": index + offset})
    lines += sse({"type": "message_delta", "delta": {"stop_reason": finish, "stop_sequence": None},
                  "usage": {"input_tokens": 223, "output_tokens": 40}})
    return lines + sse({"type": "message_stop"})


# The argument pieces exactly as Orchard streamed them (one token each).
PARIS_PIECES = ['{"', "city", '":', ' "', "Paris", '"}']
TOKYO_PIECES = ['{"', "city", '":', ' "', "Tokyo", '"}']
ROME_PIECES = ['{"', "city", '":', ' "', "Rome", '"}']

FRAMES = {
    "openai_chat": (openai_frames, "tool_calls", "call_d337b0c093994673aa99c1d5", "call_9a"),
    "anthropic_messages": (anthropic_frames, "tool_use", "toolu_a6670fd029b348e6a970e1bd",
                           "toolu_dad751395a3a490385fd66b3"),
}
APIS = list(FRAMES)


def read(api: str, lines: list[str]) -> Stream:
    s = Stream(0.0)
    READERS[api](lines, s)
    assert s.problem() is None, s.problem()
    return s


def two_calls(api: str, second_id: str | None = None, second: list[str] | None = None) -> Stream:
    frames, _, first_id, other_id = FRAMES[api]
    return read(api, frames([(first_id, "get_weather", PARIS_PIECES),
                             (other_id if second_id is None else second_id, "get_weather",
                              TOKYO_PIECES if second is None else second)]))


@pytest.mark.parametrize("api", APIS)
def test_parallel_calls_pass_and_are_read_in_order(api: str) -> None:
    finish = FRAMES[api][1]
    s = two_calls(api)
    assert check_output(s, {"finish": finish, "answer": "", "calls": [PARIS, TOKYO]}) is None
    assert [c.name for _, c in sorted(s.calls.items())] == ["get_weather", "get_weather"]
    # Every call frame is output: the start and each argument piece (for TTFT and ITL).
    assert len(s.arrivals) == 2 * (1 + len(PARIS_PIECES))


@pytest.mark.parametrize("api", APIS)
def test_text_then_a_call_keeps_both(api: str) -> None:
    frames, finish, first_id, _ = FRAMES[api]
    s = read(api, frames([(first_id, "get_weather", ROME_PIECES)], text="Let me check.\n"))
    assert check_output(s, {"finish": finish, "answer": "Let me check.\n", "calls": [ROME]}) is None
    assert check_output(s, {"answer": ""}) is not None  # the text is the answer, not dropped


@pytest.mark.parametrize("api", APIS)
def test_a_text_answer_passes_calls_empty_and_fails_a_call_expectation(api: str) -> None:
    frames = FRAMES[api][0]
    end = "stop" if api == "openai_chat" else "end_turn"
    s = read(api, frames([], text="It is sunny in Paris, 18 degrees.", finish=end))
    assert check_output(s, {"finish": end, "calls": []}) is None
    problem = check_output(s, {"calls": [PARIS]})
    assert problem is not None and "differ" in problem and "get_weather" in problem


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("expected, words", [
    ([TOKYO, PARIS], "differ"),  # the same calls in the other order
    ([PARIS], "differ"),  # one call fewer expected than made
    ([PARIS, TOKYO, PARIS], "differ"),
    ([PARIS, ["get_time", '{"city": "Tokyo"}']], "get_time"),  # another name
    ([PARIS, ["get_weather", '{"city":"Tokyo"}']], "differ"),  # the exact text counts
], ids=["order", "fewer", "more", "name", "spacing"])
def test_calls_that_differ_fail(api: str, expected: list[list[str]], words: str) -> None:
    problem = check_output(two_calls(api), {"calls": expected})
    assert problem is not None and problem.startswith("tool calls ") and words in problem


@pytest.mark.parametrize("api", APIS)
def test_a_call_without_an_id_fails(api: str) -> None:
    frames = FRAMES[api][0]
    s = read(api, frames([(None, "get_weather", PARIS_PIECES)]))
    assert check_output(s, {"calls": [PARIS]}) == "tool call 0 ('get_weather') has no id"
    assert check_output(s, {}) is not None  # checked for any payload that gets calls


@pytest.mark.parametrize("api", APIS)
def test_a_repeated_id_fails(api: str) -> None:
    first_id = FRAMES[api][2]
    problem = check_output(two_calls(api, second_id=first_id), {"calls": [PARIS, TOKYO]})
    assert problem is not None and f"tool call id {first_id!r} repeats" in problem


def test_a_second_id_for_the_same_openai_call_fails() -> None:
    lines = openai_frames([("call_a", "get_weather", PARIS_PIECES)])
    lines.insert(-3, oai_chunk({"tool_calls": [{"index": 0, "id": "call_b", "function": {}}]}))
    problem = check_output(read("openai_chat", lines), {"calls": [PARIS]})
    assert problem is not None and "got 2 ids" in problem


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("pieces, words", [
    (['{"', "city", '":', ' "', "Tokyo"], "not JSON"),  # cut short
    (['{"city": "Tokyo"}', "}"], "not JSON"),  # a piece too many
    (["[1, ", "2]"], "not an object"),
    ([], "not JSON"),  # no pieces at all
], ids=["truncated", "extra-piece", "array", "empty"])
def test_arguments_that_are_not_a_json_object_fail(api: str, pieces: list[str], words: str) -> None:
    problem = check_output(two_calls(api, second=pieces), {})
    assert problem is not None and problem.startswith("tool call 1 ('get_weather')") and words in problem


@pytest.mark.parametrize("api", APIS)
def test_the_finish_reason_of_a_call_is_checked(api: str) -> None:
    frames, finish, first_id, _ = FRAMES[api]
    wrong = "stop" if api == "openai_chat" else "end_turn"
    s = read(api, frames([(first_id, "get_weather", PARIS_PIECES)], finish=wrong))
    assert check_output(s, {"finish": finish, "calls": [PARIS]}) == f"finish {wrong!r}, expected {finish!r}"


def test_openai_call_frames_carry_output_when_no_text_comes() -> None:
    # A turn that only calls: TTFT is the first call frame, not missing.
    s = read("openai_chat", openai_frames([("call_1", "get_weather", PARIS_PIECES)]))
    assert "".join(s.answer) == "" and len(s.arrivals) == 1 + len(PARIS_PIECES)


def test_a_stream_cut_after_a_call_is_truncated() -> None:
    lines = anthropic_frames([("toolu_1", "get_weather", PARIS_PIECES)])
    s = Stream(0.0)
    READERS["anthropic_messages"](lines[:-6], s)  # no message_delta, no message_stop
    assert s.problem() == "truncated stream: no [DONE] / message_stop"


def test_json_schema_uses_the_request_schema() -> None:
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"born": {"type": "integer"}}, "required": ["born"]}}}}
    s = read("openai_chat", openai_frames([], text='{"born": 1900}', finish="stop"))
    assert check_output(s, {"json": "schema"}, body) is None
    s = read("openai_chat", openai_frames([], text='{"born": "x"}', finish="stop"))
    problem = check_output(s, {"json": "schema"}, body)
    assert problem is not None and problem.startswith("the answer breaks the requested schema")
