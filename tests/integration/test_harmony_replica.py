"""The Harmony path through a real ModelReplica: a tiny model trained on completions that
openai-harmony's encoder wrote (`harmony_model.py`) comes back as the right channels, stops,
thinking budget and tool-call events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from replicas.contract import (
    Channel,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputEvent,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from replicas.families.registry import get_channel_format
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.harmony_model import (
    MARKERS,
    WEATHER_ARGS,
    chat_prompt,
    ensure_harmony_model,
    script,
)
from tests.streams import stream_events

WEATHER_TOOL = ToolSpec(
    "get_weather", "The weather in a city.",
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
)


@pytest.fixture(scope="module")
def replica() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(
        model_id="harmony", source=str(ensure_harmony_model()), channel_format="harmony",
        tool_format="harmony"))
    rep.start()
    yield rep
    rep.shutdown()


def request(sid: str, **overrides: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "request_id": f"harmony-{sid}-{time.monotonic_ns()}", "model": "harmony",
        "prompt": chat_prompt(script(sid)),
        "sampling": SamplingParams(temperature=0.0, max_tokens=80), **overrides}
    return GenerationRequest(**fields)


def text(events: list[OutputEvent], channel: Channel) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel is channel)


def finished(events: list[OutputEvent]) -> Finished:
    end = events[-1]
    assert isinstance(end, Finished) and not any(isinstance(e, Finished) for e in events[:-1])
    return end


def no_markup(events: list[OutputEvent]) -> None:
    for channel in (Channel.REASONING, Channel.ANSWER):
        assert not any(m in text(events, channel) for m in (*MARKERS, "to=functions")), channel


def test_formats_are_the_ones_asked_for(replica: ModelReplica) -> None:
    assert replica.tool_format.name == "harmony"


def test_analysis_is_reasoning_and_final_is_the_answer(replica: ModelReplica) -> None:
    events = stream_events(replica, request("greet"))
    assert text(events, Channel.REASONING) == "The user says hi. I greet the user."
    assert text(events, Channel.ANSWER) == "Hello, dear user! How can I help?"
    assert finished(events).reason is FinishReason.EOS
    no_markup(events)
    direct = stream_events(replica, request("direct"))
    assert text(direct, Channel.REASONING) == "" and text(direct, Channel.ANSWER) == "Yes."


def test_stops_fire_in_the_final_channel_only(replica: ModelReplica) -> None:
    # "user" is in the analysis too; only the answer's occurrence stops the turn.
    events = stream_events(replica, request("greet", stop=StopSpec(strings=("user",))))
    assert text(events, Channel.REASONING) == "The user says hi. I greet the user."
    assert text(events, Channel.ANSWER) == "Hello, dear "
    end = finished(events)
    assert end.reason is FinishReason.STOP_SEQUENCE and end.stop == "user"


def test_thinking_budget_cuts_the_analysis(replica: ModelReplica) -> None:
    full = "The user says hi. I greet the user."
    budget = 3
    events = stream_events(replica, request("greet", reasoning=ReasoningSpec(budget_tokens=budget)))
    reasoning = text(events, Channel.REASONING)
    assert reasoning and full.startswith(reasoning) and reasoning != full  # cut, not rewritten
    end = finished(events)
    # The forced `<|end|><|start|>assistant<|channel|>final<|message|>` counts as reasoning.
    forced = load_tokenizer(ensure_harmony_model()).encode(
        get_channel_format("harmony").reasoning_end, add_special_tokens=False)
    assert end.usage.reasoning_tokens <= budget + len(forced)
    assert end.reason in (FinishReason.EOS, FinishReason.LENGTH)
    no_markup(events)


def test_a_commentary_call_is_a_tool_call(replica: ModelReplica) -> None:
    events = stream_events(replica, request("weather", tools=(WEATHER_TOOL,)))
    assert text(events, Channel.REASONING) == "Need the weather. I call get_weather."
    assert text(events, Channel.ANSWER) == ""
    no_markup(events)
    calls = [e for e in events if not isinstance(e, (TextDelta, Finished))]
    start, *deltas, end_call = calls
    assert isinstance(start, ToolCallStart) and start.index == 0
    assert start.name == "get_weather" and start.id
    assert all(isinstance(d, ToolCallDelta) and d.index == 0 for d in deltas) and deltas
    assert isinstance(end_call, ToolCallEnd) and end_call.arguments == WEATHER_ARGS
    assert "".join(d.arguments for d in deltas if isinstance(d, ToolCallDelta)) == WEATHER_ARGS
    first_call = events.index(start)
    assert all(not isinstance(e, TextDelta) for e in events[first_call:])
    assert finished(events).reason is FinishReason.TOOL_CALLS


def test_without_tools_the_call_is_not_parsed(replica: ModelReplica) -> None:
    # No tools offered: the commentary message is hidden reasoning, never a call or answer.
    events = stream_events(replica, request("weather"))
    assert not any(isinstance(e, (ToolCallStart, ToolCallEnd)) for e in events)
    assert text(events, Channel.ANSWER) == ""
    assert finished(events).reason is FinishReason.EOS
