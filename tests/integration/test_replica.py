"""ModelReplica with the real tiny model, loaded by the production code, without Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from replicas.builtin import load_scripts, script
from replicas.contract import (
    Channel,
    ChatMessage,
    ChatPrompt,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    GuidedSpec,
    OutputEvent,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
    TextDelta,
    TextPrompt,
    ToolCallEnd,
    ToolCallStart,
)
from replicas.replica import ModelReplica, ReplicaOptions
from tests.scripted import GREEDY, script_request
from tests.streams import collect


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def request_for(sid: str, *, sampling: SamplingParams = GREEDY, stop: StopSpec = StopSpec(),
                reasoning: ReasoningSpec | None = None, rid: str | None = None,
                guided: GuidedSpec | None = None) -> GenerationRequest:
    overrides: dict[str, Any] = {"sampling": sampling, "stop": stop, "guided": guided}
    if reasoning is not None:
        overrides["reasoning"] = reasoning
    if rid is not None:
        overrides["request_id"] = rid
    return script_request(sid, **overrides)


def texts(events: list[OutputEvent]) -> tuple[str, str]:
    reasoning = "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel is Channel.REASONING)
    answer = "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel is Channel.ANSWER)
    return reasoning, answer


def terminal(events: list[OutputEvent]) -> OutputEvent:
    assert events, "no events"
    assert all(not isinstance(e, (Finished, Failed)) for e in events[:-1])
    return events[-1]


@pytest.mark.parametrize("sid", [s.id for s in load_scripts()])
def test_every_script_is_reproduced_exactly(replica: ModelReplica, sid: str) -> None:
    events = run(collect(replica.stream(request_for(sid))))
    end = terminal(events)
    reasoning, answer = texts(events)
    s = script(sid)
    if s.expected_calls:  # tool scripts: the text before the calls, then the calls
        assert isinstance(end, Finished) and end.reason is FinishReason.TOOL_CALLS
        assert answer.rstrip("\n") == s.answer_text
        names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
        made = [(names[e.index], e.arguments) for e in events if isinstance(e, ToolCallEnd)]
        assert made == list(s.expected_calls)
    else:
        # With tools offered the auto tool grammar runs, and the eos completes it.
        natural = (FinishReason.EOS, FinishReason.GRAMMAR_COMPLETE) if s.tools else (
            FinishReason.EOS,)
        assert isinstance(end, Finished) and end.reason in natural
        assert answer == s.answer
    assert reasoning == (s.reasoning or "")
    assert end.usage.completion_tokens > 0 and end.usage.prompt_tokens > 0
    if s.reasoning:
        assert 0 < end.usage.reasoning_tokens < end.usage.completion_tokens


def test_concurrent_requests_batch_and_match_solo_runs(replica: ModelReplica) -> None:
    ids = [s.id for s in load_scripts()][:10]

    async def together() -> list[list[OutputEvent]]:
        return await asyncio.gather(*(collect(replica.stream(request_for(i))) for i in ids))

    steps_before = replica.stats().steps
    results = run(together())
    steps = replica.stats().steps - steps_before
    tokens = 0
    for sid, events in zip(ids, results):
        assert texts(events)[1] == script(sid).answer
        end = terminal(events)
        assert isinstance(end, Finished)
        tokens += end.usage.completion_tokens
    # Batched: far fewer decode steps than tokens generated.
    assert steps < tokens * 0.5, (steps, tokens)


def test_cancel_frees_the_batch_slot_within_a_step(replica: ModelReplica) -> None:
    eos = sorted(replica.model.eos_token_ids)
    endless = SamplingParams(temperature=0.0, max_tokens=2000, logit_bias={t: -1e4 for t in eos})

    async def scenario() -> int:
        stream = replica.stream(request_for("hello", sampling=endless))
        first = await stream.__anext__()
        assert first and isinstance(first[0], TextDelta)
        before = len(replica.stats().cancel_latency_steps)
        await stream.aclose()  # what a client disconnect does to the generator
        deadline = time.monotonic() + 60  # generous: the check is in decode steps, below
        while time.monotonic() < deadline:
            stats = replica.stats()
            if len(stats.cancel_latency_steps) > before and stats.active == 0:
                return stats.cancel_latency_steps[-1]
            await asyncio.sleep(0.001)
        raise AssertionError("the engine never removed the cancelled request")

    assert run(scenario()) <= 1


@pytest.mark.parametrize("stop", ["3.", "\n", "Delhi", "2. Delhi\n3"])
def test_stop_string_truncates_and_reports_the_string(replica: ModelReplica, stop: str) -> None:
    full = script("cities").answer
    events = run(collect(replica.stream(request_for("cities", stop=StopSpec(strings=(stop,))))))
    end = terminal(events)
    assert isinstance(end, Finished)
    assert end.reason is FinishReason.STOP_SEQUENCE and end.stop == stop
    assert texts(events)[1] == full[: full.index(stop)]


def test_stop_inside_reasoning_does_not_fire(replica: ModelReplica) -> None:
    s = script("feathers-think")
    only_in_reasoning = next(w for w in (s.reasoning or "").split() if w not in s.answer)
    events = run(collect(replica.stream(
        request_for("feathers-think", stop=StopSpec(strings=(only_in_reasoning,))))))
    end = terminal(events)
    assert isinstance(end, Finished) and end.reason is FinishReason.EOS
    assert texts(events) == (s.reasoning, s.answer)


def test_stop_token_id_reports_the_id(replica: ModelReplica) -> None:
    tok = replica.model.hf_tokenizer
    ids = tok.encode(script("cities").answer, add_special_tokens=False)
    target = ids[5]
    events = run(collect(replica.stream(request_for("cities", stop=StopSpec(token_ids=(target,))))))
    end = terminal(events)
    assert isinstance(end, Finished) and end.reason is FinishReason.STOP_TOKEN and end.stop == target
    assert texts(events)[1] == tok.decode(ids[:5])


def test_max_tokens_reports_length_and_flushes(replica: ModelReplica) -> None:
    events = run(collect(replica.stream(request_for("cities", sampling=SamplingParams(temperature=0, max_tokens=5)))))
    end = terminal(events)
    assert isinstance(end, Finished) and end.reason is FinishReason.LENGTH
    assert end.usage.completion_tokens == 5
    assert script("cities").answer.startswith(texts(events)[1]) and texts(events)[1]


@pytest.mark.parametrize(
    ("sampling", "stop", "kind"),
    [
        (SamplingParams(top_p=0.0), StopSpec(), ErrorKind.INVALID_REQUEST),
        (SamplingParams(logit_bias={10**9: 1.0}), StopSpec(), ErrorKind.INVALID_REQUEST),
        (GREEDY, StopSpec(strings=tuple(f"s{i}" for i in range(17))), ErrorKind.INVALID_REQUEST),
        (GREEDY, StopSpec(strings=("",)), ErrorKind.INVALID_REQUEST),
    ],
)
def test_bad_input_is_a_failed_event_and_the_replica_keeps_serving(
    replica: ModelReplica, sampling: SamplingParams, stop: StopSpec, kind: ErrorKind
) -> None:
    events = run(collect(replica.stream(request_for("hello", sampling=sampling, stop=stop))))
    assert len(events) == 1 and isinstance(events[0], Failed) and events[0].kind is kind
    ok = run(collect(replica.stream(request_for("hello"))))
    assert texts(ok)[1] == script("hello").answer


@pytest.mark.parametrize("prompt", [TextPrompt("a\udfffb"),
                                    ChatPrompt((ChatMessage("user", "hi \ud800"),))])
def test_a_lone_surrogate_is_a_400_not_a_crash(replica: ModelReplica, prompt: Any) -> None:
    # JSON can carry "\ud800"; Python accepts it, the Rust tokenizer raises on it.
    request = dataclasses.replace(request_for("hello"), prompt=prompt)
    events = run(collect(replica.stream(request)))
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].kind is ErrorKind.INVALID_REQUEST and "surrogate" in events[0].message
    assert texts(run(collect(replica.stream(request_for("hello")))))[1] == script("hello").answer


def test_seeded_sampling_is_reproducible(replica: ModelReplica) -> None:
    sampling = SamplingParams(temperature=1.5, seed=1234, max_tokens=30)
    a = run(collect(replica.stream(request_for("hello", sampling=sampling))))
    b = run(collect(replica.stream(request_for("hello", sampling=sampling))))
    assert texts(a) == texts(b)


def test_config_default_stops_merge_with_request_stops() -> None:
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny",
                                      default_stops=("Shanghai", "Delhi"), max_stops=3))
    rep.start()
    try:
        full = script("cities").answer
        # Union of defaults and request stops: "Tokyo" (request) completes before "Delhi".
        events = run(collect(rep.stream(request_for("cities", stop=StopSpec(strings=("Delhi", "Tokyo"))))))
        end = terminal(events)
        assert isinstance(end, Finished) and end.stop == "Tokyo"
        assert texts(events)[1] == full[: full.index("Tokyo")]
        # The first request fit the limit of 3 only because the duplicate "Delhi" was
        # dropped; two new stops plus the two defaults do not.
        too_many = run(collect(rep.stream(request_for("cities", stop=StopSpec(strings=("a", "b"))))))
        assert isinstance(too_many[0], Failed) and "at most 3" in too_many[0].message
    finally:
        rep.shutdown()
