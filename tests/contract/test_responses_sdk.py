"""The Responses API, driven by the official `openai` SDK against the real app and a fake
client: conversion, output items, streaming, structured output, the store, and errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from ingress.app import create_app
from deployments.responses.sqlite import SqliteResponseStore
from ingress.responses.store import MemoryResponseStore
from replicas.contract import (
    Channel,
    ChatMessage,
    ChatPrompt,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GuidedSpec,
    OutputEvent,
    ReasoningSpec,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolChoice,
    ToolSpec,
    Usage,
)
from replicas.errors import OverloadedError
from tests.fakes import FakeClient

MODEL = "orchard-tiny"
USAGE = Usage(prompt_tokens=11, completion_tokens=8, reasoning_tokens=3, cached_tokens=4)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
           "strict": False}


def call(index: int, call_id: str, name: str, *pieces: str) -> list[OutputEvent]:
    """A scripted tool call: start, one delta per piece, end with the whole arguments."""
    return [ToolCallStart(index, call_id, name), *(ToolCallDelta(index, p) for p in pieces),
            ToolCallEnd(index, "".join(pieces))]


SCRIPTS: dict[str, list[OutputEvent]] = {
    "answer": [TextDelta(Channel.ANSWER, "Four"), TextDelta(Channel.ANSWER, "."),
               Finished(FinishReason.EOS, USAGE)],
    "reasoned": [TextDelta(Channel.REASONING, "2+2 "), TextDelta(Channel.REASONING, "is 4."),
                 TextDelta(Channel.ANSWER, "Four."), Finished(FinishReason.EOS, USAGE)],
    "tool call": [TextDelta(Channel.REASONING, "Need weather."),
                  *call(0, "a1", "get_weather", '{"city":', ' "Paris"}'),
                  *call(1, "b2", "get_weather", '{"city": "Rome"}'),
                  Finished(FinishReason.TOOL_CALLS, USAGE)],
    "length": [TextDelta(Channel.ANSWER, "Fo"), Finished(FinishReason.LENGTH, USAGE)],
}


def sdk(fake: FakeClient, **app: Any) -> tuple[openai.OpenAI, TestClient]:
    http = TestClient(create_app(fake, **app))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0), http


def create(client: openai.OpenAI, **extra: Any) -> Any:
    return client.responses.create(**({"model": MODEL, "input": "What is 2+2?"} | extra))


# --- the response object ------------------------------------------------------------


def test_string_input_and_the_response_object() -> None:
    fake = FakeClient(SCRIPTS["answer"])
    response = create(sdk(fake)[0], max_output_tokens=50, temperature=0.2, top_p=0.9,
                      metadata={"k": "v"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.status, response.model, response.output_text) == ("completed", MODEL, "Four.")
    (message,) = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.status == "completed" and message.content[0].annotations == []
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (11, 8, 19)
    assert usage.input_tokens_details.cached_tokens == 4
    assert usage.output_tokens_details.reasoning_tokens == 3
    assert (response.max_output_tokens, response.temperature, response.top_p) == (50, 0.2, 0.9)
    assert response.metadata == {"k": "v"} and response.store is True
    (request,) = fake.requests
    assert request.prompt == ChatPrompt((ChatMessage("user", "What is 2+2?"),))
    assert request.request_id == response.id
    assert (request.sampling.max_tokens, request.sampling.temperature) == (50, 0.2)


def test_items_instructions_and_history_become_chat_messages() -> None:
    fake = FakeClient(SCRIPTS["answer"])
    create(sdk(fake)[0], instructions="Be brief.", input=[
        {"role": "developer", "content": "Use metric units."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "},
                     {"type": "input_text", "text": "Paris and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Call."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "18C"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Now Rome."}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_3", "output": "21C"},
    ])
    assert fake.requests[0].prompt == ChatPrompt((
        ChatMessage("system", "Be brief."),
        ChatMessage("system", "Use metric units."),
        ChatMessage("user", "Weather in Paris and Rome?"),
        ChatMessage("assistant", "Checking.", reasoning="Call.", tool_calls=(
            ToolCall("call_1", "get_weather", '{"city": "Paris"}'),
            ToolCall("call_2", "get_time", "{}"))),
        ChatMessage("tool", "noon", tool_call_id="call_2", name="get_time"),
        ChatMessage("tool", "18C", tool_call_id="call_1", name="get_weather"),
        ChatMessage("assistant", "", reasoning="Now Rome.", tool_calls=(
            ToolCall("call_3", "get_weather", '{"city": "Rome"}'),)),
        ChatMessage("tool", "21C", tool_call_id="call_3", name="get_weather"),
    ))


@pytest.mark.parametrize(("choice", "parallel", "expected"), [
    ("auto", True, ToolChoice("auto")),
    ("none", True, ToolChoice("none")),
    ("required", False, ToolChoice("required", parallel=False)),
    ({"type": "function", "name": "get_weather"}, True, ToolChoice("required", "get_weather")),
])
def test_tools_and_tool_choice(choice: Any, parallel: bool, expected: ToolChoice) -> None:
    fake = FakeClient(SCRIPTS["tool call"])
    response = create(sdk(fake)[0], tools=[WEATHER, {**WEATHER, "name": "x", "strict": None}],
                      tool_choice=choice, parallel_tool_calls=parallel)
    request = fake.requests[0]
    assert request.tools == (
        ToolSpec("get_weather", "Weather now", json.dumps(WEATHER["parameters"]), False),
        # Omitted: best effort, not strict mode's rules (test_loose_tool_schemas.py).
        ToolSpec("x", "Weather now", json.dumps(WEATHER["parameters"]), False),
    )
    assert request.tool_choice == expected
    assert response.tool_choice == choice or response.tool_choice.name == "get_weather"
    assert [tool.name for tool in response.tools] == ["get_weather", "x"]


def test_a_scripted_function_call_is_a_function_call_item() -> None:
    response = create(sdk(FakeClient(SCRIPTS["tool call"]))[0], tools=[WEATHER])
    reasoning, paris, rome = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need weather."
    assert (paris.type, paris.id, paris.call_id, paris.name, paris.status) == (
        "function_call", "fc_a1", "call_a1", "get_weather", "completed")
    assert json.loads(paris.arguments) == {"city": "Paris"}
    assert rome.call_id == "call_b2" and rome.arguments == '{"city": "Rome"}'
    assert response.status == "completed" and response.output_text == ""


@pytest.mark.parametrize("summary", [None, "auto"])
def test_reasoning_is_content_or_summary(summary: str | None) -> None:
    fake = FakeClient(SCRIPTS["reasoned"])
    response = create(sdk(fake)[0], reasoning={"effort": "low", "summary": summary})
    reasoning, message = response.output
    assert reasoning.id.startswith("rs_") and message.content[0].text == "Four."
    if summary is None:
        assert reasoning.summary == [] and reasoning.content[0].text == "2+2 is 4."
    else:
        assert reasoning.summary[0].text == "2+2 is 4." and not reasoning.content
    assert response.reasoning.effort == "low"
    assert fake.requests[0].reasoning == ReasoningSpec(enabled=True, budget_tokens=1024,
                                                       effort="low")


@pytest.mark.parametrize(("effort", "expected"), [
    ("minimal", ReasoningSpec(enabled=False)),
    ("medium", ReasoningSpec(enabled=True, budget_tokens=4096, effort="medium")),
    ("high", ReasoningSpec(enabled=True, budget_tokens=16384, effort="high")),
    (None, ReasoningSpec()),
])
def test_reasoning_effort_maps_to_a_budget(effort: str | None, expected: ReasoningSpec) -> None:
    fake = FakeClient(SCRIPTS["answer"])
    create(sdk(fake)[0], reasoning={"effort": effort})
    assert fake.requests[0].reasoning == expected


def test_length_is_incomplete() -> None:
    response = create(sdk(FakeClient(SCRIPTS["length"]))[0])
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


# --- structured output --------------------------------------------------------------


class Answer(BaseModel):
    value: int


@pytest.mark.parametrize(("fmt", "expected"), [
    ({"type": "json_schema", "name": "a", "schema": {"type": "object"}, "strict": True},
     GuidedSpec("json_schema", '{"type": "object"}', True)),
    ({"type": "json_object"}, GuidedSpec("json_object")),
    ({"type": "text"}, None),
])
def test_text_format_is_a_guided_spec(fmt: dict[str, Any], expected: GuidedSpec | None) -> None:
    fake = FakeClient([TextDelta(Channel.ANSWER, "{}"), Finished(FinishReason.EOS, USAGE)])
    response = create(sdk(fake)[0], text={"format": fmt})
    assert fake.requests[0].guided == expected
    assert response.text.format.type == fmt["type"]


def test_parse_with_a_pydantic_model() -> None:
    script = [TextDelta(Channel.ANSWER, '{"value": '), TextDelta(Channel.ANSWER, "4}"),
              Finished(FinishReason.GRAMMAR_COMPLETE, USAGE)]
    fake = FakeClient(script)
    parsed = sdk(fake)[0].responses.parse(model=MODEL, input="2+2?", text_format=Answer)
    assert parsed.output_parsed == Answer(value=4)
    guided = fake.requests[0].guided
    assert guided is not None and guided.kind == "json_schema" and guided.strict
    assert json.loads(str(guided.value))["properties"]["value"]["type"] == "integer"


def test_parse_with_tools_reaches_the_replica_with_both() -> None:
    # `text.format` beside tools: the replica's grammar is a call or an answer in it.
    script = [TextDelta(Channel.ANSWER, '{"value": 4}'),
              Finished(FinishReason.GRAMMAR_COMPLETE, USAGE)]
    fake = FakeClient(script)
    parsed = sdk(fake)[0].responses.parse(model=MODEL, input="2+2?", text_format=Answer,
                                          tools=[WEATHER])
    assert parsed.output_parsed == Answer(value=4)
    (request,) = fake.requests
    assert request.guided is not None and request.guided.kind == "json_schema"
    assert [t.name for t in request.tools] == ["get_weather"]


# --- streaming ----------------------------------------------------------------------


def events_of(http: TestClient, **body: Any) -> list[dict[str, Any]]:
    response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True,
                                                **body})
    found = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines()
                     if not line.startswith(":"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        found.append(data)
    return found


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("cut", [None, 1, 2, 3])
def test_stream_final_response_equals_create(name: str, cut: int | None) -> None:
    script = SCRIPTS[name]
    client, http = sdk(FakeClient(script, cuts=[cut] if cut else None))
    whole = create(client, tools=[WEATHER])
    streamed = events_of(http, tools=[WEATHER])
    assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))
    last = streamed[-1]["response"]
    ignore = {"id", "created_at", "completed_at"}
    assert ({k: v for k, v in last.items() if k not in ignore}
            == {k: v for k, v in whole.model_dump(exclude_unset=True).items() if k not in ignore}
            | {"output": last["output"]})
    assert _without_ids(last["output"]) == _without_ids(
        [item.model_dump(exclude_unset=True) for item in whole.output])
    deltas = "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta")
    assert deltas == whole.output_text
    if whole.status == "completed":
        with client.responses.stream(model=MODEL, input="hi", tools=[WEATHER]) as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
        assert text == whole.output_text
        assert _without_ids([_plain(i) for i in final.output]) == _without_ids(
            [_plain(i) for i in whole.output])


def _plain(item: Any) -> dict[str, Any]:
    """An output item without what the SDK's parse helpers add (`parsed*`)."""
    plain: dict[str, Any] = item.model_dump(exclude={"parsed_arguments"})
    for part in plain.get("content") or ():
        part.pop("parsed", None)
    return plain


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "id" or item["type"] == "function_call"}
            for item in items]


def test_stream_event_order() -> None:
    _, http = sdk(FakeClient(SCRIPTS["reasoned"][:2] + SCRIPTS["tool call"][1:]))
    types = [e["type"].removeprefix("response.") for e in events_of(http)]
    assert types == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta",
        "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done", "completed",
    ]


def test_stream_with_a_summary_and_a_message() -> None:
    _, http = sdk(FakeClient(SCRIPTS["reasoned"]))
    found = events_of(http, reasoning={"summary": "auto"})
    types = [e["type"].removeprefix("response.") for e in found]
    assert types == [
        "created", "in_progress",
        "output_item.added", "reasoning_summary_part.added", "reasoning_summary_text.delta",
        "reasoning_summary_text.delta", "reasoning_summary_text.done",
        "reasoning_summary_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done", "completed",
    ]
    delta = next(e for e in found if e["type"] == "response.output_text.delta")
    assert (delta["output_index"], delta["content_index"], delta["delta"]) == (1, 0, "Four.")
    assert delta["item_id"] == found[-1]["response"]["output"][1]["id"]


def test_stream_ends_incomplete_at_the_length_limit() -> None:
    _, http = sdk(FakeClient(SCRIPTS["length"]))
    last = events_of(http)[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_failure_mid_stream_is_response_failed() -> None:
    script = [TextDelta(Channel.ANSWER, "Fo"), Failed(ErrorKind.INTERNAL, "engine fault")]
    client, http = sdk(FakeClient(script))
    last = events_of(http)[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error", "message": "engine fault"}
    assert last["response"]["output"][0]["content"][0]["text"] == "Fo"
    with client.responses.stream(model=MODEL, input="hi") as stream:
        kinds = [event.type for event in stream]
        with pytest.raises(RuntimeError, match="response.completed"):
            stream.get_final_response()
    assert kinds[-1] == "response.failed"


# --- hosted tools -------------------------------------------------------------------


def test_hosted_tools_are_left_out_with_a_warning() -> None:
    fake = FakeClient(SCRIPTS["answer"])
    client, http = sdk(fake)
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="hi", tools=[{"type": "web_search"}, WEATHER,
                                        {"type": "code_interpreter", "container": {"type": "auto"}}])
    assert "code_interpreter, web_search" in raw.headers["x-orchard-warning"]
    response = raw.parse()
    assert response.model_extra["orchard_warnings"] == [raw.headers["x-orchard-warning"]]
    assert [tool.name for tool in fake.requests[0].tools] == ["get_weather"]
    streamed = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True,
                                                "tools": [{"type": "web_search_preview"}]})
    assert "web_search_preview" in streamed.headers["x-orchard-warning"]
    plain = http.post("/v1/responses", json={"model": MODEL, "input": "hi"})
    assert "x-orchard-warning" not in plain.headers and "orchard_warnings" not in plain.json()


# --- the store ----------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation() -> None:
    fake = FakeClient(lambda request: SCRIPTS["tool call"] if len(fake.requests) == 1
                      else SCRIPTS["answer"])
    client, _ = sdk(fake)
    first = create(client, instructions="Be brief.", input="Weather?", tools=[WEATHER])
    second = create(client, previous_response_id=first.id, instructions="Be kind.", input=[
        {"type": "function_call_output", "call_id": "call_a1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_b2", "output": "21C"}])
    assert second.previous_response_id == first.id
    calls = (ToolCall("call_a1", "get_weather", '{"city": "Paris"}'),
             ToolCall("call_b2", "get_weather", '{"city": "Rome"}'))
    assert fake.requests[1].prompt == ChatPrompt((
        ChatMessage("system", "Be kind."),  # instructions are not carried over
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", reasoning="Need weather.", tool_calls=calls),
        ChatMessage("tool", "18C", tool_call_id="call_a1", name="get_weather"),
        ChatMessage("tool", "21C", tool_call_id="call_b2", name="get_weather"),
    ))
    third = create(client, previous_response_id=second.id, input="Thanks!")
    assert [m.role for m in fake.requests[2].prompt.messages] == [  # type: ignore[union-attr]
        "user", "assistant", "tool", "tool", "assistant", "user"]
    assert client.responses.retrieve(third.id).model_dump() == third.model_dump()


def test_a_streamed_response_is_stored_too() -> None:
    client, http = sdk(FakeClient(SCRIPTS["answer"]))
    last = events_of(http)[-1]["response"]
    assert client.responses.retrieve(last["id"]).output_text == "Four."


def test_store_false_is_stateless() -> None:
    store = MemoryResponseStore()
    client, http = sdk(FakeClient(SCRIPTS["answer"]), response_store=store)
    response = create(client, store=False)
    events_of(http, store=False)
    assert response.store is False and len(store) == 0
    with pytest.raises(openai.NotFoundError) as raised:
        create(client, previous_response_id=response.id)
    assert raised.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    assert raised.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_the_given_store_is_used_even_while_empty(kind: str, tmp_path: Path) -> None:
    # An empty store is falsy (it has `__len__`): the app once swapped it for its own
    # in-memory one, so `serve run` never wrote its SQLite file (issue 32).
    store: MemoryResponseStore | SqliteResponseStore = MemoryResponseStore() \
        if kind == "memory" else SqliteResponseStore(tmp_path / "responses.sqlite3")
    client, _ = sdk(FakeClient(SCRIPTS["answer"]), response_store=store)
    response = create(client)
    assert len(store) == 1
    assert client.responses.retrieve(response.id).output_text == "Four."


# --- errors -------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input.0.call_id"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "hologram", "data": "x"}]}]},
     "input.0.content.0.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"temperature": 3}, "temperature"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input.0.message.role"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"background": True}, "background"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input.0.arguments"),
])
def test_bad_requests_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    fake = FakeClient(SCRIPTS["answer"])
    client, http = sdk(fake)
    response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert fake.requests == []  # refused before any model time
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**({"model": MODEL, "input": "hi"} | body))


def test_unknown_model_and_unknown_response_are_404s() -> None:
    client, http = sdk(FakeClient(SCRIPTS["answer"]))
    with pytest.raises(openai.NotFoundError):
        create(client, model="gpt-9")
    missing = http.get("/v1/responses/resp_nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


def test_an_early_failure_is_an_http_error() -> None:
    client, http = sdk(FakeClient([OverloadedError("busy")]))
    response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["type"] == "overloaded_error"
    with pytest.raises(openai.BadRequestError):
        sdk(FakeClient([Failed(ErrorKind.CONTEXT_LENGTH, "too long")]))[0].responses.create(
            model=MODEL, input="hi")
