"""Tool calling over `serve run` with the official SDKs: the built-in model's scripted tool
dialogues come back as exactly the scripted calls, streamed and not, in both APIs."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from replicas.builtin import script

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


# ---- OpenAI chat ------------------------------------------------------------------------


def chat_args(sid: str, **extra: Any) -> dict[str, Any]:
    s = script(sid)
    args: dict[str, Any] = {"model": MODEL, "messages": s.message_dicts, "temperature": 0,
                            "max_tokens": 200, "tools": s.tool_dicts}
    if s.enable_thinking is not None:
        args["extra_body"] = {"chat_template_kwargs": {"enable_thinking": s.enable_thinking}}
    args.update(extra)
    return args


def stream_calls(oai: openai.OpenAI, **args: Any) -> tuple[Any, list[str]]:
    """A streamed chat completion's final choice, and each call's argument pieces joined
    as they arrived (one string per call, by index)."""
    with oai.chat.completions.stream(**args) as stream:
        pieces: dict[int, list[str]] = {}
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                for delta in event.chunk.choices[0].delta.tool_calls or []:
                    piece = delta.function.arguments if delta.function else None
                    pieces.setdefault(delta.index, []).append(piece or "")
        final = stream.get_final_completion().choices[0]
    return final, ["".join(pieces[i]) for i in sorted(pieces)]


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("sid", ["tool-one", "tool-parallel", "tool-text-then-call",
                                 "tool-after-reasoning"])
def test_openai_calls_are_the_scripted_ones_streamed_or_not(oai: openai.OpenAI, sid: str) -> None:
    s = script(sid)
    full = oai.chat.completions.create(**chat_args(sid))
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == list(s.expected_calls)
    assert (choice.message.content or "").rstrip("\n") == s.answer_text
    assert (getattr(choice.message, "reasoning_content", None) or "") == (s.reasoning or "")
    ids = [c.id for c in choice.message.tool_calls or []]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)

    # The SDK's own accumulation of the streamed deltas gives the same calls.
    with oai.chat.completions.stream(**chat_args(sid)) as stream:
        first_ids: dict[int, str] = {}
        pieces: dict[int, list[str]] = {}
        for event in stream:
            if event.type != "chunk" or not event.chunk.choices:
                continue
            for delta in event.chunk.choices[0].delta.tool_calls or []:
                if delta.id is not None:  # the first delta of a call: its id and name
                    assert delta.index not in first_ids and delta.function.name
                    first_ids[delta.index] = delta.id
                pieces.setdefault(delta.index, []).append(delta.function.arguments or "")
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert calls_of(streamed.message) == list(s.expected_calls)
    assert ["".join(pieces[i]) for i in sorted(pieces)] == [a for _, a in s.expected_calls]
    assert [c.id for c in streamed.message.tool_calls or []] == [first_ids[i] for i in sorted(first_ids)]


def test_openai_result_in_history_gives_the_scripted_answer(oai: openai.OpenAI) -> None:
    s = script("tool-result")
    full = oai.chat.completions.create(**chat_args("tool-result"))
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].message.content == s.answer and not full.choices[0].message.tool_calls


# ---- forced calls: tool_choice `required` and a named tool --------------------------------
#
# Each case forces what the model would not do unforced, and first asks unforced to show it
# (the control), so a server that ignored tool_choice fails here: on `tool-result` (the
# weather call and its result in history) the model answers in text; on `tool-one` it calls
# get_weather, never get_unit, a tool no script has. get_unit's schema is one enum, so the
# grammar alone decides what a forced call may say, and every forced call is checked: its
# arguments parse as JSON and validate against the schema of the tool it names, and it is
# complete (finish_reason tool_calls, never length: these forced calls take 20-28 tokens,
# and max_tokens is 200).

UNIT_SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"], "additionalProperties": False}
UNIT_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_unit", "description": "Pick a temperature unit.", "parameters": UNIT_SCHEMA}}
# (id, script, tools beyond the script's, the chat tool_choice, the tools a call may name)
FORCED: list[tuple[str, str, list[dict[str, Any]], Any, set[str]]] = [
    ("required", "tool-result", [], "required", {"get_weather", "get_time"}),
    ("named", "tool-one", [UNIT_TOOL], {"type": "function", "function": {"name": "get_unit"}},
     {"get_unit"}),
]
FORCED_IDS = [case[0] for case in FORCED]


def schemas(sid: str, extra: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each offered tool's parameters schema, by name."""
    return {t["function"]["name"]: t["function"]["parameters"]
            for t in [*script(sid).tool_dicts, *extra]}


def check_forced(calls: list[tuple[str, str]], allowed: set[str],
                 by_name: dict[str, dict[str, Any]]) -> None:
    assert calls, "a forced choice made no call"
    for name, arguments in calls:
        assert name in allowed, (name, allowed)
        jsonschema.validate(json.loads(arguments), by_name[name])


@pytest.mark.parametrize(("sid", "extra", "choice", "allowed"),
                         [case[1:] for case in FORCED], ids=FORCED_IDS)
def test_openai_forced_choice_makes_a_call_the_model_would_not(
        oai: openai.OpenAI, sid: str, extra: list[dict[str, Any]], choice: Any,
        allowed: set[str]) -> None:
    tools = [*script(sid).tool_dicts, *extra]
    by_name = schemas(sid, extra)
    control = oai.chat.completions.create(**chat_args(sid, tools=tools)).choices[0]
    assert not {name for name, _ in calls_of(control.message)} & allowed, control

    full = oai.chat.completions.create(**chat_args(sid, tools=tools, tool_choice=choice))
    assert full.choices[0].finish_reason == "tool_calls", full
    check_forced(calls_of(full.choices[0].message), allowed, by_name)

    final, pieces = stream_calls(oai, **chat_args(sid, tools=tools, tool_choice=choice))
    assert final.finish_reason == "tool_calls", final
    check_forced(calls_of(final.message), allowed, by_name)
    # The deltas themselves add up to the same complete calls.
    assert pieces == [a for _, a in calls_of(final.message)]


def test_openai_choice_none_never_calls(oai: openai.OpenAI) -> None:
    full = oai.chat.completions.create(**chat_args("tool-one", tool_choice="none", max_tokens=40))
    message = full.choices[0].message
    assert not message.tool_calls and full.choices[0].finish_reason in ("stop", "length")
    assert "<tool_call>" not in (message.content or "")


def test_openai_parallel_off_allows_one_call(oai: openai.OpenAI) -> None:
    full = oai.chat.completions.create(**chat_args("tool-parallel", parallel_tool_calls=False,
                                                   tool_choice="required"))
    assert full.choices[0].finish_reason == "tool_calls"
    assert calls_of(full.choices[0].message) == list(script("tool-parallel").expected_calls[:1])


class GetWeather(BaseModel):
    city: str


def test_openai_parse_with_a_pydantic_function_tool(oai: openai.OpenAI) -> None:
    s = script("tool-parse")
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather",
                                         description="Get the current weather in a city.")
    assert tool["function"]["parameters"] == s.tool_dicts[0]["function"]["parameters"]
    parsed = oai.chat.completions.parse(
        model=MODEL, messages=s.message_dicts, tools=[tool], temperature=0, max_tokens=100,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    call = parsed.choices[0].message.tool_calls[0]
    assert parsed.choices[0].finish_reason == "tool_calls"
    assert call.function.parsed_arguments == GetWeather(city="Berlin")


def test_openai_unknown_named_tool_is_a_400(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(**chat_args(
            "tool-one", tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "tool_choice"  # type: ignore[index]


# ---- Anthropic messages -------------------------------------------------------------------


def anthropic_tools(sid: str) -> list[dict[str, Any]]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in script(sid).tool_dicts]


def anthropic_args(sid: str, **extra: Any) -> dict[str, Any]:
    s = script(sid)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "tools": anthropic_tools(sid),
                            "messages": s.message_dicts, "extra_body": {"temperature": 0}}
    if s.enable_thinking:  # Anthropic does not think unless asked
        body["thinking"] = {"type": "enabled", "budget_tokens": 100}
        body["max_tokens"] = 300
    body.update(extra)
    return body


def uses_of(message: Any) -> list[tuple[str, str]]:
    return [(b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("sid", ["tool-one", "tool-parallel", "tool-text-then-call",
                                 "tool-after-reasoning"])
def test_anthropic_tool_use_is_the_scripted_one_streamed_or_not(
        claude: anthropic.Anthropic, sid: str) -> None:
    s = script(sid)
    full = claude.messages.create(**anthropic_args(sid))
    assert full.stop_reason == "tool_use"
    assert uses_of(full) == list(s.expected_calls)
    text = "".join(b.text for b in full.content if b.type == "text")
    assert text.rstrip("\n") == s.answer_text
    thinking = "".join(b.thinking for b in full.content if b.type == "thinking")
    assert thinking == (s.reasoning or "")
    ids = [b.id for b in full.content if b.type == "tool_use"]
    assert all(i.startswith("toolu_") for i in ids) and len(set(ids)) == len(ids)

    partial: dict[int, list[str]] = {}
    started: dict[int, Any] = {}
    with claude.messages.stream(**anthropic_args(sid)) as stream:
        for event in stream:
            if event.type == "content_block_start" and event.content_block.type == "tool_use":
                assert event.content_block.input == {}
                started[event.index] = event.content_block
            elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.setdefault(event.index, []).append(event.delta.partial_json)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and uses_of(final) == list(s.expected_calls)
    assert ["".join(partial[i]) for i in sorted(partial)] == [a for _, a in s.expected_calls]
    assert [started[i].id for i in sorted(started)] == [
        b.id for b in final.content if b.type == "tool_use"]


def test_anthropic_tool_result_gives_the_scripted_answer(claude: anthropic.Anthropic) -> None:
    s = script("tool-result")
    call = json.loads(s.message_dicts[1]["tool_calls"][0]["function"]["arguments"])
    messages = [
        {"role": "user", "content": s.message_dicts[0]["content"]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": call}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": s.message_dicts[2]["content"]}]},
    ]
    full = claude.messages.create(**anthropic_args("tool-result", messages=messages))
    assert full.stop_reason == "end_turn"
    assert [b.text for b in full.content if b.type == "text"] == [s.answer]


def anthropic_history(sid: str) -> list[dict[str, Any]]:
    """A script's messages in Anthropic's shape: calls as tool_use, results as tool_result."""
    messages: list[dict[str, Any]] = []
    for m in script(sid).message_dicts:
        if m["role"] == "assistant" and m.get("tool_calls"):
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})
        elif m["role"] == "tool":
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": m["tool_call_id"],
                 "content": m["content"]}]})
        else:
            messages.append({"role": m["role"], "content": m["content"]})
    return messages


# The FORCED cases (see above) with Anthropic's tool_choice: `any` and a named `tool`.
ANTHROPIC_CHOICE = {"required": {"type": "any"}, "named": {"type": "tool", "name": "get_unit"}}


@pytest.mark.parametrize(("case_id", "sid", "extra", "allowed"),
                         [(c[0], c[1], c[2], c[4]) for c in FORCED], ids=FORCED_IDS)
def test_anthropic_forced_choice_makes_a_call_the_model_would_not(
        claude: anthropic.Anthropic, case_id: str, sid: str, extra: list[dict[str, Any]],
        allowed: set[str]) -> None:
    tools = [*anthropic_tools(sid), *({"name": t["function"]["name"],
                                       "description": t["function"]["description"],
                                       "input_schema": t["function"]["parameters"]}
                                      for t in extra)]
    by_name = schemas(sid, extra)
    args = anthropic_args(sid, tools=tools, messages=anthropic_history(sid))
    control = claude.messages.create(**args)
    assert not {name for name, _ in uses_of(control)} & allowed, control

    forced = {**args, "tool_choice": ANTHROPIC_CHOICE[case_id]}
    full = claude.messages.create(**forced)
    assert full.stop_reason == "tool_use", full
    check_forced(uses_of(full), allowed, by_name)

    partial: dict[int, list[str]] = {}
    with claude.messages.stream(**forced) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.setdefault(event.index, []).append(event.delta.partial_json)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use", final
    check_forced(uses_of(final), allowed, by_name)
    # The streamed JSON pieces, joined, are each call's whole input.
    assert [json.loads("".join(partial[i])) for i in sorted(partial)] == [
        b.input for b in final.content if b.type == "tool_use"]


def test_anthropic_disable_parallel_tool_use_allows_one_call(claude: anthropic.Anthropic) -> None:
    full = claude.messages.create(**anthropic_args(
        "tool-parallel", tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert full.stop_reason == "tool_use"
    assert uses_of(full) == list(script("tool-parallel").expected_calls[:1])


def test_anthropic_unmatched_tool_result_is_a_400(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(**anthropic_args("tool-one", messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "Let me see."},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_missing", "content": "18"}]}]))
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
