"""Priority under KV pressure on the real tiny model (issue 61): when the batch's KV runs
out, the row with the lowest priority (the highest value) leaves first, even when it is the
oldest, and resumes exactly: its greedy text is what an ample budget gives."""

from __future__ import annotations

import asyncio
import logging
from typing import Iterator

import pytest

from replicas.contract import (Finished, GenerationRequest, OutputEvent, SamplingParams, Tenancy,
                               TextDelta, TokenPrompt, merge_deltas)
from replicas.engine.config import EngineConfig
from replicas.engine.kv.layout import CACHE_STEP
from replicas.replica import ModelReplica, ReplicaOptions
from tests.streams import collect

CONTEXT = 320  # each request decodes to here (end of text banned, no max_tokens)
# The two rows need two cache steps each by the end: three make one of them leave, when the
# second crosses into its second step (they start a token apart, so both are in the batch).
BUDGET_STEPS = 3


def _replica(budget_bytes: int | None) -> ModelReplica:
    engine = EngineConfig(kv_budget_bytes=budget_bytes, prompt_cache_bytes=0)
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny", engine=engine,
                                      max_model_len=CONTEXT))
    rep.start()
    return rep


@pytest.fixture(scope="module")
def ample() -> Iterator[ModelReplica]:
    rep = _replica(None)
    yield rep
    rep.shutdown()


def _requests(rep: ModelReplica) -> list[GenerationRequest]:
    never_end = {token: -100.0 for token in rep.model.eos_token_ids}
    sampling = SamplingParams(temperature=0.0, max_tokens=None, logit_bias=never_end)
    # The batch job's request comes first (the oldest row), the agent's after it.
    return [GenerationRequest("batch-job", "tiny", TokenPrompt(tuple(range(5, 17))), sampling,
                              tenancy=Tenancy("batch", priority=5)),
            GenerationRequest("agent", "tiny", TokenPrompt(tuple(range(40, 49))), sampling,
                              tenancy=Tenancy("agents", priority=0))]


async def _run(rep: ModelReplica) -> list[list[object]]:
    first, second = _requests(rep)
    stream = rep.stream(first)
    seen: list[OutputEvent] = []
    async for batch in stream:
        seen.extend(batch)
        if any(isinstance(e, TextDelta) for e in batch):
            break  # it decodes: the agent's request joins beside it, both grow together

    async def rest() -> list[OutputEvent]:
        async for batch in stream:
            seen.extend(batch)
        return merge_deltas(seen)

    return [*await asyncio.gather(rest(), collect(rep.stream(second)))]


def _text(events: list[object]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_the_low_priority_row_is_preempted_and_resumes_exactly(
        ample: ModelReplica, caplog: pytest.LogCaptureFixture) -> None:
    expected = [_text(e) for e in asyncio.run(_run(ample))]
    budget = BUDGET_STEPS * CACHE_STEP * ample._engine.kv_budget.layout.per_token  # noqa: SLF001
    rep = _replica(budget)
    try:
        with caplog.at_level(logging.INFO, logger="replicas.engine.scheduling"):
            results = asyncio.run(_run(rep))
        assert all(isinstance(e[-1], Finished) for e in results)
        assert [_text(e) for e in results] == expected
        preempted = [r.getMessage().split()[1] for r in caplog.records
                     if "preempted" in r.getMessage()]
        assert preempted and set(preempted) == {"batch-job"}, preempted
        memory = rep.stats().memory
        assert memory is not None and memory.preempted == len(preempted)
        # Each request's usage says how often it left the batch: only the batch job's.
        ends = [e[-1] for e in results]
        assert [e.usage.preemptions for e in ends if isinstance(e, Finished)] == \
            [len(preempted), 0]
    finally:
        rep.shutdown()
