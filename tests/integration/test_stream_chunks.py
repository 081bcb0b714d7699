"""A replica's streams share its chunk rate (`max_chunks_per_s`): with many streams each
chunk carries several tokens, the text is the same, and the first chunk is not held back.

On `builtin:ceiling` (next to no compute per token, never ends early), where the serving
path, not decode, would otherwise set how often chunks leave."""

from __future__ import annotations

import asyncio
import time
from typing import Iterator

import pytest

from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    OutputEvent,
    SamplingParams,
    TextDelta,
    merge_deltas,
)
from replicas.replica import ModelReplica, ReplicaOptions

STREAMS, TOKENS = 16, 96


def replica(max_chunks_per_s: float) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="m", source="builtin:ceiling",
                                      flush_interval_s=0.005,
                                      max_chunks_per_s=max_chunks_per_s))
    rep.start()
    return rep


@pytest.fixture(scope="module")
def bounded() -> Iterator[ModelReplica]:
    rep = replica(100.0)
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def unbounded() -> Iterator[ModelReplica]:
    rep = replica(0.0)
    yield rep
    rep.shutdown()


def request(i: int) -> GenerationRequest:
    return GenerationRequest(f"r{i}", "m", ChatPrompt((ChatMessage("user", f"story {i}"),)),
                             sampling=SamplingParams(temperature=0.0, max_tokens=TOKENS))


async def run(rep: ModelReplica) -> tuple[list[list[list[OutputEvent]]], float]:
    """Every stream's chunks, and the seconds all of them took."""
    async def one(i: int) -> list[list[OutputEvent]]:
        return [batch async for batch in rep.stream(request(i))]

    started = time.monotonic()
    chunks = await asyncio.gather(*(one(i) for i in range(STREAMS)))
    return list(chunks), time.monotonic() - started


def text(chunks: list[list[OutputEvent]]) -> str:
    return "".join(e.text for batch in chunks for e in batch if isinstance(e, TextDelta))


def test_many_streams_share_the_chunk_rate(bounded: ModelReplica,
                                           unbounded: ModelReplica) -> None:
    asyncio.run(run(bounded))  # warm-up: compiled kernels, the chat template
    chunked, seconds = asyncio.run(run(bounded))
    free, _ = asyncio.run(run(unbounded))
    sent = sum(len(c) for c in chunked)
    # Each stream's first chunk leaves at once; after that the replica sends at most 100 a
    # second between its streams (a stream's last chunk may leave early, at its end).
    assert sent <= 2 * STREAMS + 100 * seconds * 1.25, (sent, seconds)
    # Without the bound the same load sends far more chunks: this test can tell them apart.
    assert sum(len(c) for c in free) > 2 * sent, (sum(len(c) for c in free), sent)
    # Same greedy text either way, and every chunk's deltas already joined.
    assert [text(c) for c in chunked] == [text(c) for c in free]
    for chunks in chunked:
        for batch in chunks:
            assert merge_deltas(batch) == batch


def test_the_first_chunk_is_not_held_back(bounded: ModelReplica) -> None:
    async def chunks() -> list[list[OutputEvent]]:
        return [batch async for batch in bounded.stream(request(99))]

    first, *rest = asyncio.run(chunks())
    # It leaves with the first step's token, not after lingering for more (a linger would
    # gather a 5 ms window's tokens, and a held stream everything up to its end).
    whole = text([first, *rest])
    assert rest and len(text([first])) < len(whole) / 8, (first, len(rest))
