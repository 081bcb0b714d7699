"""Preemption under a small KV budget on the real tiny model (`replicas.engine.core`).

A request reserves its prompt plus one cache step and grows as it decodes; when the batch
would pass the budget the youngest request leaves the batch and later resumes by prefill.
32 requests without `max_tokens` all complete, the KV the batch holds never passes the
budget, and greedy text is what an ample budget gives, with the prefix cache off (resumed
purely by recompute) and on (the preempted KV parked in it). The youngest requests are
guided (a JSON schema): their grammar state survives preemption and their JSON is valid.
"""

from __future__ import annotations

import asyncio
import json
from typing import Iterator

import pytest

from replicas.contract import (
    Finished,
    GenerationRequest,
    GuidedSpec,
    SamplingParams,
    TextDelta,
    TokenPrompt,
)
from replicas.engine.config import EngineConfig
from replicas.engine.kv.layout import CACHE_STEP
from replicas.replica import ModelReplica, ReplicaOptions
from tests.streams import collect

CONTEXT = 320  # max_model_len: a request without max_tokens decodes up to this
REQUESTS = 32
GUIDED = 4  # the youngest requests write JSON to this schema
# Exactly ITEMS one-digit numbers: a grammar that read a token twice after a preemption would
# count one item (or digit) too many, and the JSON would show it.
ITEMS = 90
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": ITEMS, "maxItems": ITEMS}
# Four rows of one step, two of two, one of three: rows that grow must preempt others.
BUDGET_STEPS = 4


def _replica(budget_bytes: int | None, cache_bytes: int) -> ModelReplica:
    engine = EngineConfig(kv_budget_bytes=budget_bytes, prompt_cache_bytes=cache_bytes)
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny", engine=engine,
                                      max_model_len=CONTEXT))
    rep.start()
    return rep


@pytest.fixture(scope="module")
def ample() -> Iterator[ModelReplica]:
    rep = _replica(None, 0)
    yield rep
    rep.shutdown()


def _requests(rep: ModelReplica) -> list[GenerationRequest]:
    # Unscripted token prompts of different lengths, end of text banned: greedy text runs
    # to the context.
    never_end = {token: -100.0 for token in rep.model.eos_token_ids}
    guided = GuidedSpec("json_schema", json.dumps(SCHEMA))
    return [GenerationRequest(request_id=f"p-{i}", model="tiny",
                              prompt=TokenPrompt(tuple(range(5 + i, 5 + i + 8 + i % 5))),
                              sampling=SamplingParams(temperature=0.0, max_tokens=None,
                                                      logit_bias=never_end),
                              guided=guided if i >= REQUESTS - GUIDED else None)
            for i in range(REQUESTS)]


async def _run(rep: ModelReplica, samples: list[int]) -> list[list[object]]:
    async def watch() -> None:
        while True:
            memory = rep.stats().memory
            assert memory is not None
            samples.append(memory.projected_bytes)
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    try:
        return list(await asyncio.gather(*(collect(rep.stream(r)) for r in _requests(rep))))
    finally:
        watcher.cancel()


def _text(events: list[object]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


@pytest.fixture(scope="module")
def expected(ample: ModelReplica) -> list[str]:
    results = asyncio.run(_run(ample, []))
    assert all(isinstance(e[-1], Finished) for e in results)
    return [_text(e) for e in results]


@pytest.mark.parametrize("cache_bytes", [0, 64 * 1024**2], ids=["recompute", "parked"])
def test_32_requests_without_max_tokens_complete_within_the_budget(
        ample: ModelReplica, expected: list[str], cache_bytes: int) -> None:
    budget = BUDGET_STEPS * CACHE_STEP * ample._engine.kv_budget.layout.per_token  # noqa: SLF001
    rep = _replica(budget, cache_bytes)
    try:
        samples: list[int] = []
        results = asyncio.run(_run(rep, samples))
        ends = [e[-1] for e in results]
        assert all(isinstance(e, Finished) for e in ends), [e for e in ends
                                                             if not isinstance(e, Finished)]
        # Each unguided one ran to the context (no max_tokens): preemption never cut one
        # short; each guided one wrote its JSON and stopped.
        assert all(isinstance(e, Finished) and e.usage.prompt_tokens
                   + e.usage.completion_tokens == CONTEXT for e in ends[:-GUIDED])
        texts = [_text(e) for e in results]
        assert texts == expected
        for text in texts[-GUIDED:]:
            assert len(json.loads(text)) == ITEMS, text
        memory = rep.stats().memory
        assert memory is not None
        assert memory.preempted > 0  # the budget did force requests out
        assert max(samples) <= budget and max(samples) > budget // 2, (max(samples), budget)
        assert memory.projected_bytes == 0 and memory.waiting == 0
    finally:
        rep.shutdown()
