"""What a disk hit costs the stream decoding beside it: the longest pause between that
stream's tokens while another request's prefix is read from the prefix cache's disk tier,
read on a worker thread (`replicas.disk_reads`, what Orchard does) against read on the
engine thread (what it did before issue 59), on `builtin:bench` in-process.

Entries of `--tokens` tokens of `builtin:bench`-shaped KV (8 KB a token) are written to a
fresh disk tier first, one per read, so each read is a real file read and check. Prints,
for each way, the median over the rounds of the longest gap during a read and of the
stream's median gap, and the ratio of the longest gaps.

    python -m load.micro.disk_hit [--tokens 16384] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from load.harness.stats import at_least_three
from replicas.beside_model import kv_fingerprint
from replicas.contract import GenerationRequest, SamplingParams, TokenPrompt
from replicas.engine.config import EngineConfig
from replicas.engine.kv.disk import DiskTier
from replicas.replica import ModelReplica, ReplicaOptions

LAYERS, HEADS, HEAD_DIM = 8, 4, 64  # builtin:bench's KV


def replica(directory: Path) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(
        model_id="bench", source="builtin:bench", flush_interval_s=0.0, max_chunks_per_s=0.0,
        engine=EngineConfig(disk_cache_dir=str(directory), disk_cache_bytes=1 << 40)))
    rep.start()
    return rep


def entry(tokens: int) -> list[Any]:
    layers = []
    for _ in range(LAYERS):
        layer = KVCache()
        shape = (1, HEADS, tokens, HEAD_DIM)
        layer.update_and_fetch(mx.random.normal(shape).astype(mx.bfloat16),
                               mx.random.normal(shape).astype(mx.bfloat16))
        layers.append(layer)
    return layers


def on_engine_thread(rep: ModelReplica) -> Callable[..., Any]:
    """The way before: the file read and checked on the engine thread."""
    reads = rep._prefixes._disk_reads
    assert reads is not None

    async def before(prompt: Any) -> int:
        assert reads is not None
        cache = reads._cache
        tokens = list(prompt)
        found = await reads._on_engine(lambda: cache.disk_wanted(tokens))
        if found is None:
            return 0

        def read_and_take() -> None:
            layers = cache.read_disk(found)
            if layers is not None:
                cache.take_disk(found, layers)

        await reads._on_engine(read_and_take)
        return int(found.length)

    return before


def timed_reads(rep: ModelReplica) -> list[tuple[float, float]]:
    """Each disk read's start and end, as `PromptCache.read_disk` runs it."""
    reads = rep._prefixes._disk_reads
    assert reads is not None
    cache, spans = reads._cache, []
    read = cache.read_disk

    def timed(found: Any) -> Any:
        started = time.perf_counter()
        try:
            return read(found)
        finally:
            spans.append((started, time.perf_counter()))

    cache.read_disk = timed  # type: ignore[method-assign]
    return spans


async def one_read(rep: ModelReplica, prompt: tuple[int, ...], n: int,
                   spans: list[tuple[float, float]]) -> tuple[float, float]:
    """The stream's longest gap while `prompt`'s prefix is read (the read alone, not the
    request's join that follows), and its median gap."""
    arrivals: list[float] = []

    async def stream() -> None:
        request = GenerationRequest(request_id=f"bg{n}", model="bench",
                                    prompt=TokenPrompt((1, 2, 3, 4)),
                                    sampling=SamplingParams(temperature=0.0, max_tokens=600))
        async for _ in rep.stream(request):
            arrivals.append(time.perf_counter())

    background = asyncio.ensure_future(stream())
    while len(arrivals) < 30:
        await asyncio.sleep(0.01)
    hit = GenerationRequest(request_id=f"hit{n}", model="bench", prompt=TokenPrompt(prompt),
                            sampling=SamplingParams(temperature=0.0, max_tokens=1))
    before = len(spans)
    async for _ in rep.stream(hit):
        pass
    background.cancel()
    assert len(spans) == before + 1, "the entry was not read from disk"
    started, ended = spans[-1]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= started and a <= ended]
    return max(during, default=ended - started), statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    at_least_three(args.rounds, "--rounds")
    directory = Path(tempfile.mkdtemp(prefix="disk-hit-"))
    try:
        run(args.tokens, args.rounds, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # gigabytes of entries


def run(tokens: int, rounds: int, directory: Path) -> None:
    first = replica(directory)
    assert first.model is not None
    fingerprint = kv_fingerprint(first.options, first.model)
    vocab = first.model.vocab_size
    first.shutdown()
    tier = DiskTier(directory, 1 << 40, fingerprint)
    prompts: dict[str, list[tuple[int, ...]]] = {"worker": [], "engine": []}
    for way, prompts_of in prompts.items():
        for r in range(rounds):
            ids = [random.randrange(5, vocab) for _ in range(tokens)]
            tier.put(ids, entry(tokens), wait_s=600)
            prompts_of.append((*ids, 7))
    assert tier.flush(600)
    print(f"{2 * rounds} entries of {tokens} tokens, {tier.nbytes / 2**20:.0f} MiB "
          f"on disk", flush=True)
    rep = replica(directory)
    results: dict[str, list[tuple[float, float]]] = {}
    try:
        worker = rep._prefixes._disk_reads
        assert worker is not None
        spans = timed_reads(rep)
        for way, prompts_of in prompts.items():
            if way == "engine":
                worker.before = on_engine_thread(rep)  # type: ignore[method-assign]
            results[way] = [asyncio.run(one_read(rep, p, i, spans))
                            for i, p in enumerate(prompts_of)]
    finally:
        rep.shutdown()
    for way, runs in results.items():
        longest = statistics.median(r[0] for r in runs)
        typical = statistics.median(r[1] for r in runs)
        print(f"read on the {way + ' thread':<14} longest gap {longest * 1000:8.1f} ms "
              f"(runs {', '.join(f'{r[0] * 1000:.0f}' for r in runs)}), "
              f"median gap {typical * 1000:.1f} ms")
    ratio = statistics.median(r[0] for r in results["engine"]) / \
        statistics.median(r[0] for r in results["worker"])
    print(f"longest gap, engine thread / worker: {ratio:.2f}x")


if __name__ == "__main__":
    main()
