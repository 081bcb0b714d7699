"""The Responses API over `serve run` with the official `openai` SDK and the real tiny model:
text (with reasoning), function calls, a round trip (the call's output sent back as items)
and `previous_response_id` (the stored response continued), each streamed and not.

Responses renders through the same chat template as chat completions, so the scripts of
`replicas/builtin/scripts.json` give exact answers here too: `tool-one` is the call,
`tool-result` the text answer once the call and its output are in the history.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from replicas.builtin import script
from tests.e2e.test_tools_http import UNIT_TOOL

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def function_tool(chat_tool: dict[str, Any]) -> dict[str, Any]:
    """A chat `tools` entry as a Responses function tool (flat, not strict)."""
    f = chat_tool["function"]
    return {"type": "function", "name": f["name"], "description": f["description"],
            "parameters": f["parameters"], "strict": False}


def response_args(sid: str, **extra: Any) -> dict[str, Any]:
    """Greedy, the script's first user turn as input, its tools and thinking switch."""
    s = script(sid)
    args: dict[str, Any] = {"model": MODEL, "input": s.message_dicts[:1], "temperature": 0,
                            "max_output_tokens": 300}
    if s.tools:
        args["tools"] = [function_tool(t) for t in s.tool_dicts]
    if s.enable_thinking is False:  # "none" turns thinking off, as enable_thinking false
        args["reasoning"] = {"effort": "none"}
    elif s.enable_thinking:
        args["reasoning"] = {"effort": "low"}
    args.update(extra)
    return args


def streamed(client: openai.OpenAI, **args: Any) -> tuple[Any, list[Any]]:
    """(the SDK's final response, every event) of a streamed create."""
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    return final, events


def check_events(events: list[Any], final: Any) -> None:
    """Sequence numbers from 0 without a gap, created first, the terminal event last and
    carrying the same response; the deltas add up to the final items' texts."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed" and events[-1].response.id == final.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    arguments: dict[str, list[str]] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            arguments.setdefault(e.item_id, []).append(e.delta)
    assert {k: "".join(v) for k, v in arguments.items()} == {
        i.id: i.arguments for i in final.output if i.type == "function_call"}


def check_streamed(client: openai.OpenAI, args: dict[str, Any]) -> Any:
    """A streamed create whose events check out (`check_events`); its final response."""
    final, events = streamed(client, **args)
    check_events(events, final)
    return final


def calls(response: Any) -> list[tuple[str, str]]:
    return [(i.name, i.arguments) for i in response.output if i.type == "function_call"]


def reasoning_text(response: Any) -> str:
    return "".join(part.text for i in response.output if i.type == "reasoning"
                   for part in i.content or ())


@pytest.mark.parametrize("sid", ["hello", "riddle-think"])
def test_text_and_reasoning_are_the_scripted_ones_streamed_or_not(client: openai.OpenAI,
                                                                  sid: str) -> None:
    s = script(sid)
    whole = client.responses.create(**response_args(sid))
    assert whole.status == "completed" and whole.output_text == s.answer
    assert reasoning_text(whole) == (s.reasoning or "") and not calls(whole)
    final, events = streamed(client, **response_args(sid))
    check_events(events, final)
    assert final.status == "completed" and final.output_text == s.answer
    assert reasoning_text(final) == (s.reasoning or "")


@pytest.mark.parametrize("sid", ["tool-one", "tool-parallel", "tool-text-then-call",
                                 "tool-after-reasoning"])
def test_function_calls_are_the_scripted_ones_streamed_or_not(client: openai.OpenAI,
                                                              sid: str) -> None:
    s = script(sid)
    for response in (client.responses.create(**response_args(sid)),
                     check_streamed(client, response_args(sid))):
        assert response.status == "completed", response
        assert calls(response) == list(s.expected_calls)
        assert response.output_text.rstrip("\n") == s.answer_text
        assert reasoning_text(response) == (s.reasoning or "")
        ids = [i.call_id for i in response.output if i.type == "function_call"]
        assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)


def round_trip_input(first: Any) -> list[dict[str, Any]]:
    """The first turn's one call, answered with tool-result's scripted output."""
    (call,) = [i for i in first.output if i.type == "function_call"]
    output = script("tool-result").message_dicts[2]["content"]
    return [{"type": "function_call_output", "call_id": call.call_id, "output": output}]


def round_trip_history(client: openai.OpenAI) -> list[dict[str, Any]]:
    """The whole conversation as items, sent back by the client (nothing stored): the
    question, the call the model made for it, and the call's output."""
    first = client.responses.create(**response_args("tool-one", store=False))
    assert calls(first) == list(script("tool-one").expected_calls), first
    (call,) = [i for i in first.output if i.type == "function_call"]
    return [*response_args("tool-one")["input"],
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            *round_trip_input(first)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_round_trip_with_the_call_sent_back_as_items(client: openai.OpenAI,
                                                       stream: bool) -> None:
    args = response_args("tool-result", input=round_trip_history(client), store=False)
    second = check_streamed(client, args) if stream else client.responses.create(**args)
    assert second.status == "completed" and not calls(second)
    assert second.output_text == script("tool-result").answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_previous_response_id_continues_from_the_stored_call(client: openai.OpenAI,
                                                             stream: bool) -> None:
    answer = script("tool-result").answer
    args = response_args("tool-one")
    first = check_streamed(client, args) if stream else client.responses.create(**args)
    assert first.store is True and calls(first) == list(script("tool-one").expected_calls)
    stored = client.responses.retrieve(first.id)
    assert [i.id for i in stored.output] == [i.id for i in first.output]
    # Only the call's output is sent: the question and the call come from the store.
    follow = response_args("tool-result", input=round_trip_input(first),
                           previous_response_id=first.id)
    second = check_streamed(client, follow) if stream else client.responses.create(**follow)
    assert second.previous_response_id == first.id
    assert second.status == "completed" and second.output_text == answer and not calls(second)


def test_unknown_previous_response_id_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**response_args("hello", previous_response_id="resp_nope"))


# Forced choices (the cases of test_tools_http.py, in the Responses shape): the control
# shows what the model does unforced, so a server that ignored tool_choice fails.
UNIT = function_tool(UNIT_TOOL)


def test_a_named_tool_choice_forces_a_tool_the_model_would_not_call(
        client: openai.OpenAI) -> None:
    args = response_args("tool-one")
    args["tools"] = [*args["tools"], UNIT]
    control = client.responses.create(**args)
    assert [name for name, _ in calls(control)] == ["get_weather"], control
    choice = {"type": "function", "name": "get_unit"}
    for response in (client.responses.create(**{**args, "tool_choice": choice}),
                     check_streamed(client, {**args, "tool_choice": choice})):
        assert response.status == "completed" and calls(response), response
        for name, arguments in calls(response):
            assert name == "get_unit"
            jsonschema.validate(json.loads(arguments), UNIT["parameters"])


def test_required_forces_a_call_where_the_model_would_answer_in_text(
        client: openai.OpenAI) -> None:
    args = response_args("tool-result", input=round_trip_history(client), store=False)
    control = client.responses.create(**args)
    assert not calls(control) and control.output_text, control
    schemas = {t["name"]: t["parameters"] for t in args["tools"]}
    for response in (client.responses.create(**{**args, "tool_choice": "required"}),
                     check_streamed(client, {**args, "tool_choice": "required"})):
        assert response.status == "completed" and calls(response), response
        for name, arguments in calls(response):
            jsonschema.validate(json.loads(arguments), schemas[name])


def test_output_text_logprobs_when_included(client: openai.OpenAI) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: each answer token's
    logprob and alternatives on the text part and on its deltas, the same as chat's."""
    args = response_args("hello", include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**args)
    part = whole.output[-1].content[0]
    assert whole.output_text == script("hello").answer
    assert "".join(e.token for e in part.logprobs) == part.text
    for entry in part.logprobs:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best one
        assert entry.bytes == list(entry.token.encode())
    chat = client.chat.completions.create(model=MODEL, messages=script("hello").message_dicts,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          max_tokens=300)
    assert [(e.token, round(e.logprob, 3)) for e in part.logprobs] == \
        [(e.token, round(e.logprob, 3)) for e in chat.choices[0].logprobs.content]
    final, events = streamed(client, **args)
    check_events(events, final)
    deltas = [lp.token for e in events if e.type == "response.output_text.delta"
              for lp in e.logprobs]
    assert deltas == [e.token for e in part.logprobs]
    assert final.top_logprobs == 2
    plain = client.responses.create(**response_args("hello"))
    assert plain.output[-1].content[0].logprobs == []
