"""Pull instead of recompute (`replicas.kv_pull`), two replicas of the real tiny model
in-process: a conversation's second turn on the replica that did not serve the first pulls
the first turn's KV from the one that did, and its output is exactly what a replica
without any cache writes. A pull that is declined, fails, or brings KV of another model
costs a prefill and nothing else. A decode replica hands a long prompt to a prefill
replica (`role`) and decodes from the KV it gets back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Iterator

import pytest

from replicas.contract import Finished, OutputEvent
from replicas.engine.config import EngineConfig
from replicas.engine.kv.transfer import PrefixKV, PrefixPull
from replicas.kv_pull import Fetch, Source
from replicas.options import PullOptions
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.test_prompt_cache import generate, output, prompt_ids
from tests.scripted import script_request
from tests.streams import collect

PULL = PullOptions(min_tokens=16)
FIRST, SECOND = "tool-one", "tool-result"  # the second's prompt extends the first's answer


def make(cache: bool = True, **engine: Any) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(
        model_id="tiny", source="builtin:tiny", pull=PULL,
        engine=EngineConfig(prompt_cache_bytes=(1 << 26) if cache else 0, **engine)))
    rep.start()
    return rep


@pytest.fixture(scope="module")
def uncached() -> Iterator[ModelReplica]:
    rep = make(cache=False)
    yield rep
    rep.shutdown()


@pytest.fixture
def holder() -> Iterator[ModelReplica]:
    rep = make()
    generate(rep, FIRST)  # its KV stays in this replica's cache
    yield rep
    rep.shutdown()


@pytest.fixture
def asker() -> Iterator[ModelReplica]:
    rep = make()
    yield rep
    rep.shutdown()


def from_replica(rep: ModelReplica) -> Fetch:
    async def fetch(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
        return await rep.export_prefix(PrefixPull(tokens, at_least, "holder"))
    return fetch


def run(rep: ModelReplica, sid: str, fetch: Fetch | None) -> list[OutputEvent]:
    source = Source(fetch, PULL.min_tokens) if fetch is not None else None
    return asyncio.run(collect(rep.stream(script_request(sid), source)))


def cached(events: list[OutputEvent]) -> int:
    assert isinstance(events[-1], Finished)
    return events[-1].usage.cached_tokens


def test_the_second_turn_pulls_the_first_s_kv_and_writes_the_same(
        holder: ModelReplica, asker: ModelReplica, uncached: ModelReplica) -> None:
    events = run(asker, SECOND, from_replica(holder))
    assert output(events) == output(generate(uncached, SECOND))
    totals = asker.pull_totals()
    assert totals["outcomes"] == {"pulled": 1} and totals["bytes"] > 0
    # The holder's own stats do not count another replica's pull as its hit.
    assert holder.stats().cache_hits == 0
    # Served from the pulled KV: as much of the prompt as the holder would have served
    # itself (most of the first turn: the template renders its answer back a little
    # differently), none of it recomputed.
    own = generate(holder, SECOND)
    assert cached(events) == cached(own) == totals["tokens"] > PULL.min_tokens
    assert cached(own) > len(prompt_ids(holder, FIRST)) * 0.9


def test_a_holder_without_the_prefix_declines_and_the_asker_prefills(
        holder: ModelReplica, asker: ModelReplica, uncached: ModelReplica) -> None:
    events = run(asker, "multi-turn", from_replica(holder))  # unrelated to what it holds
    assert output(events) == output(generate(uncached, "multi-turn"))
    assert cached(events) == 0 and asker.pull_totals()["outcomes"] == {"declined": 1}


def test_kv_of_another_model_or_a_failed_pull_is_never_used(
        holder: ModelReplica, uncached: ModelReplica, caplog: pytest.LogCaptureFixture) -> None:
    async def foreign(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
        kv = await from_replica(holder)(tokens, at_least)
        assert kv is not None
        return dataclasses.replace(kv, fingerprint="another-model")

    async def broken(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
        raise ConnectionError("the holder's Mac went away")

    reference = output(generate(uncached, SECOND))
    with caplog.at_level(logging.WARNING):
        for fetch in (foreign, broken):
            asker = make()  # a fresh one each: the first would have SECOND cached
            try:
                events = run(asker, SECOND, fetch)
                assert output(events) == reference and cached(events) == 0
                assert asker.pull_totals()["outcomes"] == {"failed": 1}
            finally:
                asker.shutdown()
    assert any("another model" in r.message for r in caplog.records)
    assert any("the holder's Mac went away" in r.message for r in caplog.records)


def test_a_short_missing_prefix_is_prefilled_without_asking(
        holder: ModelReplica, uncached: ModelReplica) -> None:
    asked: list[int] = []

    async def fetch(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
        asked.append(at_least)
        return None

    generate(holder, FIRST)  # the holder has all of FIRST: nothing is missing to ask for
    assert output(run(holder, FIRST, fetch)) == output(generate(uncached, FIRST))
    assert asked == [] and holder.pull_totals()["outcomes"] == {}


def test_a_decode_replica_decodes_from_the_kv_a_prefill_replica_computed(
        asker: ModelReplica, uncached: ModelReplica) -> None:
    prefill = make()
    try:
        async def prefilled(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
            return await prefill.prefill_prefix(tokens)

        source = Source(prefilled, PULL.min_tokens, estimate=False, kind="prefill")
        events = asyncio.run(collect(asker.stream(script_request(SECOND), source)))
        assert output(events) == output(generate(uncached, SECOND))
        # All but the last prompt token came from the prefill replica, which ran one job.
        prompt = len(prompt_ids(asker, SECOND))
        assert cached(events) == prompt - 1 == asker.pull_totals()["tokens"]
        assert asker.pull_totals()["outcomes"] == {"prefill pulled": 1}
        assert prefill.stats().submitted == 1 and asker.stats().submitted == 1
    finally:
        prefill.shutdown()


def test_kv_too_big_for_the_asker_s_cache_still_serves_its_request(
        holder: ModelReplica, uncached: ModelReplica) -> None:
    """A big model's history outgrows the prefix cache's bound: the pulled KV is kept for
    its request alone, not dropped (and not kept after it)."""
    small = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny", pull=PULL,
                                        engine=EngineConfig(prompt_cache_bytes=50_000)))
    small.start()
    try:
        events = run(small, SECOND, from_replica(holder))
        assert output(events) == output(generate(uncached, SECOND))
        assert cached(events) == small.pull_totals()["tokens"] > PULL.min_tokens
        assert small.stats().cache_entries == 0  # over the bound: served once, not kept
    finally:
        small.shutdown()


def test_quantized_kv_moves_and_serves_as_the_holder_s_own_cache_would() -> None:
    """`kv_bits`: the pulled layers are quantized rows the asker's batch merges, and the
    turn writes what the holder writes from its own cache; float KV is refused."""
    quantized = {"kv_bits": 8, "kv_group_size": 32}  # tiny's head_dim is 32
    holder, asker, plain = make(**quantized), make(**quantized), make()
    try:
        generate(holder, FIRST)
        events = run(asker, SECOND, from_replica(holder))
        assert asker.pull_totals()["outcomes"] == {"pulled": 1}
        own = generate(holder, SECOND)
        assert output(events) == output(own)
        assert cached(events) == cached(own) == asker.pull_totals()["tokens"] > PULL.min_tokens
        # 8-bit codes with a float32 scale and bias per 32 values, against tiny's float32
        # KV: about 0.31x the bytes.
        generate(plain, FIRST)
        float_pull = make()
        try:
            run(float_pull, SECOND, from_replica(plain))
            ratio = asker.pull_totals()["bytes"] / float_pull.pull_totals()["bytes"]
        finally:
            float_pull.shutdown()
        assert 0.2 < ratio < 0.35, ratio
        # Float KV offered to a quantized replica is foreign: a prefill, not a crash.
        other = make(**quantized)
        try:
            events = run(other, SECOND, from_replica(plain))
            assert cached(events) == 0 and other.pull_totals()["outcomes"] == {"failed": 1}
        finally:
            other.shutdown()
    finally:
        for rep in (holder, asker, plain):
            rep.shutdown()
