"""Speculation through a whole replica (prompt, pipeline, engine) on the built-in scripted
model: every script, and guided rows whose grammar drafts what it forces (grammar
fast-forward), come out exactly as without speculation, alone and batched."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Iterator

import pytest

from replicas.contract import GuidedSpec, OutputEvent
from replicas.engine.config import EngineConfig, SpeculativeConfig
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.test_prompt_cache import output
from tests.scripted import script_request
from tests.streams import collect, stream_events

SCRIPTS = ["hello", "cities", "planets", "tea-steps", "markup", "unicode", "json-record",
           "multi-turn", "riddle-think", "sum-think", "feathers-think", "tool-one",
           "tool-parallel", "tool-result", "tool-after-reasoning", "tool-text-then-call",
           "count-completion"]
RECORD = {"type": "object", "additionalProperties": False,
          "required": ["name", "born", "country", "skills", "active"],
          "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                         "country": {"type": "string"},
                         "skills": {"type": "array", "items": {"type": "string"}},
                         "active": {"type": "boolean"}}}
# Keys no script writes: the grammar forces every one of them on a prose prompt.
FORM = {"type": "object", "additionalProperties": False,
        "required": ["full_name_of_the_person", "year_of_birth_of_the_person"],
        "properties": {"full_name_of_the_person": {"type": "string", "maxLength": 24},
                       "year_of_birth_of_the_person": {"type": "integer"}}}


def make(spec: SpeculativeConfig | None) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny",
                                      engine=EngineConfig(speculative=spec)))
    rep.start()
    return rep


@pytest.fixture(scope="module")
def plain() -> Iterator[ModelReplica]:
    rep = make(None)
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def fast() -> Iterator[ModelReplica]:
    rep = make(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                 disable_when_slower=False))
    yield rep
    rep.shutdown()


def requests() -> list[Any]:
    return [*(script_request(sid) for sid in SCRIPTS),
            script_request("json-record", guided=GuidedSpec("json_schema", json.dumps(RECORD))),
            script_request("profile-prose", guided=GuidedSpec("json_schema", json.dumps(FORM))),
            script_request("ocean-prose", guided=GuidedSpec("json_object", None))]


def together(rep: ModelReplica, batch: list[Any]) -> list[list[OutputEvent]]:
    async def run() -> list[list[OutputEvent]]:
        return list(await asyncio.gather(*(collect(rep.stream(r)) for r in batch)))
    return [output(events) for events in asyncio.run(run())]


def test_every_request_alone_is_the_output_without_speculation(
        plain: ModelReplica, fast: ModelReplica) -> None:
    before = fast.stats().decode
    for request in requests():
        assert output(stream_events(fast, request)) == output(stream_events(plain, request)), \
            request.request_id
    after = fast.stats().decode
    assert before is not None and after is not None and after.speculative
    assert after.accepted > before.accepted and after.forced > before.forced
    assert after.passes - before.passes < after.tokens - before.tokens


def test_grammar_forced_drafts_are_kept(fast: ModelReplica) -> None:
    """The form's long keys are forced by its grammar: drafted as such, and kept."""
    before = fast.stats().decode
    request = script_request("profile-prose",
                             guided=GuidedSpec("json_schema", json.dumps(FORM)))
    events = stream_events(fast, request)
    assert json.loads("".join(getattr(e, "text", "") for e in events)).keys() == FORM["properties"].keys()
    after = fast.stats().decode
    assert before is not None and after is not None
    assert after.forced - before.forced >= 8  # both keys' tokens, a pass's worth at a time
    assert after.accepted - before.accepted >= 8


def test_eight_at_once_are_each_the_output_alone(plain: ModelReplica,
                                                 fast: ModelReplica) -> None:
    batch = requests()[-8:]
    alone = [output(stream_events(plain, r)) for r in batch]
    assert together(fast, batch) == alone


def _logprobs(events: list[OutputEvent]) -> list[Any]:
    return [lp for e in events for lp in getattr(e, "logprobs", ())]


@pytest.mark.parametrize("sid", ["tea-steps", "tool-parallel", "sum-think"])
def test_logprobs_ride_with_kept_drafts(plain: ModelReplica, fast: ModelReplica,
                                        sid: str) -> None:
    """Each token's logprob and top alternatives, kept drafts included: the same tokens,
    and numbers within 1e-3 (a verifying pass computes the drafts' positions together)."""
    request = script_request(sid, sampling=dataclasses.replace(
        script_request(sid).sampling, logprobs=3))
    want, got = _logprobs(stream_events(plain, request)), _logprobs(stream_events(fast, request))
    assert [lp.token_id for lp in got] == [lp.token_id for lp in want] and want
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-3)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-3)
