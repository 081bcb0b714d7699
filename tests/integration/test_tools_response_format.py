"""`tools` with `response_format` (and the Responses API's `text.format`), and chat's
`reasoning_effort: "none"`, through the official `openai` SDK against the real app over the
real tiny model: its replica in this process behind `LocalModelClient`, as the colocated
layout serves it (no Ray).

With both, the model either calls a tool or answers in the schema, and either is valid by
construction: the tiny model calls for its tool scripts, and answers `json-record`'s
question in JSON; `jsonschema` checks both. The schema is bounded (lengths, ranges, item
counts) so that the greedy answer ends inside `max_tokens` whatever the model makes of an
unscripted prompt.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from deployments.model_clients import LocalModelClient
from ingress.app import create_app
from ingress.client import ModelCard
from replicas.builtin import script
from replicas.replica import ModelReplica

MODEL = "orchard-tiny"
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "country": {"type": "string", "maxLength": 20},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "born", "country", "skills", "active"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "record", "schema": RECORD, "strict": True}}
TOOLS = script("tool-one").tool_dicts  # get_weather and get_time
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def oai(replica: ModelReplica) -> Iterator[openai.OpenAI]:
    client = LocalModelClient(replica, ModelCard(MODEL, aliases=("tiny",)), max_ongoing=8)
    with TestClient(create_app(client)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                            max_retries=0)


def effort(sid: str) -> dict[str, str]:
    """Thinking as the script is trained: off (`reasoning_effort: none`) for the tool
    scripts, the template's default for `json-record`."""
    return {"reasoning_effort": "none"} if script(sid).enable_thinking is False else {}


def chat(oai: openai.OpenAI, sid: str, stream: bool = False, **extra: Any) -> Any:
    """The script's messages with both tools and the record's schema, greedy."""
    args: dict[str, Any] = {"model": MODEL, "messages": script(sid).message_dicts,
                            "temperature": 0, "max_tokens": 300, "tools": TOOLS,
                            "response_format": RESPONSE_FORMAT, **effort(sid), **extra}
    return oai.chat.completions.create(stream=stream, **args)


def streamed(chunks: Any) -> tuple[str, dict[int, list[str]], str | None]:
    """A stream's content, its calls' (name, arguments) by index, and its finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += (call.function.name or "") if call.function else ""
            entry[1] += (call.function.arguments or "") if call.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def assert_valid_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_call_comes_back_as_a_valid_tool_call(oai: openai.OpenAI) -> None:
    choice = chat(oai, "tool-one").choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                         {"city": "Paris"})
    assert_valid_call(call.function.name, call.function.arguments)
    content, calls, finish = streamed(chat(oai, "tool-one", stream=True))
    assert finish == "tool_calls" and not content
    assert [tuple(c) for c in calls.values()] == [(call.function.name, call.function.arguments)]


def test_an_answer_comes_back_as_json_valid_under_the_schema(oai: openai.OpenAI) -> None:
    # Offered the tools, the model answers this question rather than calling: the
    # grammar holds it to the schema, and the grammar's end is the answer's end.
    choice = chat(oai, "json-record").choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.content), RECORD)
    content, calls, finish = streamed(chat(oai, "json-record", stream=True))
    assert (content, calls, finish) == (choice.message.content, {}, "stop")


def test_a_stop_string_does_not_cut_the_answer(oai: openai.OpenAI) -> None:
    # The grammar, not a stop, ends an answer it owns: a stop inside it would break the JSON.
    choice = chat(oai, "json-record", stop=['"', ","]).choices[0]
    jsonschema.validate(json.loads(choice.message.content), RECORD)


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_drops_the_answer(oai: openai.OpenAI, tool_choice: Any) -> None:
    # json-record's question gets a JSON answer under `auto`; forced, it gets a call.
    choice = chat(oai, "json-record", tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call.function.name, call.function.arguments)
    if isinstance(tool_choice, dict):
        assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}


def test_tool_choice_none_answers_in_the_schema(oai: openai.OpenAI) -> None:
    # tool-one's question gets a call under `auto`; under `none`, only the schema applies.
    choice = chat(oai, "tool-one", tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.content), RECORD)


def test_a_bad_schema_beside_tools_is_a_400_in_openais_shape(oai: openai.OpenAI) -> None:
    # llguidance knows `uniqueItems` but cannot enforce it: a 400, with tools as without.
    bad = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}}
    errors = []
    for tools in (TOOLS, openai.omit):
        with pytest.raises(openai.BadRequestError) as raised:
            chat(oai, "tool-one", response_format=bad, tools=tools)
        assert raised.value.status_code == 400
        errors.append(raised.value.body)
    assert errors[0] == errors[1]
    assert isinstance(errors[0], dict) and errors[0]["type"] == "invalid_request_error"
    assert set(errors[0]) == {"message", "type", "param", "code"}
    assert "uniqueItems" in errors[0]["message"]
    assert chat(oai, "tool-one").choices[0].finish_reason == "tool_calls"  # still serving


# ---- Responses API: text.format with tools ----------------------------------------------

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
TEXT_FORMAT = {"format": {"type": "json_schema", "name": "record", "schema": RECORD,
                          "strict": True}}


def respond(oai: openai.OpenAI, sid: str) -> Any:
    (message,) = script(sid).message_dicts
    thinking = {"reasoning": {"effort": "none"}} if effort(sid) else {}
    return oai.responses.create(model=MODEL, input=message["content"], temperature=0,
                                max_output_tokens=300, tools=RESPONSES_TOOLS,
                                text=TEXT_FORMAT, **thinking)


def test_responses_call_or_answer_in_the_schema(oai: openai.OpenAI) -> None:
    called = respond(oai, "tool-one")
    (item,) = called.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert_valid_call(item.name, item.arguments)
    answered = respond(oai, "json-record")
    assert answered.status == "completed"
    assert [item.type for item in answered.output] == ["message"]
    jsonschema.validate(json.loads(answered.output_text), RECORD)


# ---- reasoning_effort: none --------------------------------------------------------------


@pytest.mark.parametrize(("effort", "thinks"), [("none", False), ("minimal", False),
                                                ("low", True), (None, True)])
def test_reasoning_effort_none_turns_thinking_off(oai: openai.OpenAI, effort: str | None,
                                                  thinks: bool) -> None:
    riddle = script("riddle-think")
    extra = {} if effort is None else {"reasoning_effort": effort}
    message = oai.chat.completions.create(model=MODEL, messages=riddle.message_dicts,
                                          temperature=0, max_tokens=200,
                                          **extra).choices[0].message
    assert message.content == riddle.answer
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert reasoning == (riddle.reasoning if thinks else None)
