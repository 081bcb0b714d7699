"""Tool calling on /v1/chat/completions, driven by the official `openai` SDK against the real
app and a fake client that scripts the replica's tool events."""

from __future__ import annotations

import json
from typing import Any

import openai
import pydantic
import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from replicas.contract import (
    Channel,
    ChatMessage,
    Finished,
    FinishReason,
    OutputEvent,
    TextDelta,
    ToolCall,
    ToolChoice,
    ToolSpec,
    Usage,
)
from tests.fakes import FakeClient, one_call_script, parallel_calls_script, tool_call

USAGE = Usage(prompt_tokens=20, completion_tokens=12, cached_tokens=8)
USER = [{"role": "user", "content": "Weather in Paris and Rome?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]

ONE_CALL = one_call_script(USAGE)
PARALLEL = parallel_calls_script(USAGE)


def sdk(fake: FakeClient) -> tuple[openai.OpenAI, TestClient]:
    http = TestClient(create_app(fake))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0), http


def chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(model="orchard-tiny", messages=USER, tools=TOOLS,
                                          **extra)


def data_frames(text: str) -> list[Any]:
    frames = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(frame) for frame in frames[:-1]]


# --- responses --------------------------------------------------------------------------


def test_a_call_without_text() -> None:
    client, _ = sdk(FakeClient(ONE_CALL))
    choice = chat(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id == "call_a1" and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')


def test_parallel_calls_after_reasoning_and_text() -> None:
    client, _ = sdk(FakeClient(PARALLEL))
    body = chat(client)
    message = body.choices[0].message
    assert message.content == "Checking both."
    assert message.model_extra["reasoning_content"] == "Two cities."
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_a1", "get_weather", '{"city": "Paris"}'),
        ("call_b2", "get_weather", '{"city": "Rome"}'),
        ("call_c3", "get_time", "{}"),
    ]
    assert body.usage.prompt_tokens_details.cached_tokens == 8


def test_streamed_chunks() -> None:
    _, http = sdk(FakeClient(ONE_CALL))
    response = http.post("/v1/chat/completions", json={
        "model": "orchard-tiny", "messages": USER, "tools": TOOLS, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = data_frames(response.text)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert deltas == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_a1", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        {},  # ToolCallEnd sends nothing; this is the finish chunk
    ]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}


def test_streamed_parallel_calls_have_their_indexes() -> None:
    client, _ = sdk(FakeClient(PARALLEL))
    chunks = list(chat(client, stream=True))
    calls = [call for chunk in chunks if chunk.choices
             for call in chunk.choices[0].delta.tool_calls or ()]
    assert [(c.index, c.id, c.function.name) for c in calls if c.id] == [
        (0, "call_a1", "get_weather"), (1, "call_b2", "get_weather"), (2, "call_c3", "get_time")]
    rome = "".join(c.function.arguments for c in calls if c.index == 1)
    assert rome == '{"city": "Rome"}'


def final_by_stream_helper(client: openai.OpenAI) -> Any:
    with client.chat.completions.stream(model="orchard-tiny", messages=USER,
                                        tools=TOOLS) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        return stream.get_final_completion(), done


SPLIT_SCRIPTS = {
    "one call": ONE_CALL,
    "text then calls": PARALLEL[1:],
}


@pytest.mark.parametrize("script", SPLIT_SCRIPTS.values(), ids=SPLIT_SCRIPTS.keys())
def test_stream_helper_equals_the_body_at_every_batch_boundary(script: list[OutputEvent]) -> None:
    whole = chat(sdk(FakeClient(script))[0]).choices[0]
    expected_calls = [call.model_dump() for call in whole.message.tool_calls]
    for cut in range(len(script) + 1):  # 0 and len: all events in one batch
        client, _ = sdk(FakeClient(script, cuts=[cut]))
        final, done = final_by_stream_helper(client)
        choice = final.choices[0]
        assert choice.finish_reason == whole.finish_reason == "tool_calls"
        assert choice.message.content == whole.message.content
        # The SDK's snapshot keeps the stream's `index` and its own `parsed_arguments`.
        calls = [call.model_dump(exclude={"index": True, "function": {"parsed_arguments"}})
                 for call in choice.message.tool_calls]
        assert calls == expected_calls
        assert [event.arguments for event in done] == [
            call["function"]["arguments"] for call in expected_calls]


def test_stream_helper_after_reasoning() -> None:
    # The role chunk leaves before the first event is known: with reasoning first it carries
    # content "", which the SDK keeps; the non-streaming body has null content only when
    # there was no answer text at all.
    script = [TextDelta(Channel.REASONING, "Hmm."), *ONE_CALL]
    final, _ = final_by_stream_helper(sdk(FakeClient(script))[0])
    message = final.choices[0].message
    assert message.content == "" and chat(sdk(FakeClient(script))[0]).choices[
        0].message.content is None
    assert message.model_extra["reasoning_content"] == "Hmm."
    assert [c.function.arguments for c in message.tool_calls] == ['{"city": "Paris"}']


class Weather(pydantic.BaseModel):
    """Current weather in a city."""

    city: str
    unit: str


def test_parse_with_a_pydantic_function_tool() -> None:
    script = [*tool_call(0, "p", "Weather", '{"city": "Paris", ', '"unit": "C"}'),
              Finished(FinishReason.TOOL_CALLS, USAGE)]
    fake = FakeClient(script)
    client, _ = sdk(fake)
    tool = openai.pydantic_function_tool(Weather)
    completion = client.chat.completions.parse(model="orchard-tiny", messages=USER, tools=[tool])
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.parsed_arguments == Weather(city="Paris", unit="C")
    (spec,) = fake.requests[0].tools
    assert spec.name == "Weather" and spec.strict is True
    assert spec.description == "Current weather in a city."
    assert json.loads(spec.parameters) == tool["function"]["parameters"]
    with client.chat.completions.stream(model="orchard-tiny", messages=USER,
                                        tools=[tool]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.parsed_arguments == Weather(
        city="Paris", unit="C")


class Forecast(pydantic.BaseModel):
    city: str
    sunny: bool


@pytest.mark.parametrize("branch", ["call", "answer"])
def test_parse_with_a_function_tool_and_a_response_format(branch: str) -> None:
    # Agent frameworks send both: the replica gets both (its grammar is a call or an
    # answer in the schema), and the SDK parses whichever comes back.
    script = ([*tool_call(0, "p", "Weather", '{"city": "Paris", "unit": "C"}'),
               Finished(FinishReason.TOOL_CALLS, USAGE)] if branch == "call" else
              [TextDelta(Channel.ANSWER, '{"city": "Paris", "sunny": true}'),
               Finished(FinishReason.GRAMMAR_COMPLETE, USAGE)])
    fake = FakeClient(script)
    client, _ = sdk(fake)
    message = client.chat.completions.parse(
        model="orchard-tiny", messages=USER, tools=[openai.pydantic_function_tool(Weather)],
        response_format=Forecast).choices[0].message
    if branch == "call":
        assert message.tool_calls[0].function.parsed_arguments == Weather(city="Paris", unit="C")
        assert message.parsed is None
    else:
        assert message.parsed == Forecast(city="Paris", sunny=True) and not message.tool_calls
    (request,) = fake.requests
    assert [t.name for t in request.tools] == ["Weather"]
    assert request.guided is not None and request.guided.kind == "json_schema"
    assert json.loads(str(request.guided.value))["properties"].keys() == {"city", "sunny"}


# --- the request the replica gets --------------------------------------------------------


def test_tools_choice_and_history_reach_the_replica() -> None:
    fake = FakeClient(ONE_CALL)
    client, _ = sdk(fake)
    history: list[Any] = [
        {"role": "system", "content": "Use tools."},
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_x", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_y", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_y", "content": "noon"},
        {"role": "tool", "tool_call_id": "call_x",
         "content": [{"type": "text", "text": "Sunny"}]},
        {"role": "user", "content": "Thanks"},
    ]
    client.chat.completions.create(
        model="orchard-tiny", messages=history, parallel_tool_calls=False,
        tools=[WEATHER, {"type": "function", "function": {
            "name": "get_time", "parameters": {"type": "object"}, "strict": True}}],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    request = fake.requests[0]
    assert request.tools == (
        ToolSpec("get_weather", "Current weather in a city.",
                 json.dumps(WEATHER["function"]["parameters"])),  # type: ignore[index]
        ToolSpec("get_time", None, '{"type": "object"}', strict=True),
    )
    assert request.tool_choice == ToolChoice("required", "get_time", parallel=False)
    assert request.prompt.messages == (  # type: ignore[union-attr]
        ChatMessage("system", "Use tools."),
        ChatMessage("user", "Weather in Paris and Rome?"),
        ChatMessage("assistant", "", tool_calls=(
            ToolCall("call_x", "get_weather", '{"city": "Paris"}'),
            ToolCall("call_y", "get_time", "{}"))),
        ChatMessage("tool", "noon", tool_call_id="call_y", name="get_time"),
        ChatMessage("tool", "Sunny", tool_call_id="call_x", name="get_weather"),
        ChatMessage("user", "Thanks"),
    )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, ToolChoice("auto")),
        ({"tool_choice": "auto"}, ToolChoice("auto")),
        ({"tool_choice": "none"}, ToolChoice("none")),
        ({"tool_choice": "required", "parallel_tool_calls": True}, ToolChoice("required")),
        ({"tool_choice": "required", "parallel_tool_calls": False},
         ToolChoice("required", parallel=False)),
    ],
)
def test_tool_choice_forms(extra: dict[str, Any], expected: ToolChoice) -> None:
    fake = FakeClient(ONE_CALL)
    chat(sdk(fake)[0], **extra)
    assert fake.requests[0].tool_choice == expected
    assert [spec.name for spec in fake.requests[0].tools] == ["get_weather", "get_time"]
    # A function without parameters takes none.
    assert fake.requests[0].tools[1].parameters == '{"type": "object", "properties": {}}'


def test_no_tools_keeps_the_defaults() -> None:
    fake = FakeClient([TextDelta(Channel.ANSWER, "hi"), Finished(FinishReason.EOS, USAGE)])
    client, _ = sdk(fake)
    client.chat.completions.create(model="orchard-tiny", messages=USER, tool_choice="none")
    assert fake.requests[0].tools == () and fake.requests[0].tool_choice == ToolChoice("none")


# --- 400s before any replica time --------------------------------------------------------

ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_x", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}


def bad_arguments(arguments: str) -> list[Any]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]


BAD = {
    "hosted tool type": ({"tools": [WEATHER, {"type": "web_search"}]}, "tools.1.type"),
    "custom tool type": ({"tools": [{"type": "custom", "custom": {"name": "x"}}]},
                         "tools.0.type"),
    "function without function": ({"tools": [{"type": "function"}]}, "tools.0.function"),
    "duplicate names": ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    "choice naming an unknown tool": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice"),
    "required without tools": ({"tool_choice": "required"}, "tool_choice"),
    "named choice without tools": (
        {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    "result for no call": (
        {"messages": [*USER, ASSISTANT_CALL,
                      {"role": "tool", "tool_call_id": "call_other", "content": "1"}]},
        "messages.2.tool_call_id"),
    "result before its call": (
        {"messages": [*USER, {"role": "tool", "tool_call_id": "call_x", "content": "1"},
                      ASSISTANT_CALL]},
        "messages.1.tool_call_id"),
    "result without an id": (
        {"messages": [*USER, ASSISTANT_CALL, {"role": "tool", "content": "1"}]},
        "messages.2.tool_call_id"),
    "arguments not JSON": ({"messages": bad_arguments("{city: Paris}")},
                           "messages.1.tool_calls.0.function.arguments"),
    "arguments a JSON array": ({"messages": bad_arguments("[1]")},
                               "messages.1.tool_calls.0.function.arguments"),
    "arguments empty": ({"messages": bad_arguments("")},
                        "messages.1.tool_calls.0.function.arguments"),
}


@pytest.mark.parametrize(("body", "param"), BAD.values(), ids=BAD.keys())
def test_invalid_tool_requests_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    fake = FakeClient(ONE_CALL)
    client, _ = sdk(fake)
    request: dict[str, Any] = {"model": "orchard-tiny", "messages": USER} | body
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**request)
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert fake.requests == []  # rejected before any replica time
