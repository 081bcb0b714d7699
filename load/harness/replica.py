"""In-process replicas for the benchmarks that drive `replicas` directly (no Ray, no HTTP):
one started with a KV budget, its peaks watched while work runs, and sessions of random
token ids that share no prefix."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections import Counter
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

from replicas.contract import GenerationRequest, SamplingParams, TokenPrompt
from replicas.engine.config import EngineConfig
from replicas.replica import ModelReplica, ReplicaOptions

MIB = 2**20
T = TypeVar("T")


def budget_replica(args: argparse.Namespace, budget: int | None, **engine: Any) -> ModelReplica:
    """A started replica of `args.source` with `budget` KV bytes (None: the default budget);
    `engine` overrides other `EngineConfig` fields (`kv_reservation`, `prompt_cache_bytes`)."""
    config = replace(EngineConfig(kv_budget_bytes=budget, max_memory_waiting=args.max_waiting,
                                  prompt_cache_bytes=args.cache_bytes), **engine)
    rep = ModelReplica(ReplicaOptions(model_id="bench", source=args.source, engine=config))
    rep.start()
    return rep


async def _watch(rep: ModelReplica, peaks: Counter[str], stop: asyncio.Event) -> None:
    """Peak running requests, waiting-for-memory requests and projected KV, every 5 ms;
    also the sum of running requests over the samples ("active_sum", "samples"), for a mean."""
    while not stop.is_set():
        stats = rep.stats()
        peaks["active"] = max(peaks["active"], stats.active)
        peaks["active_sum"] += stats.active
        peaks["samples"] += 1
        if stats.memory is not None:
            peaks["waiting"] = max(peaks["waiting"], stats.memory.waiting)
            peaks["projected"] = max(peaks["projected"], stats.memory.projected_bytes)
        await asyncio.sleep(0.005)


async def watched(rep: ModelReplica, work: Awaitable[T], peaks: Counter[str]) -> T:
    """`work`, awaited while `peaks` records the replica's peaks."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(rep, peaks, stop))
    try:
        return await work
    finally:
        stop.set()
        await watcher


def random_session(i: int, level: int, args: argparse.Namespace) -> GenerationRequest:
    """Session `i` of `level`: `args.session_tokens` random ids, `args.session_output` new
    tokens; seeded, so a rerun sends the same prompts."""
    rng = random.Random(f"{level}-{i}")
    # Ids below the built-in models' 743 special tokens (vocab 752): plain text tokens.
    ids = tuple(rng.randrange(10, 740) for _ in range(args.session_tokens))
    return GenerationRequest(
        request_id=f"s{level}-{i}", model="bench", prompt=TokenPrompt(ids),
        sampling=SamplingParams(temperature=0.0, max_tokens=args.session_output))
