"""TTFT of a turn whose history is in the prefix cache's memory tier, on its disk tier (a
restarted replica), or nowhere, in-process on one model.

    python load/bench_kv_tiers.py [--source builtin:tiny] [--tokens 8192 30000] [--runs 3]

Each run salts a history of about `--tokens` tokens (so no run reuses another's KV) and
sends it as a chat with `max_tokens` 1 to a `ModelReplica` (no Ray, no HTTP) whose disk tier
is a fresh directory: first cold (nowhere: the whole prompt is prefilled), then again
(memory), then to a second replica started on the same directory after the first shut down
and wrote its cache there (disk). TTFT is from the request to its first event. Prints each
tier's median TTFT with its range, the cached tokens each tier served, and the ratio of
cold to each tier, the median of the runs' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script

from replicas.contract import (  # noqa: E402
    ChatMessage,
    ChatPrompt,
    Finished,
    GenerationRequest,
    SamplingParams,
)
from replicas.engine.config import EngineConfig  # noqa: E402
from replicas.replica import ModelReplica, ReplicaOptions  # noqa: E402

WORDS = ("the river runs past the old mill where children play in summer and the "
         "lighthouse keeper writes letters about storms ships and the quiet sea").split()
TIERS = ("nowhere", "memory", "disk")


def history(tokens: int, rng: random.Random) -> str:
    # The built-in tokenizer spends about 2.7 tokens on each of these words with a space.
    words = tokens * 10 // 27
    return f"Session {rng.random()}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def replica(source: str, directory: Path) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="m", source=source, engine=EngineConfig(
        disk_cache_dir=str(directory), prompt_cache_bytes=8 * 1024**3)))
    rep.start()
    return rep


def turn(rep: ModelReplica, text: str) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens) of one greedy one-token turn."""
    request = GenerationRequest(f"r{time.monotonic_ns()}", "m", ChatPrompt((
        ChatMessage("system", text), ChatMessage("user", "And then?"))),
        SamplingParams(max_tokens=1, temperature=0.0))

    async def run() -> tuple[float, int, int]:
        start = time.perf_counter()
        first = 0.0
        events = []
        async for batch in rep.stream(request):
            first = first or time.perf_counter() - start
            events += batch
        finished = events[-1]
        assert isinstance(finished, Finished), f"the turn failed: {finished}"
        return first, finished.usage.prompt_tokens, finished.usage.cached_tokens

    return asyncio.run(run())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", default="builtin:tiny")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 30000],
                        help="history lengths, about (the built-in tokenizer's count)")
    parser.add_argument("--runs", type=int, default=3)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.runs < 3:
        raise SystemExit("--runs must be at least 3: a median of fewer is one run")
    rng = random.Random(1234)
    print(f"model {args.source}, {args.runs} runs per history length, max_tokens 1, "
          "in-process; TTFT medians (min-max)")
    print(f"{'tokens':>7}" + "".join(f"{t + ' TTFT ms':>24}" for t in TIERS)
          + f"{'cached mem/disk':>18}{'nowhere/memory':>16}{'nowhere/disk':>14}")
    for tokens in args.tokens:
        ttft: dict[str, list[float]] = {t: [] for t in TIERS}
        cached: dict[str, list[int]] = {t: [] for t in TIERS}
        prompts = []
        for _ in range(args.runs):
            text = history(tokens, rng)
            with tempfile.TemporaryDirectory() as directory:
                first = replica(args.source, Path(directory))
                try:
                    for tier in ("nowhere", "memory"):
                        seconds, prompt, hit = turn(first, text)
                        ttft[tier].append(seconds)
                        cached[tier].append(hit)
                finally:
                    first.shutdown()  # the memory tier goes to disk
                second = replica(args.source, Path(directory))
                try:
                    seconds, prompt, hit = turn(second, text)
                    ttft["disk"].append(seconds)
                    cached["disk"].append(hit)
                finally:
                    second.shutdown()
            prompts.append(prompt)

        def spread(values: list[float]) -> str:
            ms = [v * 1000 for v in values]
            return f"{statistics.median(ms):.0f} ({min(ms):.0f}-{max(ms):.0f})"

        ratios = {t: statistics.median(n / v for n, v in zip(ttft["nowhere"], ttft[t]))
                  for t in ("memory", "disk")}
        print(f"{statistics.median(prompts):>7.0f}"
              + "".join(f"{spread(ttft[t]):>24}" for t in TIERS)
              + f"{statistics.median(cached['memory']):>9.0f}/{statistics.median(cached['disk']):<8.0f}"
              + f"{ratios['memory']:>16.1f}{ratios['disk']:>14.1f}")


if __name__ == "__main__":
    main()
