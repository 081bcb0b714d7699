"""Tool calls through the real tiny model in a ModelReplica: the scripted calls come back as
exactly the scripted events, the grammar modes hold, and bad tool input is refused before
the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import jsonschema
import pytest

from replicas.builtin import load_scripts, script
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GuidedSpec,
    OutputEvent,
    SamplingParams,
    StopSpec,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolChoice,
    ToolSpec,
)
from replicas.replica import ModelReplica
from tests.scripted import script_request
from tests.streams import collect, stream_events

TOOL_SCRIPTS = [s.id for s in load_scripts() if s.tools and s.expected_calls]


def calls(events: list[OutputEvent]) -> list[tuple[str, str]]:
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    return [(names[e.index], e.arguments) for e in events if isinstance(e, ToolCallEnd)]


def text(events: list[OutputEvent], channel: Channel) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel is channel)


def test_the_model_uses_the_tool_format_of_its_template(replica: ModelReplica) -> None:
    assert replica.tool_format.name == "hermes"


@pytest.mark.parametrize("sid", TOOL_SCRIPTS)
def test_scripted_calls_are_exact_events_in_contract_order(replica: ModelReplica, sid: str) -> None:
    s = script(sid)
    events = stream_events(replica, script_request(sid))
    end = events[-1]
    assert isinstance(end, Finished) and end.reason is FinishReason.TOOL_CALLS
    assert calls(events) == list(s.expected_calls)
    assert text(events, Channel.ANSWER).rstrip("\n") == s.answer_text
    assert text(events, Channel.REASONING) == (s.reasoning or "")
    assert "<tool_call>" not in text(events, Channel.ANSWER)
    # Contract order: text first, then Start(i) Delta(i)* End(i) per call, then Finished.
    kinds = [type(e).__name__ for e in events if not isinstance(e, TextDelta)]
    per_call = []
    for index, _ in enumerate(s.expected_calls):
        call_events = [e for e in events if getattr(e, "index", None) == index]
        assert isinstance(call_events[0], ToolCallStart) and isinstance(call_events[-1], ToolCallEnd)
        assert all(isinstance(e, ToolCallDelta) for e in call_events[1:-1])
        assert "".join(e.arguments for e in call_events[1:-1]) == call_events[-1].arguments
        per_call.append(call_events[0].id)
    assert len(set(per_call)) == len(per_call)
    first_call = next(i for i, e in enumerate(events) if isinstance(e, ToolCallStart))
    assert not any(isinstance(e, TextDelta) for e in events[first_call:])
    assert kinds[-1] == "Finished"


def test_tool_result_in_history_gives_the_scripted_answer(replica: ModelReplica) -> None:
    events = stream_events(replica, script_request("tool-result"))
    end = events[-1]
    # The auto tool grammar is complete once the text ends: the eos completes it.
    assert isinstance(end, Finished)
    assert end.reason in (FinishReason.EOS, FinishReason.GRAMMAR_COMPLETE)
    assert text(events, Channel.ANSWER) == script("tool-result").answer and not calls(events)


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("required", "get_weather"),
                                    ToolChoice("auto", "get_weather")])
def test_required_and_named_choice_give_the_scripted_call(replica: ModelReplica,
                                                          choice: ToolChoice) -> None:
    events = stream_events(replica, script_request("tool-one", tool_choice=choice))
    assert calls(events) == list(script("tool-one").expected_calls)
    assert isinstance(events[-1], Finished) and events[-1].reason is FinishReason.TOOL_CALLS


def test_named_choice_overrides_the_models_own_pick(replica: ModelReplica) -> None:
    # The model would call get_weather; the grammar admits only get_time.
    events = stream_events(replica, script_request(
        "tool-one", tool_choice=ToolChoice("required", "get_time"),
        sampling=SamplingParams(temperature=0.0, max_tokens=60)))
    made = calls(events)
    assert made and {name for name, _ in made} == {"get_time"}
    # 60 tokens hold the whole call: it completes, and its arguments are get_time's.
    assert isinstance(events[-1], Finished) and events[-1].reason is FinishReason.TOOL_CALLS
    (get_time,) = [t for t in script("tool-one").tools if t.name == "get_time"]
    schema = json.loads(get_time.parameters)
    for _, arguments in made:
        jsonschema.validate(json.loads(arguments), schema)


def test_parallel_off_cuts_after_one_call(replica: ModelReplica) -> None:
    events = stream_events(replica, script_request(
        "tool-parallel", tool_choice=ToolChoice("auto", parallel=False)))
    assert calls(events) == list(script("tool-parallel").expected_calls[:1])
    assert isinstance(events[-1], Finished) and events[-1].reason is FinishReason.TOOL_CALLS


def test_choice_none_never_calls(replica: ModelReplica) -> None:
    events = stream_events(replica, script_request(
        "tool-one", tool_choice=ToolChoice("none"),
        sampling=SamplingParams(temperature=0.0, max_tokens=40)))
    assert not calls(events)
    assert "<tool_call>" not in text(events, Channel.ANSWER)
    assert isinstance(events[-1], Finished)


@pytest.mark.parametrize("sid", TOOL_SCRIPTS)
def test_choice_none_lets_no_marker_of_the_format_through(replica: ModelReplica,
                                                          sid: str) -> None:
    # With `<tool_call>` banned the tiny model still writes the body and `</tool_call>`.
    events = stream_events(replica, script_request(sid, tool_choice=ToolChoice("none")))
    answer = text(events, Channel.ANSWER)
    assert not calls(events) and isinstance(events[-1], Finished)
    assert not [m for m in replica.tool_format.reserved if m in answer], answer


def test_a_stop_string_never_fires_inside_a_call(replica: ModelReplica) -> None:
    # "Paris" is inside the call's arguments only: the call must come through whole.
    events = stream_events(replica, script_request("tool-one", stop=StopSpec(strings=("Paris",))))
    assert calls(events) == list(script("tool-one").expected_calls)
    assert isinstance(events[-1], Finished) and events[-1].reason is FinishReason.TOOL_CALLS


def test_a_stop_string_still_ends_the_text_before_a_call(replica: ModelReplica) -> None:
    events = stream_events(replica, script_request("tool-text-then-call",
                                                   stop=StopSpec(strings=("check",))))
    end = events[-1]
    assert isinstance(end, Finished) and end.reason is FinishReason.STOP_SEQUENCE
    assert text(events, Channel.ANSWER) == "Let me " and not calls(events)


@pytest.mark.parametrize("tools, choice, param", [
    ((ToolSpec("get_weather"),), ToolChoice("required", "nope"), "tool_choice"),
    ((ToolSpec("get_weather", parameters='{"type": "object", "properties": 5}'),),
     ToolChoice(), "tools"),
    ((), ToolChoice("required"), "tool_choice"),
])
def test_bad_tool_input_is_a_400_before_the_engine(replica: ModelReplica, tools: Any,
                                                   choice: ToolChoice, param: str) -> None:
    submitted = replica.stats().submitted
    events = stream_events(replica, script_request("tool-one", tools=tools, tool_choice=choice))
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].kind is ErrorKind.INVALID_REQUEST and events[0].param == param
    assert replica.stats().submitted == submitted


def test_tools_with_response_format_give_a_call_or_an_answer_in_the_schema(
        replica: ModelReplica) -> None:
    # The grammar is a call or an answer under the schema: tool-one's question gets its
    # call, json-record's (offered the same tools) an answer the schema holds.
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "active": {"type": "boolean"}},
              "required": ["name", "active"], "additionalProperties": False}
    guided = GuidedSpec("json_schema", json.dumps(schema))
    called = stream_events(replica, script_request("tool-one", guided=guided))
    assert calls(called) == list(script("tool-one").expected_calls)
    assert isinstance(called[-1], Finished) and called[-1].reason is FinishReason.TOOL_CALLS
    answered = stream_events(replica, script_request(
        "json-record", guided=guided, tools=script("tool-one").tools))
    assert not calls(answered)
    assert isinstance(answered[-1], Finished)
    assert answered[-1].reason is FinishReason.GRAMMAR_COMPLETE
    jsonschema.validate(json.loads(text(answered, Channel.ANSWER)), schema)


def test_tool_calls_in_a_batch_match_solo_runs(replica: ModelReplica) -> None:
    async def together() -> list[list[OutputEvent]]:
        ids = TOOL_SCRIPTS + ["tool-result", "cities"]
        return await asyncio.gather(*(collect(replica.stream(script_request(i))) for i in ids))

    results = asyncio.run(together())
    for sid, events in zip(TOOL_SCRIPTS, results):
        assert calls(events) == list(script(sid).expected_calls), sid


def test_strict_tool_schema_that_openai_would_refuse_is_a_400(replica: ModelReplica) -> None:
    loose = ToolSpec("get_weather", parameters=json.dumps(
        {"type": "object", "properties": {"city": {"type": "string"}}}), strict=True)
    events = stream_events(replica, script_request("tool-one", tools=(loose,)))
    assert isinstance(events[0], Failed) and events[0].param == "tools"


def test_tools_on_a_completion_are_a_400(replica: ModelReplica) -> None:
    request = dataclasses.replace(script_request("count-completion"),
                                  tools=(ToolSpec("get_weather"),))
    events = stream_events(replica, request)
    assert isinstance(events[0], Failed) and events[0].param == "tools"


def test_a_keyword_the_grammar_cannot_enforce_is_a_warning_not_a_400(replica: ModelReplica) -> None:
    unique = ToolSpec("get_weather", parameters=json.dumps({"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "array", "uniqueItems": True}}}))
    events = stream_events(replica, script_request("tool-one", tools=(unique,)))
    end = events[-1]
    assert isinstance(end, Finished), end
    assert any("tool 'get_weather'" in w and "uniqueItems" in w for w in end.warnings)
