"""Tool use and the request fields of current clients (Claude Code 2.x) on /v1/messages,
driven by the official `anthropic` SDK against the real app and a fake client."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from replicas.contract import (
    Channel,
    ChatMessage,
    Finished,
    FinishReason,
    OutputEvent,
    ReasoningSpec,
    TextDelta,
    ToolCall,
    ToolChoice,
    ToolSpec,
    Usage,
)
from tests.fakes import FakeClient, Script, one_call_script, parallel_calls_script, tool_call

MODEL = "orchard-tiny"
USAGE = Usage(prompt_tokens=30, completion_tokens=10, cached_tokens=4)
USER: list[Any] = [{"role": "user", "content": "Weather in Paris and Rome?"}]
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}
TIME: dict[str, Any] = {"name": "get_time", "input_schema": {"type": "object"}}
TOOLS = [WEATHER, TIME]

ONE_CALL = one_call_script(USAGE)
PARALLEL = parallel_calls_script(USAGE)


def sdk(script: Script, **options: Any) -> tuple[anthropic.Anthropic, FakeClient]:
    fake = FakeClient(script, **options)
    client = anthropic.Anthropic(api_key="test", base_url="http://testserver",
                                 http_client=TestClient(create_app(fake)), max_retries=0)
    return client, fake


def create(client: anthropic.Anthropic, **options: Any) -> anthropic.types.Message:
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": USER,
                               "tools": TOOLS} | options
    return client.messages.create(**request)


# --- responses --------------------------------------------------------------------------


def test_a_tool_use_block() -> None:
    message = create(sdk(ONE_CALL)[0])
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use"
    assert (block.id, block.name, block.input) == ("toolu_a1", "get_weather", {"city": "Paris"})
    assert message.usage.cache_read_input_tokens == 4
    assert message.usage.cache_creation_input_tokens == 0


def test_parallel_calls_after_thinking_and_text() -> None:
    message = create(sdk(PARALLEL)[0], thinking={"type": "enabled", "budget_tokens": 32})
    assert [block.type for block in message.content] == [
        "thinking", "text", "tool_use", "tool_use", "tool_use"]
    calls = [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert calls == [
        ("toolu_a1", "get_weather", {"city": "Paris"}),
        ("toolu_b2", "get_weather", {"city": "Rome"}),
        ("toolu_c3", "get_time", {}),
    ]


def test_raw_stream_events() -> None:
    client, _ = sdk(ONE_CALL)
    events = list(create(client, stream=True))
    assert [event.type for event in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    start = events[1]
    assert start.content_block.model_dump(exclude_none=True) == {  # type: ignore[union-attr]
        "type": "tool_use", "id": "toolu_a1", "name": "get_weather", "input": {}}
    assert [e.delta.model_dump() for e in events[2:4]] == [  # type: ignore[union-attr]
        {"type": "input_json_delta", "partial_json": '{"city": '},
        {"type": "input_json_delta", "partial_json": '"Paris"}'}]
    assert events[5].delta.stop_reason == "tool_use"  # type: ignore[union-attr]
    assert events[5].usage.cache_read_input_tokens == 4  # type: ignore[union-attr]


SPLIT_SCRIPTS = {"one call": ONE_CALL, "thinking, text, parallel calls": PARALLEL}


@pytest.mark.parametrize("script", SPLIT_SCRIPTS.values(), ids=SPLIT_SCRIPTS.keys())
def test_stream_helper_equals_create_at_every_batch_boundary(script: list[OutputEvent]) -> None:
    whole = create(sdk(script)[0])
    for cut in range(len(script) + 1):  # 0 and len: all events in one batch
        client, _ = sdk(script, cuts=[cut])
        with client.messages.stream(model=MODEL, max_tokens=64, messages=USER,
                                    tools=TOOLS) as stream:  # type: ignore[arg-type]
            inputs = [event.snapshot for event in stream if event.type == "input_json"]
            final = stream.get_final_message()
        assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
        assert {"city": "Paris"} in inputs  # the SDK parsed the pieces as they came


# --- the request the replica gets --------------------------------------------------------


def test_tools_choice_and_history_reach_the_replica() -> None:
    client, fake = sdk(ONE_CALL)
    history: list[Any] = [
        *USER,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_x", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_y", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_x",
             "content": [{"type": "text", "text": "Sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_y", "content": "clock broken",
             "is_error": True},
            {"type": "text", "text": "And Rome?"}]},
    ]
    create(client, messages=history,
           tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    request = fake.requests[0]
    assert request.tools == (
        ToolSpec("get_weather", "Current weather in a city.", json.dumps(WEATHER["input_schema"])),
        ToolSpec("get_time", None, '{"type": "object"}'),
    )
    assert request.tool_choice == ToolChoice("required", "get_weather", parallel=False)
    assert request.prompt.messages == (  # type: ignore[union-attr]
        ChatMessage("user", "Weather in Paris and Rome?"),
        ChatMessage("assistant", "Checking.", tool_calls=(
            ToolCall("toolu_x", "get_weather", '{"city": "Paris"}'),
            ToolCall("toolu_y", "get_time", "{}"))),
        ChatMessage("tool", "Sunny", tool_call_id="toolu_x", name="get_weather"),
        ChatMessage("tool", "Error: clock broken", tool_call_id="toolu_y", name="get_time"),
        ChatMessage("user", "And Rome?"),
    )


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, ToolChoice("auto")),
        ({"type": "auto"}, ToolChoice("auto")),
        ({"type": "any"}, ToolChoice("required")),
        ({"type": "any", "disable_parallel_tool_use": True}, ToolChoice("required", parallel=False)),
        ({"type": "none"}, ToolChoice("none")),
    ],
)
def test_tool_choice_forms(choice: dict[str, Any] | None, expected: ToolChoice) -> None:
    client, fake = sdk(ONE_CALL)
    create(client, **({"tool_choice": choice} if choice else {}))
    assert fake.requests[0].tool_choice == expected


def test_count_tokens_sees_the_tools() -> None:
    client, fake = sdk((), input_tokens=99)
    counted = client.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice={"type": "any"})
    assert counted.input_tokens == 99
    assert [spec.name for spec in fake.counted[0].tools] == ["get_weather", "get_time"]
    assert fake.counted[0].tool_choice == ToolChoice("required")


# --- 400s before any replica time --------------------------------------------------------

BAD = {
    "web search": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                   "web_search_20250305"),
    "bash": ({"tools": [WEATHER, {"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
    "text editor": ({"tools": [{"type": "text_editor_20250728",
                                "name": "str_replace_based_edit_tool"}]}, "text_editor_20250728"),
    "computer": ({"tools": [{"type": "computer_20250124", "name": "computer",
                             "display_width_px": 1024, "display_height_px": 768}]},
                 "computer_20250124"),
    "unknown tool in tool_choice": ({"tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    "tool_choice any without tools": ({"tools": [], "tool_choice": {"type": "any"}},
                                      "requires tools"),
    "tool_result for no tool_use": (
        {"messages": [*USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_x", "name": "get_time", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_other", "content": "1"}]}]},
        "messages.2.content.0: tool_result block(s) provided with tool_use_id 'toolu_other'"),
}


@pytest.mark.parametrize(("options", "named"), BAD.values(), ids=BAD.keys())
def test_invalid_tool_requests_are_anthropic_400s(options: dict[str, Any], named: str) -> None:
    client, fake = sdk(ONE_CALL)
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(client, **options)
    assert raised.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": raised.value.body["error"]["message"]}}  # type: ignore[index]
    assert named in raised.value.body["error"]["message"]  # type: ignore[index]
    assert fake.requests == []


# --- what Claude Code 2.x sends ----------------------------------------------------------

CLAUDE_CODE_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 32000,
    "stream": True,
    "metadata": {"user_id": "user_abc_account_def_session_123"},
    "system": [
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "system", "content": "Working directory: /repo."},
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"},
            {"type": "text", "text": "What time is it?",
             "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ]},
    ],
    "tools": [{**TIME, "description": "The time.", "cache_control": {"type": "ephemeral"}}],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "adaptive", "display": "summarized"},
    "output_config": {"effort": "medium"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "temperature": 1,
    "some_future_field": {"x": 1},
}
CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                      "context-management-2025-06-27,effort-2025-11-24",
    "x-api-key": "unused",
}


def test_a_claude_code_request() -> None:
    script = [TextDelta(Channel.REASONING, "Call it."), *tool_call(0, "t", "get_time"),
              Finished(FinishReason.TOOL_CALLS, USAGE)]
    fake = FakeClient(script)
    http = TestClient(create_app(fake))
    response = http.post("/v1/messages?beta=true", json=CLAUDE_CODE_BODY,
                         headers=CLAUDE_CODE_HEADERS)
    assert response.status_code == 200, response.text
    names = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
    assert names[-2:] == ["message_delta", "message_stop"]
    request = fake.requests[0]
    assert request.prompt.messages == (  # type: ignore[union-attr]
        ChatMessage("system", "You are Claude Code.\n\nWorking directory: /repo."),
        ChatMessage("user", "<system-reminder>Be careful.</system-reminder>What time is it?"),
    )
    assert request.reasoning == ReasoningSpec(enabled=True, budget_tokens=4096, effort="medium")
    assert request.tools == (ToolSpec("get_time", "The time.", '{"type": "object"}'),)
    assert request.sampling.max_tokens == 32000


def test_the_beta_sdk_path() -> None:
    # `client.beta.messages` posts to /v1/messages?beta=true with an anthropic-beta header.
    client, fake = sdk(PARALLEL)
    message = client.beta.messages.create(
        model=MODEL, max_tokens=2048, messages=USER, tools=TOOLS,  # type: ignore[arg-type]
        betas=["context-management-2025-06-27"],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        thinking={"type": "adaptive", "display": "summarized"},
        output_config={"effort": "max"}, metadata={"user_id": "u"},
    )
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == [
        "thinking", "text", "tool_use", "tool_use", "tool_use"]
    assert fake.requests[0].reasoning == ReasoningSpec(enabled=True, budget_tokens=None,
                                                       effort="high")
    with client.beta.messages.stream(model=MODEL, max_tokens=2048, messages=USER,
                                     tools=TOOLS,  # type: ignore[arg-type]
                                     betas=["context-management-2025-06-27"]) as stream:
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == message.model_dump(exclude={"id"})
