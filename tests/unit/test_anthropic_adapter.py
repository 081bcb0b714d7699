"""The Anthropic Messages adapter against a scripted client: conversion, errors, rendering."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ingress.anthropic import anthropic_validation_message, router
from ingress.anthropic import routes as anthropic_routes
from ingress.anthropic.convert import omits_thinking, to_generation_request
from ingress.anthropic.models import MessagesRequest
from ingress.anthropic.render import STOP_REASONS, MessageRenderer
from ingress.client import ModelCard
from replicas.contract import (
    Channel,
    ChatMessage,
    ChatPrompt,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    OutputEvent,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolChoice,
    ToolSpec,
    Usage,
)
from replicas.errors import ContextLengthError, OverloadedError, ReplicaError
from tests.fakes import FakeClient, Script, app_for, tool_call

MODEL = "orchard-tiny"
USAGE = Usage(prompt_tokens=11, completion_tokens=7)
USAGE_BODY = {
    "input_tokens": 11,
    "output_tokens": 7,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
}
USER = [{"role": "user", "content": "Hi"}]


def think(text: str) -> TextDelta:
    return TextDelta(Channel.REASONING, text)


def say(text: str) -> TextDelta:
    return TextDelta(Channel.ANSWER, text)


def done(reason: FinishReason = FinishReason.EOS, stop: str | int | None = None) -> Finished:
    return Finished(reason, USAGE, stop)


EMPTY_ANSWER = (done(),)


def http(script: Script = EMPTY_ANSWER, **options: Any) -> tuple[TestClient, FakeClient]:
    fake = FakeClient(script, **options)
    return TestClient(app_for(router, fake, anthropic_validation_message)), fake


def body(**overrides: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 32, "messages": USER} | overrides


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    frames = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        frames.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return frames


def fold(frames: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """A streamed message accumulated the way Anthropic's SDKs do."""
    message: dict[str, Any] = {}
    partial_json: dict[int, str] = {}
    for name, data in frames:
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            assert data["index"] == len(message["content"])
            message["content"].append(data["content_block"])
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial_json[data["index"]] = partial_json.get(data["index"], "") + delta[
                    "partial_json"
                ]
                continue
            field = {"text_delta": "text", "thinking_delta": "thinking"}.get(delta["type"])
            if field is None:
                block["signature"] = delta["signature"]
            else:
                block[field] += delta[field]
        elif name == "content_block_stop" and data["index"] in partial_json:
            try:
                tool_input = json.loads(partial_json[data["index"]])
            except json.JSONDecodeError:
                tool_input = {}  # a call cut short: the renderer sends {} for input that does not parse
            message["content"][data["index"]]["input"] = tool_input
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"].update(data["usage"])
    return message


def convert(**overrides: Any):
    return to_generation_request(
        MessagesRequest.model_validate(body(**overrides)), ModelCard(MODEL)
    )


# --- conversion -------------------------------------------------------------------------


def test_system_and_text_blocks_become_chat_messages() -> None:
    request = convert(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
            },
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "Add 2+2."},
        ],
    )
    assert request.prompt.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Hello"),
        ChatMessage("assistant", "Hi!"),
        ChatMessage("user", "Add 2+2."),
    )
    assert request.request_id.startswith("msg_") and request.model == MODEL


def test_claude_codes_billing_header_block_is_not_prompt_text() -> None:
    # Its value changes per request; kept, no two turns would share a prompt prefix.
    def system_of(header: str) -> ChatMessage:
        request = convert(system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328.{header};"},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        ])
        return request.prompt.messages[0]

    assert system_of("661") == system_of("ade") == ChatMessage("system", "You are an agent.")


def test_consecutive_same_role_messages_merge_into_one_turn() -> None:
    request = convert(
        messages=[{"role": "user", "content": "One."}, {"role": "user", "content": "Two."}]
    )
    assert request.prompt.messages == (ChatMessage("user", "One.\n\nTwo."),)


def test_final_assistant_message_is_a_prefill() -> None:
    request = convert(messages=USER + [{"role": "assistant", "content": "The answer is"}])
    assert request.prompt.messages[-1] == ChatMessage("assistant", "The answer is")


def test_empty_final_assistant_message_is_no_prefill() -> None:
    request = convert(messages=USER + [{"role": "assistant", "content": ""}])
    assert request.prompt.messages == (ChatMessage("user", "Hi"),)


def test_assistant_thinking_blocks_become_reasoning() -> None:
    turn = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Greet back.", "signature": "sig"},
            {"type": "text", "text": "Hello."},
        ],
    }
    request = convert(messages=USER + [turn, {"role": "user", "content": "Bye"}])
    assert request.prompt.messages[1] == ChatMessage("assistant", "Hello.", reasoning="Greet back.")


def test_sampling_defaults_follow_anthropic() -> None:
    request = convert()
    assert request.sampling == SamplingParams(max_tokens=32, temperature=1.0, top_p=1.0, top_k=0)
    assert request.stop == StopSpec() and request.reasoning == ReasoningSpec(enabled=False)


def test_sampling_stops_and_thinking_are_passed_on() -> None:
    request = convert(
        temperature=0.2,
        top_p=0.9,
        top_k=40,
        stop_sequences=["###", "\nUser:"],
        thinking={"type": "enabled", "budget_tokens": 16},
    )
    assert request.sampling == SamplingParams(max_tokens=32, temperature=0.2, top_p=0.9, top_k=40)
    assert request.stop == StopSpec(strings=("###", "\nUser:"))
    assert request.reasoning == ReasoningSpec(enabled=True, budget_tokens=16)
    assert convert(thinking={"type": "disabled"}).reasoning == ReasoningSpec(enabled=False)
    assert convert(thinking={"type": "adaptive"}).reasoning == ReasoningSpec(enabled=True)


def test_alias_resolves_to_the_served_id_and_unknown_fields_are_ignored() -> None:
    client, fake = http([say("ok"), done()])
    response = client.post("/v1/messages", json=body(model="tiny", service_tier="auto"))
    assert response.status_code == 200
    assert response.json()["model"] == MODEL and fake.requests[0].model == MODEL


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}


def test_tools_and_tool_choice_are_passed_on() -> None:
    request = convert(tools=[WEATHER_TOOL, {"type": "custom", "name": "f", "input_schema": {},
                                            "strict": True}])
    assert request.tools == (
        ToolSpec(
            "get_weather",
            "Weather in a city.",
            '{"type": "object", "properties": {"city": {"type": "string"}}}',
        ),
        ToolSpec("f", None, "{}", strict=True),
    )
    assert request.tool_choice == ToolChoice()
    choices = {
        "auto": ({"type": "auto"}, ToolChoice("auto")),
        "auto, one call": (
            {"type": "auto", "disable_parallel_tool_use": True},
            ToolChoice("auto", parallel=False),
        ),
        "any": ({"type": "any"}, ToolChoice("required")),
        "tool": (
            {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
            ToolChoice("required", "f", parallel=False),
        ),
        "none": ({"type": "none"}, ToolChoice("none")),
    }
    for wire, expected in choices.values():
        assert convert(tools=[WEATHER_TOOL, {"name": "f", "input_schema": {}}],
                       tool_choice=wire).tool_choice == expected
    assert convert(tool_choice={"type": "none"}).tool_choice == ToolChoice("none")


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages() -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    other = {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {}}
    request = convert(
        tools=[WEATHER_TOOL, {"name": "f", "input_schema": {}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    call,
                    other,
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "Sunny, "}, {"type": "text",
                                                                         "text": "21C"}],
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such thing",
                     "is_error": True},
                    {"type": "text", "text": "Thanks."},
                ],
            },
            {"role": "user", "content": "And tomorrow?"},
        ],
    )
    assert request.prompt.messages == (
        ChatMessage("user", "Weather?"),
        ChatMessage(
            "assistant",
            "Checking.",
            reasoning="Look it up.",
            tool_calls=(
                ToolCall("toolu_1", "get_weather", '{"city": "Paris"}'),
                ToolCall("toolu_2", "f", "{}"),
            ),
        ),
        ChatMessage("tool", "Sunny, 21C", tool_call_id="toolu_1", name="get_weather"),
        ChatMessage("tool", "Error: no such thing", tool_call_id="toolu_2", name="f"),
        ChatMessage("user", "Thanks.\n\nAnd tomorrow?"),
    )


def test_a_result_only_user_message_and_an_empty_error_result() -> None:
    messages = USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "is_error": True}]},
    ]
    assert convert(messages=messages).prompt.messages[1:] == (
        ChatMessage("assistant", "", tool_calls=(ToolCall("t", "f", "{}"),)),
        ChatMessage("tool", "Error", tool_call_id="t", name="f"),
    )
    messages[-1]["content"][0] = {"type": "tool_result", "tool_use_id": "t", "content": None}
    assert convert(messages=messages).prompt.messages[-1] == ChatMessage(
        "tool", "", tool_call_id="t", name="f"
    )


def test_image_in_a_tool_result_is_named_in_a_400() -> None:
    client, fake = http()
    messages = USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "image", "source": {}}]}]},
    ]
    response = client.post("/v1/messages", json=body(messages=messages))
    assert response.status_code == 400 and fake.requests == []
    assert "messages.2.content.0.content.0" in response.json()["error"]["message"]
    assert "'image'" in response.json()["error"]["message"]


def test_system_role_messages() -> None:
    request = convert(
        system="Be brief.",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "Env: linux.",
                                            "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Date: today."},
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Reminder: be kind."},
            {"role": "user", "content": "Bye"},
        ],
    )
    assert request.prompt.messages == (
        ChatMessage("system", "Be brief.\n\nEnv: linux.\n\nDate: today."),
        ChatMessage("user", "Hi"),
        ChatMessage("system", "Reminder: be kind."),
        ChatMessage("user", "Bye"),
    )
    leading_only = convert(messages=[{"role": "system", "content": "S."}] + USER)
    assert leading_only.prompt.messages == (ChatMessage("system", "S."), ChatMessage("user", "Hi"))


@pytest.mark.parametrize(
    "effort, budget, template_effort",
    [("low", 1024, "low"), ("medium", 4096, "medium"), ("high", 16384, "high"),
     ("xhigh", 32768, "high"), ("max", None, "high")],
)
def test_effort_sets_the_adaptive_thinking_budget(
    effort: str, budget: int | None, template_effort: str
) -> None:
    adaptive = {"type": "adaptive", "display": "summarized"}
    request = convert(thinking=adaptive, output_config={"effort": effort})
    assert request.reasoning == ReasoningSpec(enabled=True, budget_tokens=budget,
                                              effort=template_effort)
    # An explicit budget wins; without thinking the effort only reaches the template.
    explicit = convert(thinking={"type": "enabled", "budget_tokens": 8},
                       output_config={"effort": effort})
    assert explicit.reasoning == ReasoningSpec(enabled=True, budget_tokens=8,
                                               effort=template_effort)
    off = convert(output_config={"effort": effort})
    assert off.reasoning == ReasoningSpec(enabled=False, effort=template_effort)


def test_thinking_display() -> None:
    def request(thinking: dict[str, Any]) -> MessagesRequest:
        return MessagesRequest.model_validate(body(thinking=thinking))

    assert omits_thinking(request({"type": "adaptive", "display": "omitted"}))
    assert omits_thinking(request({"type": "enabled", "budget_tokens": 8, "display": "omitted"}))
    assert not omits_thinking(request({"type": "adaptive", "display": "summarized"}))
    assert not omits_thinking(request({"type": "adaptive"}))
    assert not omits_thinking(request({"type": "disabled"}))


# --- errors -----------------------------------------------------------------------------

BAD_REQUESTS = {
    "missing max_tokens": ({"max_tokens": None}, "max_tokens"),
    "zero max_tokens": ({"max_tokens": 0}, "max_tokens"),
    "empty messages": ({"messages": []}, "messages"),
    "unknown role in messages": (
        {"messages": [{"role": "tool", "content": "x"}]},
        "messages.0.role",
    ),
    "only system messages": (
        {"messages": [{"role": "system", "content": "x"}]},
        "first message",
    ),
    "assistant after a leading system message": (
        {"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "first message",
    ),
    "empty system message": (
        {"messages": USER + [{"role": "system", "content": ""}]},
        "messages.1: all messages must have non-empty content",
    ),
    "assistant first": (
        {"messages": [{"role": "assistant", "content": "x"}] + USER},
        "first message",
    ),
    "empty user message": ({"messages": [{"role": "user", "content": ""}]}, "non-empty content"),
    "empty text block": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        "non-empty",
    ),
    "prefill ends in whitespace": (
        {"messages": USER + [{"role": "assistant", "content": "A "}]},
        "trailing whitespace",
    ),
    "empty stop sequence": ({"stop_sequences": [""]}, "stop_sequences.0"),
    "non-string stop sequence": ({"stop_sequences": [7]}, "stop_sequences.0"),
    "temperature above 1": ({"temperature": 1.5}, "temperature"),
    "zero thinking budget": (
        {"thinking": {"type": "enabled", "budget_tokens": 0}},
        "budget_tokens",
    ),
    "budget not below max_tokens": (
        {"thinking": {"type": "enabled", "budget_tokens": 32}},
        "max_tokens",
    ),
    "server tool": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]},
        "tools.0: tool type 'web_search_20250305' is not supported",
    ),
    "bash tool": (
        {"tools": [{"type": "bash_20250124", "name": "bash"}]},
        "'bash_20250124'",
    ),
    "text editor tool": (
        {"tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]},
        "'text_editor_20250728'",
    ),
    "computer tool": (
        {"tools": [{"type": "computer_20250124", "name": "computer", "display_width_px": 1}]},
        "'computer_20250124'",
    ),
    "custom tool without a schema": ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    "tool without a name": ({"tools": [{"input_schema": {}}]}, "tools.0.name"),
    "duplicate tool names": (
        {"tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]},
        "unique",
    ),
    "tool_choice naming an unknown tool": (
        {
            "tools": [{"name": "f", "input_schema": {}}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
        "tool_choice.name: 'g'",
    ),
    "tool_choice any without tools": ({"tool_choice": {"type": "any"}}, "requires tools"),
    "unknown tool_choice type": ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    "tool_result for no tool_use": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
                }
            ]
        },
        "messages.0.content.0: tool_result block(s) provided with tool_use_id 'toolu_x'",
    ),
    "tool_use in a user message": (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
                                                    "name": "f", "input": {}}]}]},
        "tool_use blocks are only allowed in assistant messages",
    ),
    "tool_use input not an object": (
        {"messages": USER + [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "a", "name": "f", "input": "{}"}]}]},
        "messages.1.content.0.tool_use.input",
    ),
    "tool_result in an assistant message": (
        {"messages": USER + [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "1"}]}]},
        "tool_result blocks are only allowed in user messages",
    ),
    "thinking in a system message": (
        {"messages": [{"role": "system", "content": [{"type": "thinking", "thinking": "x"}]}]
         + USER},
        "thinking blocks are only allowed in assistant messages",
    ),
    "unknown effort": ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
}


@pytest.mark.parametrize("overrides, named", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_are_anthropic_400s(overrides: dict[str, Any], named: str) -> None:
    client, fake = http()
    request = {key: value for key, value in body(**overrides).items() if value is not None}
    response = client.post("/v1/messages", json=request)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    assert fake.requests == []


@pytest.mark.parametrize(
    "kind", ["image", "document", "server_tool_use", "web_search_tool_result", "redacted_thinking"]
)
def test_unsupported_blocks_are_named_in_a_400(kind: str) -> None:
    client, _ = http()
    content = [{"type": "text", "text": "Look:"}, {"type": kind, "source": {}}]
    response = client.post(
        "/v1/messages", json=body(messages=[{"role": "user", "content": content}])
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "messages.0.content.1" in message and kind in message and "not supported" in message


def test_invalid_json_is_a_400() -> None:
    client, _ = http()
    response = client.post(
        "/v1/messages", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": "request body is not valid JSON",
    }


def test_unknown_model_is_a_404_listing_the_served_models() -> None:
    client, _ = http()
    for path, request in [
        ("/v1/messages", body(model="gpt-9")),
        ("/v1/messages/count_tokens", {"model": "gpt-9", "messages": USER}),
    ]:
        response = client.post(path, json=request)
        assert response.status_code == 404
        error = response.json()["error"]
        assert (
            error["type"] == "not_found_error"
            and "gpt-9" in error["message"]
            and MODEL in error["message"]
        )


# --- non-streaming responses ------------------------------------------------------------

STOPS = [
    (FinishReason.EOS, None, "end_turn", None),
    (FinishReason.STOP_SEQUENCE, "###", "stop_sequence", "###"),
    (FinishReason.STOP_TOKEN, 151645, "end_turn", None),
    (FinishReason.LENGTH, None, "max_tokens", None),
    (FinishReason.GRAMMAR_COMPLETE, None, "end_turn", None),
    (FinishReason.CANCELLED, None, "end_turn", None),
    (FinishReason.TOOL_CALLS, None, "tool_use", None),
]


def test_stop_table_covers_every_finish_reason() -> None:
    assert set(STOP_REASONS) == set(FinishReason) == {row[0] for row in STOPS}


@pytest.mark.parametrize("reason, stop, stop_reason, stop_sequence", STOPS)
def test_stop_reason_and_sequence(
    reason: FinishReason, stop: Any, stop_reason: str, stop_sequence: Any
) -> None:
    client, _ = http([say("Hello"), done(reason, stop)])
    message = client.post("/v1/messages", json=body()).json()
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)


def test_non_streaming_message_shape() -> None:
    client, _ = http([think("Hmm."), say("Four"), say("."), done()])
    message = client.post("/v1/messages", json=body()).json()
    assert message["id"].startswith("msg_")
    assert {key: value for key, value in message.items() if key != "id"} == {
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [
            {"type": "thinking", "thinking": "Hmm.", "signature": ""},
            {"type": "text", "text": "Four."},
        ],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": USAGE_BODY,
    }


def test_nothing_generated_is_empty_content() -> None:
    client, _ = http([say(""), done(FinishReason.STOP_SEQUENCE, "###")])
    assert client.post("/v1/messages", json=body()).json()["content"] == []


# --- streaming --------------------------------------------------------------------------


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
    monkeypatch.setattr(anthropic_routes, "PING_INTERVAL_S", 0.01)
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


# --- count_tokens -----------------------------------------------------------------------


def test_count_tokens() -> None:
    client, fake = http(input_tokens=42)
    response = client.post(
        "/v1/messages/count_tokens",
        json={
            "model": MODEL,
            "system": "Be brief.",
            "messages": USER,
            "thinking": {"type": "enabled", "budget_tokens": 2048},
        },
    )
    assert response.status_code == 200 and response.json() == {"input_tokens": 42}
    (counted,) = fake.counted
    assert counted.prompt == ChatPrompt(
        (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"))
    )
    assert counted.reasoning == ReasoningSpec(enabled=True, budget_tokens=2048)
    assert fake.requests == []


def test_count_tokens_validates_like_messages() -> None:
    client, _ = http()
    response = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
    assert (
        response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    )
