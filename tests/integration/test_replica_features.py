"""Channels and guided decoding on the real tiny model, in-process (no Ray)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from replicas.builtin import script
from replicas.contract import (
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GuidedSpec,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
)
from replicas.replica import ModelReplica
from tests.integration.test_replica import request_for, run, terminal, texts
from tests.streams import collect

PROFILE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"type": "string", "enum": ["teacher", "engineer", "doctor"]},
    },
    "required": ["name", "age", "job"],
    "additionalProperties": False,
}


def guided(replica: ModelReplica, sid: str, spec: GuidedSpec, **kw: Any) -> tuple[str, str, Finished]:
    events = run(collect(replica.stream(request_for(sid, guided=spec, **kw))))
    end = terminal(events)
    assert isinstance(end, Finished), end
    reasoning, answer = texts(events)
    return reasoning, answer, end


def test_json_schema_turns_a_prose_answer_into_valid_json(replica: ModelReplica) -> None:
    assert not script("profile-prose").answer.lstrip().startswith("{")  # unconstrained: prose
    spec = GuidedSpec("json_schema", json.dumps(PROFILE_SCHEMA))
    _, answer, end = guided(replica, "profile-prose", spec)
    jsonschema.validate(json.loads(answer), PROFILE_SCHEMA)
    assert end.reason is FinishReason.GRAMMAR_COMPLETE


def test_stop_strings_never_cut_a_constrained_answer(replica: ModelReplica) -> None:
    spec = GuidedSpec("json_schema", json.dumps(PROFILE_SCHEMA))
    _, answer, end = guided(replica, "profile-prose", spec, stop=StopSpec(strings=('"', ",", ":")))
    jsonschema.validate(json.loads(answer), PROFILE_SCHEMA)
    assert end.reason is FinishReason.GRAMMAR_COMPLETE


def test_json_object_is_an_object(replica: ModelReplica) -> None:
    # The script whose answer is a JSON object: the grammar lets the model say it as is.
    _, answer, _ = guided(replica, "json-record", GuidedSpec("json_object"),
                          sampling=SamplingParams(temperature=0, max_tokens=200))
    assert json.loads(answer) == json.loads(script("json-record").answer)


def test_choice_and_regex(replica: ModelReplica) -> None:
    _, choice, _ = guided(replica, "hello", GuidedSpec("choice", ("red", "green", "blue")))
    assert choice in {"red", "green", "blue"}
    _, number, _ = guided(replica, "cities", GuidedSpec("regex", r"[0-9]{3}-[0-9]{4}"))
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", number)


def test_grammar_starts_after_reasoning(replica: ModelReplica) -> None:
    reasoning, choice, _ = guided(replica, "riddle-think", GuidedSpec("choice", ("yes", "no")))
    assert reasoning == script("riddle-think").reasoning  # reasoning untouched by the grammar
    assert choice in {"yes", "no"}


def test_invalid_schema_is_rejected_before_generation(replica: ModelReplica) -> None:
    steps = replica.stats().steps
    bad = GuidedSpec("json_schema", '{"type": "objekt"}')
    events = run(collect(replica.stream(request_for("hello", guided=bad))))
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].kind is ErrorKind.INVALID_REQUEST
    assert replica.stats().steps == steps


def test_mixed_batch_matches_solo_runs(replica: ModelReplica) -> None:
    import asyncio

    spec = GuidedSpec("json_schema", json.dumps(PROFILE_SCHEMA))
    solo_c = texts(run(collect(replica.stream(request_for("profile-prose", guided=spec)))))

    async def together() -> list[Any]:
        return await asyncio.gather(
            collect(replica.stream(request_for("profile-prose", guided=spec))),
            collect(replica.stream(request_for("cities"))),
            collect(replica.stream(request_for("feathers-think"))),
        )

    mixed = run(together())
    assert texts(mixed[0]) == solo_c
    assert texts(mixed[1])[1] == script("cities").answer
    assert texts(mixed[2]) == (script("feathers-think").reasoning, script("feathers-think").answer)


def test_thinking_budget_forces_an_answer(replica: ModelReplica) -> None:
    budget = 12
    events = run(collect(replica.stream(request_for(
        "feathers-think", reasoning=ReasoningSpec(budget_tokens=budget),
        sampling=SamplingParams(temperature=0, max_tokens=120)))))
    end = terminal(events)
    assert isinstance(end, Finished)
    reasoning, answer = texts(events)
    assert answer.strip(), "the forced end of reasoning must leave room for an answer"
    assert script("feathers-think").reasoning.startswith(reasoning)  # cut, not rewritten
    forced_marker_tokens = 3  # "\n", "</think>", "\n\n" in this tokenizer at most
    assert end.usage.reasoning_tokens <= budget + forced_marker_tokens + 1
    assert "</think>" not in answer and "<think>" not in reasoning


def test_thinking_disabled_yields_no_reasoning(replica: ModelReplica) -> None:
    events = run(collect(replica.stream(request_for(
        "riddle-think", reasoning=ReasoningSpec(enabled=False)))))
    reasoning, answer = texts(events)
    assert reasoning == ""
    assert answer == script("riddle-nothink").answer
