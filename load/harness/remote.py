"""The remote tier of `load/agent_turns/kv_tiers.py`: two replicas of one model, each in a Ray
actor of its own (two processes on this machine), the second pulling a history's KV from
the first over Ray's object store (`replicas.kv_pull`), as two replicas of a deployment do.

Only 127.0.0.1: a private local Ray (`ray.init(address="local")`), shut down at the end.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from replicas.contract import ChatMessage, ChatPrompt, Finished, GenerationRequest, \
    SamplingParams
from replicas.engine.config import EngineConfig
from replicas.engine.kv.transfer import PrefixKV, PrefixPull
from replicas.kv_pull import Source
from replicas.replica import ModelReplica, ReplicaOptions

MIN_TOKENS = 512  # the default `routing.pull.min_tokens`


def chat(text: str) -> GenerationRequest:
    """The bench's one-token turn over a history `text`."""
    return GenerationRequest(f"r{time.monotonic_ns()}", "m", ChatPrompt((
        ChatMessage("system", text), ChatMessage("user", "And then?"))),
        SamplingParams(max_tokens=1, temperature=0.0))


async def timed_turn(rep: ModelReplica, text: str, source: Source | None = None
                     ) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens) of one greedy one-token turn."""
    start = time.perf_counter()
    first = 0.0
    events: list[Any] = []
    async for batch in rep.stream(chat(text), source):
        first = first or time.perf_counter() - start
        events += batch
    finished = events[-1]
    assert isinstance(finished, Finished), f"the turn failed: {finished}"
    return first, finished.usage.prompt_tokens, finished.usage.cached_tokens


@ray.remote(num_cpus=0)
class RemoteReplica:
    """A `ModelReplica` in its own process, which can hold a history or pull one."""

    def __init__(self, source: str) -> None:
        self.rep = ModelReplica(ReplicaOptions(model_id="m", source=source, engine=EngineConfig(
            prompt_cache_bytes=8 * 1024**3)))
        self.rep.start()

    async def turn(self, text: str) -> tuple[float, int, int]:
        return await timed_turn(self.rep, text)

    async def export_prefix(self, pull: PrefixPull) -> PrefixKV | None:
        return await self.rep.export_prefix(pull)

    async def turn_pulling(self, text: str, holder: Any) -> tuple[float, int, int, int]:
        """The turn, its prefix pulled from `holder` first: TTFT, prompt and cached
        tokens, and the bytes pulled."""
        async def fetch(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
            answer: PrefixKV | None = await holder.export_prefix.remote(
                PrefixPull(tokens, at_least, "holder"))
            return answer

        before = self.rep.pull_totals().get("bytes", 0)
        seconds, prompt, hit = await timed_turn(
            self.rep, text, Source(fetch, MIN_TOKENS, estimate=False))
        return seconds, prompt, hit, self.rep.pull_totals()["bytes"] - before

    def shutdown(self) -> None:
        self.rep.shutdown()


def remote_turn(source: str, text: str) -> tuple[float, int, int, int]:
    """A holder replica serves `text` once; a second one pulls it for the same turn."""
    holder = RemoteReplica.remote(source)  # type: ignore[attr-defined]
    asker = RemoteReplica.remote(source)  # type: ignore[attr-defined]
    try:
        ray.get(holder.turn.remote(text))
        result: tuple[float, int, int, int] = ray.get(asker.turn_pulling.remote(text, holder))
        return result
    finally:
        ray.get([holder.shutdown.remote(), asker.shutdown.remote()])
        for actor in (holder, asker):
            ray.kill(actor)
