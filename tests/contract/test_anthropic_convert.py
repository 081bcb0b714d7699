"""The Anthropic Messages adapter's request conversion: a Messages body becomes one
GenerationRequest (messages, sampling, stops, thinking, tools)."""

from __future__ import annotations

from typing import Any

import pytest

from ingress.anthropic.convert import omits_thinking, to_generation_request
from ingress.anthropic.models import MessagesRequest
from ingress.client import ModelCard
from replicas.contract import (
    ChatMessage,
    GenerationRequest,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from tests.contract.anthropic_wire import MODEL, USER, body, done, http, say


def convert(**overrides: Any) -> GenerationRequest:
    return to_generation_request(
        MessagesRequest.model_validate(body(**overrides)), ModelCard(MODEL)
    )


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


def test_an_unknown_block_in_a_tool_result_is_named_in_a_400() -> None:
    # Images are placeholders (test_media_placeholders.py); unknown types stay a 400.
    client, fake = http()
    messages = USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"type": "hologram", "source": {}}]}]},
    ]
    response = client.post("/v1/messages", json=body(messages=messages))
    assert response.status_code == 400 and fake.requests == []
    assert "messages.2.content.0.content.0" in response.json()["error"]["message"]
    assert "'hologram'" in response.json()["error"]["message"]


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
