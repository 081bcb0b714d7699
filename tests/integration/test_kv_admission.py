"""KV memory admission on the real tiny model (`replicas.engine.kv.budget`): requests join the batch
while what the batch holds (every row padded to the longest, in 256-token cache steps) fits
the budget, wait in order otherwise, are refused as overloaded past the waiting bound, and a
request that cannot fit even alone is lowered or refused like one past the context. The
prefix cache gives way first. Requests that outgrow the budget while decoding are preempted
and resumed (tests/integration/test_preemption.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import mlx.core as mx
import pytest

from replicas.contract import (
    ErrorKind,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    TextDelta,
    TokenPrompt,
)
from replicas.engine.config import EngineConfig
from replicas.engine.kv.layout import CACHE_STEP
from replicas.engine.kv.budget import weights_bytes
from replicas.replica import ModelReplica, ReplicaOptions
from tests.streams import collect, stream_events

PROMPT, OUTPUT = 10, 35  # one request reaches 45 tokens: one cache step
# Two one-step rows fit at once, a third waits; one request alone may reach two steps.
BUDGET_TOKENS = 2 * CACHE_STEP + 100
MAX_TOKENS = 2 * CACHE_STEP


def _replica(max_waiting: int = 64, cache_bytes: int = 0,
             policy: str = "clamp") -> Iterator[ModelReplica]:
    probe = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny"))
    probe.start()
    per_token = probe._engine.kv_budget.layout.per_token  # noqa: SLF001 - the model's own
    probe.shutdown()
    engine = EngineConfig(kv_budget_bytes=BUDGET_TOKENS * per_token,
                          max_memory_waiting=max_waiting, prompt_cache_bytes=cache_bytes)
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny", engine=engine,
                                      max_tokens_past_context=policy))
    rep.start()
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def replica() -> Iterator[ModelReplica]:
    yield from _replica()


def _request(rid: str, prompt: int = PROMPT, max_tokens: int | None = OUTPUT,
             first: int = 5) -> GenerationRequest:
    # An unscripted token prompt: the tiny model's greedy text runs to max_tokens.
    return GenerationRequest(request_id=rid, model="tiny",
                             prompt=TokenPrompt(tuple(range(first, first + prompt))),
                             sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens))


def _text(events: list[object]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def _together(rep: ModelReplica, requests: list[GenerationRequest],
                    samples: list[tuple[int, int]]) -> list[list[object]]:
    """Run `requests` at once, sampling (running, waiting) while they run."""
    async def watch() -> None:
        while True:
            stats = rep.stats()
            assert stats.memory is not None
            samples.append((stats.active, stats.memory.waiting))
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    try:
        return list(await asyncio.gather(*(collect(rep.stream(r)) for r in requests)))
    finally:
        watcher.cancel()


def test_requests_wait_for_memory_and_all_finish_as_alone(replica: ModelReplica) -> None:
    alone = [stream_events(replica, _request(f"alone-{i}", first=5 + i)) for i in range(4)]
    samples: list[tuple[int, int]] = []
    together = asyncio.run(_together(
        replica, [_request(f"together-{i}", first=5 + i) for i in range(4)], samples))
    assert [_text(e) for e in together] == [_text(e) for e in alone]
    assert all(isinstance(e[-1], Finished) for e in together)
    assert max(active for active, _ in samples) == 2  # 3 steps of 256 would pass the budget
    assert max(waiting for _, waiting in samples) >= 1
    stats = replica.stats().memory
    assert stats is not None and stats.projected_bytes == 0 and stats.waiting == 0


def test_past_the_waiting_bound_is_overloaded() -> None:
    for rep in _replica(max_waiting=1):
        samples: list[tuple[int, int]] = []
        results = asyncio.run(_together(rep, [_request(f"w-{i}", first=5 + i) for i in range(4)],
                                        samples))
        ends = [events[-1] for events in results]
        refused = [e for e in ends if isinstance(e, Failed)]
        assert len(refused) == 1 and refused[0].kind is ErrorKind.OVERLOADED
        assert "KV memory" in refused[0].message
        assert sum(isinstance(e, Finished) for e in ends) == 3
        memory = rep.stats().memory
        assert memory is not None and memory.refused == 1


def test_what_cannot_fit_alone_is_lowered_or_refused(replica: ModelReplica) -> None:
    finished = stream_events(replica, _request("big", max_tokens=900))[-1]
    assert isinstance(finished, Finished)
    assert finished.usage.completion_tokens <= MAX_TOKENS - PROMPT
    assert finished.warnings == (
        f"max_tokens lowered from 900 to {MAX_TOKENS - PROMPT}: the prompt has {PROMPT} "
        f"tokens and this replica's KV memory budget holds at most {MAX_TOKENS} tokens",)
    # The default max_tokens (what is left) is the budget's room, not the context's.
    unbounded = stream_events(replica, _request("default", max_tokens=None))[-1]
    assert isinstance(unbounded, Finished)
    assert unbounded.usage.completion_tokens <= MAX_TOKENS - PROMPT
    for rep in _replica(policy="reject"):
        failed = stream_events(rep, _request("too-big", max_tokens=900))[-1]
        assert isinstance(failed, Failed) and failed.kind is ErrorKind.CONTEXT_LENGTH
        assert f"holds at most {MAX_TOKENS} tokens" in failed.message
    too_long = stream_events(replica, _request("long-prompt", prompt=MAX_TOKENS))[-1]
    assert isinstance(too_long, Failed) and too_long.kind is ErrorKind.CONTEXT_LENGTH


def test_the_prefix_cache_gives_way_to_a_request(replica: ModelReplica) -> None:
    for rep in _replica(cache_bytes=10**9):
        per_token = rep._engine.kv_budget.layout.per_token  # noqa: SLF001
        for first in (5, 50, 95):  # three finished requests, about 60 tokens each
            stream_events(rep, _request(f"fill-{first}", prompt=40, max_tokens=20, first=first))
        before = rep.stats()
        room = (BUDGET_TOKENS - 2 * CACHE_STEP) * per_token  # what two cache steps leave
        assert before.cache_entries == 3 and room < before.cache_bytes
        # The two oldest entries give way before the request takes its two steps; the
        # newest fits beside it and stays.
        done = stream_events(rep, _request("room", prompt=300, max_tokens=60, first=200))[-1]
        assert isinstance(done, Finished)
        after = rep.stats()
        assert after.cache_evictions == before.cache_evictions + 2
        assert after.cache_entries == 2  # the newest fill, and "room" once it finished


def test_mlx_memory_limit_follows_the_budget(replica: ModelReplica) -> None:
    budget = replica._engine.kv_budget.budget_bytes  # noqa: SLF001
    # Weights, the budget with a tenth of slack, and room for activations besides; MLX's
    # limit is the process's, and covers every replica still held here (the probe too).
    mine = int(weights_bytes(replica.model.model) + budget * 1.1) + 512 * 1024**2
    assert replica._engine.kv_budget.ranks[0].limit == mine  # noqa: SLF001
    assert mx.get_memory_limit() >= mine
    assert replica._engine.kv_budget.max_tokens == MAX_TOKENS  # noqa: SLF001


def test_waiting_past_the_bound_is_overloaded_not_a_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`max_memory_wait_s` (deployments set it under the ingress's deadline): a request still
    waiting for KV memory then gets the overloaded error, which the APIs send with
    Retry-After, instead of running into the deadline's 504."""
    probe = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny"))
    probe.start()
    per_token = probe._engine.kv_budget.layout.per_token  # noqa: SLF001
    never_end = {token: -100.0 for token in probe.model.eos_token_ids}
    probe.shutdown()
    # One row of one step fits; the second request waits behind the first.
    engine = EngineConfig(kv_budget_bytes=(CACHE_STEP + 10) * per_token, prompt_cache_bytes=0,
                          max_memory_wait_s=0.2)
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny", engine=engine))
    rep.start()
    # Steps of at least 2 ms: the first request's 240 tokens then outlast the second's
    # 0.2 s wait on any machine (the tiny model alone makes them in about 0.2 s here).
    batch = rep._engine._batch  # noqa: SLF001
    step = batch.step
    monkeypatch.setattr(batch, "step", lambda: (time.sleep(0.002), step())[1])
    try:
        long = GenerationRequest(request_id="long", model="tiny",
                                 prompt=TokenPrompt(tuple(range(5, 15))),
                                 sampling=SamplingParams(temperature=0.0, max_tokens=240,
                                                         logit_bias=never_end))

        async def both() -> list[list[object]]:
            first = asyncio.ensure_future(collect(rep.stream(long)))
            await asyncio.sleep(0.05)
            second = await collect(rep.stream(_request("waits", first=40)))
            return [await first, second]

        first, second = asyncio.run(both())
        assert isinstance(first[-1], Finished)
        assert isinstance(second[-1], Failed) and second[-1].kind is ErrorKind.OVERLOADED
        assert "stayed taken for 0.2s" in second[-1].message
    finally:
        rep.shutdown()
