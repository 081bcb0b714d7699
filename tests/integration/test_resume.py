"""A resumed request (issue 32) on the real tiny model, in-process: a stream cut after any
batch and resumed with the token ids sent so far (`GenerationRequest.resume`) goes on
exactly as the uninterrupted one, through every stateful stage: stops, channels, the
thinking budget, tool calls and their grammar, JSON guided decoding, seeded sampling,
logprob counts and usage."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Iterator

import pytest

from replicas.contract import (
    Channel,
    Failed,
    Finished,
    GenerationRequest,
    GuidedSpec,
    OutputEvent,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
    TextDelta,
    TokenIds,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolChoice,
)
from replicas.replica import ModelReplica, ReplicaOptions
from tests.scripted import script_request


@pytest.fixture(scope="module")
def replica() -> Iterator[ModelReplica]:
    # Every step its own batch: a cut can fall after any token the stream sent.
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny",
                                      flush_interval_s=0.0, max_chunks_per_s=0.0))
    rep.start()
    yield rep
    rep.shutdown()


def batches(replica: ModelReplica, request: GenerationRequest) -> list[list[OutputEvent]]:
    async def run() -> list[list[OutputEvent]]:
        return [batch async for batch in replica.stream(request)]
    return asyncio.run(run())


def ids_of(batch: list[OutputEvent]) -> tuple[int, ...]:
    return tuple(i for e in batch if isinstance(e, TokenIds) for i in e.ids)


def seen(events: list[OutputEvent]) -> tuple[str, str, list[tuple[int, str, str]], Finished]:
    """What a client makes of a stream: reasoning, answer, the calls, the end."""
    text = {c: "".join(e.text for e in events if isinstance(e, TextDelta) and e.channel is c)
            for c in (Channel.REASONING, Channel.ANSWER)}
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    args = {e.index: "" for e in events if isinstance(e, ToolCallStart)}
    for e in events:
        if isinstance(e, ToolCallDelta):
            args[e.index] += e.arguments
    ends = {e.index: e.arguments for e in events if isinstance(e, ToolCallEnd)}
    assert ends == args, (ends, args)  # the deltas add up, across the cut too
    end = events[-1]
    assert isinstance(end, Finished), end
    return text[Channel.REASONING], text[Channel.ANSWER], \
        [(i, names[i], args[i]) for i in sorted(names)], end


CASES = {
    # reasoning, then an answer a stop string cuts (the stop is pending across cuts)
    "stop after reasoning": script_request(
        "feathers-think", stop=StopSpec(strings=("feathers",))),
    # a thinking budget forces the end of reasoning mid-way
    "budget": script_request("feathers-think", reasoning=ReasoningSpec(budget_tokens=20)),
    # a forced call: the grammar holds the call's markup and arguments
    "forced call": script_request("tool-one", tool_choice=ToolChoice("required"),
                                  reasoning=ReasoningSpec(enabled=False)),
    # the model's own calls, parsed as they stream
    "auto calls": script_request("tool-one"),
    # JSON guided decoding over the answer
    "json": script_request("json-record", guided=GuidedSpec("json_object")),
    # seeded sampling continues its random stream
    "seeded": script_request("ocean-prose", sampling=SamplingParams(
        temperature=4.0, seed=7, max_tokens=120)),  # hot: every key draws differently
    # logprobs: every token's entry reaches the client once; a stop that never matches
    # holds back each line's end (and its entry) until the next token, across a cut too
    "logprobs": script_request("cities", stop=StopSpec(strings=("\n9",)),
                               sampling=SamplingParams(temperature=0.0, max_tokens=200,
                                                       logprobs=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_resumed_after_any_batch_goes_on_exactly(replica: ModelReplica,
                                                          case: str) -> None:
    request = dataclasses.replace(CASES[case], report_tokens=True)
    whole = batches(replica, request)
    all_ids = [i for b in whole for i in ids_of(b)]
    flat = [e for b in whole for e in b if not isinstance(e, TokenIds)]
    reference = seen(flat)
    assert len(whole) > 4, "the stream must have several batches to cut between"
    cuts = sorted({1, len(whole) // 3, len(whole) // 2, 2 * len(whole) // 3, len(whole) - 2})
    if case == "logprobs":  # after every batch: some cuts fall where an entry is held
        cuts = list(range(1, len(whole) - 1))
    for cut in cuts:
        sent = [e for b in whole[:cut] for e in b if not isinstance(e, TokenIds)]
        ids = tuple(i for b in whole[:cut] for i in ids_of(b))
        assert not any(isinstance(e, (Finished, Failed)) for e in sent)
        # The entries the replica still held at the cut (their text not sent yet) go
        # with the ids, as the model client sends them.
        held = next((e.held for b in reversed(whole[:cut]) for e in b
                     if isinstance(e, TokenIds)), ())
        resumed = dataclasses.replace(request, request_id=f"{request.request_id}-r{cut}",
                                      resume=ids, resume_logprobs=held)
        rest = batches(replica, resumed)
        after = [e for b in rest for e in b if not isinstance(e, TokenIds)]
        assert ids + tuple(i for b in rest for i in ids_of(b)) == tuple(all_ids), cut
        got = seen(sent + after)
        assert got[:3] == reference[:3], (case, cut)
        end, ref_end = got[3], reference[3]
        assert (end.reason, end.stop) == (ref_end.reason, ref_end.stop), (case, cut)
        assert end.usage.completion_tokens == ref_end.usage.completion_tokens
        assert end.usage.reasoning_tokens == ref_end.usage.reasoning_tokens
        assert end.usage.prompt_tokens == ref_end.usage.prompt_tokens
        if case == "logprobs":  # one entry per generated text token, in order, none twice
            entries = [lp for e in sent + after if isinstance(e, TextDelta) for lp in e.logprobs]
            ref = [lp for e in flat if isinstance(e, TextDelta) for lp in e.logprobs]
            assert [(lp.token_id, lp.token) for lp in entries] == \
                [(lp.token_id, lp.token) for lp in ref], (cut, held)
            for got_lp, ref_lp in zip(entries, ref):  # after the cut a prefill built the KV
                assert got_lp.logprob == pytest.approx(ref_lp.logprob, abs=1e-3)
                assert [t for t, _ in got_lp.top] == [t for t, _ in ref_lp.top]
        if case == "json":
            json.loads(got[1])


def test_a_resumed_echo_is_not_sent_again(replica: ModelReplica) -> None:
    request = dataclasses.replace(script_request("count-completion", echo=True),
                                  report_tokens=True)
    whole = batches(replica, request)
    echo = whole[0]
    assert isinstance(echo[-1], TextDelta) and not ids_of(echo)
    rest = batches(replica, dataclasses.replace(request, resume=()))
    texts = "".join(e.text for b in rest for e in b if isinstance(e, TextDelta))
    full = "".join(e.text for b in whole[1:] for e in b if isinstance(e, TextDelta))
    assert texts == full


def test_a_resume_past_the_limit_is_refused(replica: ModelReplica) -> None:
    request = script_request("hello", sampling=SamplingParams(temperature=0.0, max_tokens=3),
                             resume=(1, 2, 3))
    [[failed]] = batches(replica, request)
    assert isinstance(failed, Failed) and failed.param == "resume"
