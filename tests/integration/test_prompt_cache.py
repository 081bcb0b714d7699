"""The replica's KV prefix cache with the real tiny model, in-process: output never changes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable, Iterator

import pytest

from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    Failed,
    Finished,
    GenerationRequest,
    OutputEvent,
    ToolCallStart,
)
from replicas.engine.config import EngineConfig
from replicas.pipeline.prompt import last_message_boundary, render_prompt
from replicas.replica import ModelReplica, ReplicaOptions
from tests.scripted import script_request
from tests.streams import collect, stream_events

# tool-result's prompt starts with tool-one's prompt and answer; multi-turn is unrelated.
CONVERSATION = ["tool-one", "tool-result", "multi-turn"]
BATCH = ["tool-one", "tool-result", "multi-turn", "cities", "pirate-system", "riddle-think",
         "tool-parallel", "hello"]


def make_replica(**engine: Any) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny",
                                      engine=EngineConfig(**engine)))
    rep.start()
    return rep


@pytest.fixture(scope="module")
def uncached() -> Iterator[ModelReplica]:
    rep = make_replica(prompt_cache_bytes=0)
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def reference(uncached: ModelReplica) -> dict[str, list[OutputEvent]]:
    """Each script's output from a replica without the cache, one request at a time."""
    return {sid: generate(uncached, sid) for sid in dict.fromkeys(CONVERSATION + BATCH)}


def generate(rep: ModelReplica, sid: str) -> list[OutputEvent]:
    return stream_events(rep, script_request(sid))


def generate_together(rep: ModelReplica, sids: list[str]) -> list[list[OutputEvent]]:
    async def together() -> list[list[OutputEvent]]:
        return list(await asyncio.gather(*(collect(rep.stream(script_request(sid)))
                                           for sid in sids)))
    return asyncio.run(together())


def output(events: list[OutputEvent]) -> list[OutputEvent]:
    """What the client sees, less call ids (random) and cached_tokens (the point here)."""
    assert events and isinstance(events[-1], Finished), events[-1:]
    out: list[OutputEvent] = []
    for e in events:
        if isinstance(e, ToolCallStart):
            e = dataclasses.replace(e, id="")
        elif isinstance(e, Finished):
            e = dataclasses.replace(e, usage=dataclasses.replace(e.usage, cached_tokens=0))
        out.append(e)
    return out


def prompt_ids(rep: ModelReplica, sid: str) -> list[int]:
    request = script_request(sid)
    model = rep.model
    return list(render_prompt(model.hf_tokenizer, request.prompt, request.reasoning,
                              model.vocab_size, tools=request.tools).token_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cached_tokens(events: list[OutputEvent]) -> int:
    end = events[-1]
    assert isinstance(end, Finished)
    return end.usage.cached_tokens


def test_the_uncached_replica_reports_no_cached_tokens(
        uncached: ModelReplica, reference: dict[str, list[OutputEvent]]) -> None:
    for sid in CONVERSATION:
        assert cached_tokens(generate(uncached, sid)) == 0
    stats = uncached.stats()
    assert (stats.cache_hits, stats.cache_bytes, stats.cache_entries) == (0, 0, 0)


def test_greedy_output_is_identical_with_the_cache_on_and_off(
        reference: dict[str, list[OutputEvent]]) -> None:
    rep = make_replica()
    try:
        first = {sid: generate(rep, sid) for sid in CONVERSATION}
        second = {sid: generate(rep, sid) for sid in CONVERSATION}
        stats = rep.stats()
    finally:
        rep.shutdown()
    for sid in CONVERSATION:
        assert output(first[sid]) == output(reference[sid]), sid
        assert output(second[sid]) == output(reference[sid]), sid
    assert cached_tokens(first["tool-one"]) == 0  # nothing cached yet
    # The next turn reuses the turn before it as far as the two prompts agree (the template
    # renders the earlier assistant turn without its empty think block).
    shared = common_prefix(prompt_ids(rep, "tool-one"), prompt_ids(rep, "tool-result"))
    assert shared > 200 and cached_tokens(first["tool-result"]) >= shared
    for sid in CONVERSATION:  # the same prompt again: all of it but the last token
        prompt = second[sid][-1].usage.prompt_tokens  # type: ignore[union-attr]
        assert cached_tokens(second[sid]) == prompt - 1, sid
    assert stats.cache_hits >= 4 and stats.cache_entries >= 1
    assert 0 < stats.cache_bytes <= EngineConfig().prompt_cache_bytes


def test_a_concurrent_batch_is_identical_with_the_cache(
        reference: dict[str, list[OutputEvent]]) -> None:
    rep = make_replica()
    try:
        cold = generate_together(rep, BATCH)
        warm = generate_together(rep, BATCH)  # every prompt now has its own entry
        mixed = generate_together(rep, BATCH[::-1] + BATCH)  # hits and misses, twice over
    finally:
        rep.shutdown()
    for sid, events in zip(BATCH, cold):
        assert output(events) == output(reference[sid]), sid
    for sid, events in zip(BATCH, warm):
        assert output(events) == output(reference[sid]), sid
        assert cached_tokens(events) > 0, sid
    for sid, events in zip(BATCH[::-1] + BATCH, mixed):
        assert output(events) == output(reference[sid]), sid


def test_eviction_keeps_bytes_within_the_bound_and_output_identical(
        reference: dict[str, list[OutputEvent]]) -> None:
    bound = 200_000  # about one tool-result conversation of the tiny model's KV
    rep = make_replica(prompt_cache_bytes=bound)
    try:
        for sid in CONVERSATION * 3 + BATCH:
            assert output(generate(rep, sid)) == output(reference[sid]), sid
            stats = rep.stats()
            assert stats.cache_bytes <= bound, stats
        outs = generate_together(rep, BATCH)
        stats = rep.stats()
    finally:
        rep.shutdown()
    for sid, events in zip(BATCH, outs):
        assert output(events) == output(reference[sid]), sid
    assert stats.cache_evictions > 0 and stats.cache_hits > 0
    assert 0 < stats.cache_bytes <= bound


async def cancel_in_prefill(rep: ModelReplica, request: GenerationRequest,
                            reached: Callable[[], bool], timeout_s: float) -> bool:
    """Cancel `request` once `reached()` holds, as a client disconnect does; whether no token
    had come yet (the prompt was still being read). Returns once the batch is empty."""
    stream = rep.stream(request)
    first = asyncio.ensure_future(stream.__anext__())
    deadline = time.monotonic() + timeout_s
    while not reached():
        assert time.monotonic() < deadline and not first.done()
        await asyncio.sleep(0.001)
    in_prefill = not first.done()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await stream.aclose()
    while rep.stats().active:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    return in_prefill


def test_a_request_cancelled_in_prefill_leaves_the_cache_consistent(
        reference: dict[str, list[OutputEvent]]) -> None:
    # Four prompt tokens per step: the long prompt below prefills over hundreds of steps.
    rep = make_replica(prefill_step_size=4)
    try:
        assert output(generate(rep, "tool-one")) == output(reference["tool-one"])
        before = rep.stats()
        # tool-one's conversation plus a long new message: it starts from tool-one's entry.
        base = script_request("tool-one")
        assert isinstance(base.prompt, ChatPrompt)
        long = ChatMessage("user", " ".join(f"word{i}" for i in range(600)))
        request = dataclasses.replace(base, prompt=ChatPrompt(base.prompt.messages + (long,)))

        def submitted() -> bool:  # in the batch, its prompt being read
            return rep.stats().submitted != before.submitted

        assert asyncio.run(cancel_in_prefill(rep, request, submitted, 60))
        after = rep.stats()
        assert after.cache_hits == before.cache_hits + 1  # it did start from the cache
        assert (after.cache_entries, after.cache_bytes) == (before.cache_entries,
                                                            before.cache_bytes)
        again = generate(rep, "tool-result")
        one = generate(rep, "tool-one")
    finally:
        rep.shutdown()
    assert output(again) == output(reference["tool-result"]) and cached_tokens(again) > 0
    assert output(one) == output(reference["tool-one"]) and cached_tokens(one) > 0


def test_two_requests_with_the_same_new_prefix_at_once_are_both_correct(
        reference: dict[str, list[OutputEvent]]) -> None:
    rep = make_replica()
    try:
        one = script_request("tool-one")
        prompt_tokens = len(render_prompt(rep.model.hf_tokenizer, one.prompt, one.reasoning,
                                          rep.model.vocab_size, tools=one.tools).token_ids)
        both_new = generate_together(rep, ["tool-one", "tool-one"])
        both_next = generate_together(rep, ["tool-result", "tool-result", "tool-one"])
        stats = rep.stats()
    finally:
        rep.shutdown()
    missed = 0
    for events in both_new:
        assert output(events) == output(reference["tool-one"])
        # Nothing cached yet; or the engine took the second only once the first had left
        # its KV behind (the two are submitted together, prepared on separate threads).
        assert 0 <= cached_tokens(events) < prompt_tokens
        missed += cached_tokens(events) == 0
    for sid, events in zip(["tool-result", "tool-result", "tool-one"], both_next):
        assert output(events) == output(reference[sid]), sid
        assert cached_tokens(events) > 0, sid
    assert not any(isinstance(e, Failed) for events in both_next for e in events)
    assert missed >= 1 and stats.cache_misses == missed


def test_the_kv_before_the_last_message_is_kept_once_prefilled(
        reference: dict[str, list[OutputEvent]]) -> None:
    # Four prompt tokens per step: the long last message prefills over hundreds of steps.
    rep = make_replica(prefill_step_size=4)
    try:
        base = script_request("tool-result")
        assert isinstance(base.prompt, ChatPrompt)
        long = ChatMessage("user", " ".join(f"word{i}" for i in range(600)))
        request = dataclasses.replace(base, prompt=ChatPrompt(base.prompt.messages + (long,)))
        model = rep.model
        full = render_prompt(model.hf_tokenizer, request.prompt, request.reasoning,
                             model.vocab_size, tools=request.tools).token_ids
        boundary = last_message_boundary(model.hf_tokenizer, request.prompt, request.reasoning,
                                         full, request.tools)
        assert boundary > 200

        def saved() -> bool:  # the boundary's entry, saved mid-prefill
            return rep.stats().cache_entries > 0

        assert asyncio.run(cancel_in_prefill(rep, request, saved, 120))
        # The request never finished, yet what preceded its last message is cached: the
        # same conversation without it (a retry, an edit) reuses all of that.
        again = generate(rep, "tool-result")
        stats = rep.stats()
    finally:
        rep.shutdown()
    assert output(again) == output(reference["tool-result"])
    assert cached_tokens(again) == boundary
    assert stats.cache_hits == 1 and stats.cache_misses == 1
