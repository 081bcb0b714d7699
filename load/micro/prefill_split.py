"""What one long prefill does to the streams decoding beside it, on one Mac (`role: both`)
and with a prefill replica on another (`role: decode` + `role: prefill`, issue 35).

    python -m load.micro.prefill_split [--source builtin:bench] [--streams 4]
                                       [--prompt-tokens 1024] [--max-tokens 600] [--runs 3]

Two "Macs" on this machine: two Ray actors (a private local Ray on 127.0.0.1), each pinned
to a CPU core of its own, each a `ModelReplica`. In each run the decode replica streams
`--streams` greedy requests of `--max-tokens`; once every stream has produced tokens, a
request with a history of about `--prompt-tokens` arrives on it:

- `both`: the decode replica prefills it itself, between its decode steps;
- `split`: it hands the prompt to the prefill replica (the other core), which prefills it
  and returns its KV (`ModelReplica.prefill_prefix`, `replicas.kv_pull`), and decodes.

Prints, per mode, the medians over runs (min-max) of: the longest gap between two event
batches of any decoding stream while the long prompt waited for its first token (the
stall a user watching a stream sees), the decoding streams' tokens per second over that
window, and the long prompt's TTFT. `builtin:bench` has random weights: only the timings
mean something.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import ray

from load.harness.prompts import history
from load.harness.remote import chat
from load.harness.stats import at_least_three, spread
from replicas.contract import ChatMessage, ChatPrompt, GenerationRequest, \
    SamplingParams, TokenIds
from replicas.engine.config import EngineConfig
from replicas.engine.kv.transfer import PrefixKV
from replicas.kv_pull import Source
from replicas.replica import ModelReplica, ReplicaOptions

MODES = ("both", "split")


def pin(core: int) -> None:
    """Every thread of this process onto `core` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})


def replica(source: str) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="m", source=source, engine=EngineConfig(
        prompt_cache_bytes=1 << 30)))
    rep.start()
    return rep


@ray.remote(num_cpus=0)
class PrefillMac:
    def __init__(self, source: str, core: int) -> None:
        pin(core)
        self.rep = replica(source)

    async def prefill_prefix(self, tokens: tuple[int, ...]) -> PrefixKV | None:
        return await self.rep.prefill_prefix(tokens)

    def shutdown(self) -> None:
        self.rep.shutdown()


@ray.remote(num_cpus=0)
class DecodeMac:
    def __init__(self, source: str, core: int) -> None:
        pin(core)
        self.rep = replica(source)

    async def run(self, long_text: str, streams: int, max_tokens: int,
                  prefill: Any) -> tuple[float, float, float]:
        """(longest stream gap, stream tokens/s, long TTFT) in seconds while the long
        prompt waited for its first token; `prefill`: a PrefillMac, or None."""
        seen: list[list[tuple[float, int]]] = [[] for _ in range(streams)]

        async def decode(i: int) -> None:
            request = GenerationRequest(f"s{i}-{time.monotonic_ns()}", "m", ChatPrompt((
                ChatMessage("user", f"Stream {i}: tell me a long story."),)),
                SamplingParams(max_tokens=max_tokens, temperature=0.0), report_tokens=True)
            async for batch in self.rep.stream(request):
                seen[i].append((time.perf_counter(), sum(len(e.ids) for e in batch
                                                         if isinstance(e, TokenIds))))

        tasks = [asyncio.create_task(decode(i)) for i in range(streams)]
        while not all(len(s) >= 3 for s in seen):
            await asyncio.sleep(0.05)
        source = None
        if prefill is not None:
            async def fetch(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
                answer: PrefixKV | None = await prefill.prefill_prefix.remote(tokens)
                return answer
            source = Source(fetch, 512, estimate=False, kind="prefill")
        start = time.perf_counter()
        first = 0.0
        async for _ in self.rep.stream(chat(long_text), source):
            first = time.perf_counter()
            break
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gaps, tokens = [], 0
        for stream in seen:
            times = [start] + [t for t, _ in stream if start <= t <= first] + [first]
            gaps.append(max(b - a for a, b in zip(times, times[1:])))
            tokens += sum(n for t, n in stream if start <= t <= first)
        return max(gaps), tokens / (first - start), first - start

    def pulls(self) -> dict[str, Any]:
        return self.rep.pull_totals()

    def shutdown(self) -> None:
        self.rep.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", default="builtin:bench")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--runs", type=int, default=3)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    at_least_three(args.runs, "--runs")
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two CPU cores: one per emulated Mac")
    root = str(Path(__file__).resolve().parents[2])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    rng = random.Random(99)
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    try:
        decode = DecodeMac.remote(args.source, 0)  # type: ignore[attr-defined]
        prefill = PrefillMac.remote(args.source, 1)  # type: ignore[attr-defined]
        for r in range(args.runs):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                text = history(args.prompt_tokens, rng)  # salted: nothing cached
                results[mode].append(ray.get(decode.run.remote(
                    text, args.streams, args.max_tokens, prefill if mode == "split" else None)))
                gap, rate, ttft = results[mode][-1]
                print(f"  run {r + 1} {mode:<6} longest stream gap {gap * 1000:8.0f} ms, "
                      f"streams {rate:6.1f} tok/s, long TTFT {ttft * 1000:8.0f} ms", flush=True)
        pulls = ray.get(decode.pulls.remote())
        ray.get([decode.shutdown.remote(), prefill.shutdown.remote()])
    finally:
        ray.shutdown()

    print(f"\nmodel {args.source}, {args.streams} streams of {args.max_tokens} tokens decoding "
          f"on one core; a ~{args.prompt_tokens}-token prompt arrives; {args.runs} runs; "
          "medians (min-max)")
    print(f"{'mode':<7}{'longest stream gap ms':>26}{'streams tok/s':>22}{'long TTFT ms':>24}")
    for mode in MODES:
        gap, rate, ttft = zip(*results[mode])
        print(f"{mode:<7}{spread(list(gap)).text('.0f', 1000):>26}{spread(list(rate)).text('.0f'):>22}"
              f"{spread(list(ttft)).text('.0f', 1000):>24}")
    print(f"decode replica's hand-offs: {pulls.get('outcomes')}")


if __name__ == "__main__":
    main()
