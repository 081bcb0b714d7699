"""The Anthropic Messages adapter's streams: the event sequence, streaming equal to
non-streaming, tool_use blocks, failures before and during a stream, pings."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ingress import streaming
from ingress.anthropic.render import MessageRenderer
from replicas.contract import (
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    OutputEvent,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from replicas.errors import ContextLengthError, OverloadedError, ReplicaError
from tests.contract.anthropic_wire import MODEL, USAGE_BODY, body, done, fold, http, say, sse, think
from tests.fakes import tool_call


def test_streamed_reasoning_answer_event_sequence() -> None:
    client, _ = http([think("Two and"), think(" two."), say("Four"), say("."), done()])
    response = client.post("/v1/messages", json=body(stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = sse(response.text)
    assert [name for name, _ in frames] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in frames)
    start = frames[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == MODEL
    assert frames[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
    }
    assert [f[1]["delta"] for f in frames[2:5]] == [
        {"type": "thinking_delta", "thinking": "Two and"},
        {"type": "thinking_delta", "thinking": " two."},
        {"type": "signature_delta", "signature": ""},
    ]
    assert frames[5][1]["index"] == 0
    assert frames[6][1]["content_block"] == {"type": "text", "text": ""}
    assert [f[1]["delta"] for f in frames[7:9]] == [
        {"type": "text_delta", "text": "Four"},
        {"type": "text_delta", "text": "."},
    ]
    assert {f[1]["index"] for f in frames[6:10]} == {1}
    assert frames[10][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": USAGE_BODY,
    }


SCRIPTS: dict[str, list[OutputEvent]] = {
    "reasoning then answer": [think("a"), think("b"), say("c"), say("d"), done()],
    "stop sequence": [say("Hello"), say(", world"), done(FinishReason.STOP_SEQUENCE, "###")],
    "length, reasoning only": [think("Let me see"), done(FinishReason.LENGTH)],
    "empty deltas": [say(""), think(""), say("x"), say(""), done()],
    "nothing": [done()],
    "back and forth": [think("a"), say("b"), think("c"), say("d"), done()],
    "one tool call": [*tool_call(0, "a1", "f", '{"x": ', "1}"), done(FinishReason.TOOL_CALLS)],
    "reasoning, text and parallel calls": [
        think("plan"),
        say("Checking."),
        *tool_call(0, "a1", "f", '{"x": 1}'),
        *tool_call(1, "a2", "g", "{", '"y": [1, 2]', "}"),
        done(FinishReason.TOOL_CALLS),
    ],
    "call cut by length": [ToolCallStart(0, "a1", "f"), ToolCallDelta(0, '{"x"'),
                           done(FinishReason.LENGTH)],
}


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_streaming_equals_non_streaming_at_every_batch_boundary(script: list[OutputEvent]) -> None:
    client, _ = http(script, cuts=())
    whole = client.post("/v1/messages", json=body()).json()
    for cut in range(len(script) + 1):
        client, _ = http(script, cuts=(cut,))
        streamed = fold(sse(client.post("/v1/messages", json=body(stream=True)).text))
        assert streamed | {"id": whole["id"]} == whole


@pytest.mark.parametrize("text", ["Héllo, wörld", "🍎 and 🍐"])
def test_rendering_is_split_invariant(text: str) -> None:
    def render(events: list[OutputEvent]) -> tuple[dict[str, Any], dict[str, Any]]:
        renderer = MessageRenderer("msg_x", MODEL)
        frames = renderer.start()
        for event in events:
            frames += renderer.feed(event)
        frames += renderer.finish()
        return renderer.message, fold(frames)

    one_shot, _ = render([think(text), say(text), done()])
    for cut in range(len(text) + 1):
        split: list[OutputEvent] = [
            think(text[:cut]),
            think(text[cut:]),
            say(text[:cut]),
            say(text[cut:]),
            done(),
        ]
        assert render(split) == (one_shot, one_shot)


def render_all(renderer: MessageRenderer, events: list[OutputEvent]) -> list[tuple[str, Any]]:
    frames = renderer.start()
    for event in events:
        frames += renderer.feed(event)
    return frames + renderer.finish()


def test_streamed_tool_use_events() -> None:
    script = [say("Checking."), *tool_call(0, "a1", "get_weather", '{"city": ', '"Paris"}'),
              *tool_call(1, "a2", "f"), done(FinishReason.TOOL_CALLS)]
    frames = render_all(MessageRenderer("msg_x", MODEL), script)
    assert [name for name, _ in frames] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    assert frames[4][1]["content_block"] == {
        "type": "tool_use", "id": "toolu_a1", "name": "get_weather", "input": {},
    }
    assert [f[1]["delta"] for f in frames[5:7]] == [
        {"type": "input_json_delta", "partial_json": '{"city": '},
        {"type": "input_json_delta", "partial_json": '"Paris"}'},
    ]
    assert {f[1]["index"] for f in frames[4:8]} == {1}
    assert frames[8][1]["content_block"]["id"] == "toolu_a2"
    assert frames[11][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_use_input_is_the_end_events_arguments() -> None:
    # ToolCallEnd carries the whole text; deltas cut short must not win over it.
    renderer = MessageRenderer("msg_x", MODEL)
    render_all(renderer, [ToolCallStart(0, "a", "f"), ToolCallDelta(0, '{"x"'),
                          ToolCallEnd(0, '{"x": 1}'), done(FinishReason.TOOL_CALLS)])
    assert renderer.message["content"] == [
        {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {"x": 1}}
    ]
    for bad in ("[1, 2]", "not json", ""):
        renderer = MessageRenderer("msg_x", MODEL)
        render_all(renderer, [ToolCallStart(0, "a", "f"), ToolCallEnd(0, bad), done()])
        assert renderer.message["content"][0]["input"] == {}


def test_omitted_thinking_sends_empty_thinking_blocks() -> None:
    script = [think("secret "), think("plan"), say("Four."), done()]
    renderer = MessageRenderer("msg_x", MODEL, omit_thinking=True)
    frames = render_all(renderer, script)
    assert [name for name, _ in frames] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    assert frames[2][1]["delta"] == {"type": "signature_delta", "signature": ""}
    assert renderer.message["content"] == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": "Four."},
    ]
    assert fold(frames) == renderer.message
    assert "secret" not in json.dumps(frames)


def test_usage_reports_cached_prompt_tokens() -> None:
    usage = Usage(prompt_tokens=11, completion_tokens=7, cached_tokens=5)
    renderer = MessageRenderer("msg_x", MODEL)
    frames = render_all(renderer, [say("x"), Finished(FinishReason.EOS, usage)])
    # Anthropic's input_tokens excludes cache reads: 11 prompt tokens = 6 read + 5 cached.
    expected = USAGE_BODY | {"input_tokens": 6, "cache_read_input_tokens": 5}
    assert renderer.message["usage"] == frames[-2][1]["usage"] == expected


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "first, status, error_type",
    [
        (Failed(ErrorKind.OVERLOADED, "busy"), 529, "overloaded_error"),
        (OverloadedError("busy"), 529, "overloaded_error"),
        (ContextLengthError("prompt too long"), 400, "invalid_request_error"),
        (Failed(ErrorKind.INTERNAL, "boom"), 500, "api_error"),
    ],
)
def test_failure_before_any_text_is_an_http_error(
    first: Any, status: int, error_type: str, stream: bool
) -> None:
    client, _ = http([first])
    response = client.post("/v1/messages", json=body(stream=stream))
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == error_type


@pytest.mark.parametrize("failure", [Failed(ErrorKind.INTERNAL, "boom"), ReplicaError("boom")])
def test_failure_mid_stream_ends_with_an_error_event(failure: Any) -> None:
    client, _ = http([say("Hel"), failure])
    response = client.post("/v1/messages", json=body(stream=True))
    assert response.status_code == 200
    frames = sse(response.text)
    assert [name for name, _ in frames][-3:] == [
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert frames[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


def test_failure_mid_way_without_streaming_is_an_error_response() -> None:
    client, _ = http([say("Hel"), Failed(ErrorKind.OVERLOADED, "busy")])
    response = client.post("/v1/messages", json=body())
    assert response.status_code == 529
    assert response.json() == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }


def test_stream_without_a_terminal_event_ends_with_an_error_event() -> None:
    client, _ = http([say("Hel")])
    frames = sse(client.post("/v1/messages", json=body(stream=True)).text)
    assert frames[-1][1]["error"]["type"] == "api_error"


def test_idle_stream_sends_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "PING_INTERVAL_S", 0.01)
    script: list[OutputEvent] = [say("a"), say("b"), done()]
    client, _ = http(script, delay_s=0.08)
    frames = sse(client.post("/v1/messages", json=body(stream=True)).text)
    names = [name for name, _ in frames]
    assert "ping" in names and names.index("ping") > names.index("message_start")
    assert ("ping", {"type": "ping"}) in frames
    pings_removed = [frame for frame in frames if frame[0] != "ping"]
    client, _ = http(script)
    assert fold(pings_removed) | {"id": "x"} == client.post("/v1/messages", json=body()).json() | {
        "id": "x"
    }
