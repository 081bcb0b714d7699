"""Agent turns with the replica's prefix cache on and off, in-process on `builtin:bench`.

    python -m load.agent_turns.bench [--conversations 4] [--turns 4] [--system-words 500]
                                     [--turn-words 50] [--max-tokens 8] [--runs 3]
                                     [--source builtin:bench] [--suite [--no-mlx]]
                                     [--memory [--memory-turns 200] [--margin-mib 384]]
                                     [--admission --memory-budget BYTES] [--sessions-8k]
                                     [--preemption [--sessions 32] [--memory-budget BYTES]
                                      [--turn-output 64 512] [--time-limit-s 900]]
                                     [--tiers [--tokens 8192 30000]]

N conversations run at once, T turns each, as an agent loop does: every turn resends a
long system prompt plus the whole conversation so far (each earlier reply and a new user
message of a few hundred tokens). A `ModelReplica` (no Ray, no HTTP) serves them with the
cache off and then on; each run salts its system prompt, so every run starts cold. Prints,
per turn index, the median TTFT over conversations and runs with the cache off and on, the
ratio and its spread over runs, then prompt and cached tokens and the hit rate. The bench
model has random weights: replies are gibberish, only the timings mean something. (Its
bfloat16 is slow on a CPU-only Linux box; `--source builtin:tiny` there.) The built-in
tokenizer spends about six tokens on each of these words.

`--suite` runs the same conversations over HTTP against several servers in one run
(`load/agent_turns/over_http.py`): Orchard with the cache off and on, 2 replicas with cache-aware
routing on and off, and `mlx_lm.server`. `--memory` runs many turns on one replica with a
small `--cache-bytes` and checks its resident memory (`load/agent_turns/memory.py`).
`--admission` compares agent-turn throughput with KV admission at `--memory-budget` and
at the default budget; `--sessions-8k` ramps concurrent 8k-token sessions on one replica
until the first failure (`load/agent_turns/admission.py`, issue 25). `--preemption` runs
`--sessions` concurrent agent sessions (8192-token prompts, Claude Code's 32000
`max_tokens`, each read for 64-512 tokens and then closed) on one replica with a fixed
`--memory-budget`, reserving prompt + max_tokens up front ("whole") against growing and
preempting ("grow"): sessions held, throughput, preemptions per minute, TTFT
(`load/agent_turns/preemption.py`, issue 33). `--tiers` times one turn whose `--tokens`
history is in memory, on disk, on another replica, or nowhere (`load/agent_turns/kv_tiers.py`,
issue 35).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from load.agent_turns.workload import TurnLog, conversations, median_ttft
from load.harness.stats import spread
from replicas.engine.config import EngineConfig
from replicas.replica import ModelReplica, ReplicaOptions


def bench(cache_bytes: int, args: argparse.Namespace) -> list[TurnLog]:
    rep = ModelReplica(ReplicaOptions(model_id="bench", source=args.source,
                                      engine=EngineConfig(prompt_cache_bytes=cache_bytes)))
    rep.start()
    try:
        asyncio.run(conversations(rep, argparse.Namespace(**{**vars(args), "turns": 1}),
                                  "warmup"))
        runs = [asyncio.run(conversations(rep, args, f"{cache_bytes}-{i}"))
                for i in range(args.runs)]
        stats = rep.stats()
        print(f"cache {'on' if cache_bytes else 'off'}: hits {stats.cache_hits}, misses "
              f"{stats.cache_misses}, evictions {stats.cache_evictions}, "
              f"{stats.cache_entries} entries, {stats.cache_bytes / 2**20:.1f} MiB", flush=True)
        return runs
    finally:
        rep.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=500)
    parser.add_argument("--turn-words", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--source", default=None,
                        help="model (default: builtin:bench; builtin:tiny for --preemption)")
    parser.add_argument("--cache-bytes", type=int, default=EngineConfig().prompt_cache_bytes)
    parser.add_argument("--suite", action="store_true", help="over HTTP: Orchard cache off/on, "
                        "1 and 2 replicas, routing on/off, and mlx_lm.server (over_http)")
    parser.add_argument("--no-mlx", action="store_true", help="--suite without mlx_lm.server")
    parser.add_argument("--memory", action="store_true", help="many turns on one replica, "
                        "checking its resident memory (memory)")
    parser.add_argument("--memory-turns", type=int, default=200)
    parser.add_argument("--margin-mib", type=int, default=384)
    parser.add_argument("--admission", action="store_true", help="agent-turn throughput with "
                        "KV admission at --memory-budget and at the default budget")
    parser.add_argument("--sessions-8k", action="store_true", help="double concurrent "
                        "long sessions on one replica until one fails (admission)")
    parser.add_argument("--memory-budget", type=int, default=None,
                        help="KV bytes (memory.budget_bytes); unset: the default budget")
    parser.add_argument("--max-waiting", type=int, default=EngineConfig().max_memory_waiting,
                        help="requests that may wait for KV memory (memory.max_waiting)")
    parser.add_argument("--session-tokens", type=int, default=8192)
    parser.add_argument("--session-output", type=int, default=128)
    parser.add_argument("--sessions-start", type=int, default=1)
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="bounds the whole run (default: 300 for --sessions-8k, 900 for "
                        "--preemption)")
    parser.add_argument("--preemption", action="store_true", help="concurrent agent sessions "
                        "under a fixed --memory-budget (default 128 MiB), kv_reservation whole "
                        "vs grow (preemption)")
    parser.add_argument("--sessions", type=int, default=32,
                        help="--preemption: sessions started at once")
    parser.add_argument("--session-max-tokens", type=int, default=32000,
                        help="--preemption: each session's max_tokens (Claude Code's 32000)")
    parser.add_argument("--turn-output", type=int, nargs=2, default=(64, 512),
                        metavar=("MIN", "MAX"), help="--preemption: a session stops reading "
                        "after a length drawn uniformly from MIN..MAX (seeded)")
    parser.add_argument("--preemption-cache-bytes", type=int, default=0,
                        help="--preemption: prompt_cache_bytes (0: resumes recompute)")
    parser.add_argument("--tiers", action="store_true", help="TTFT of a turn whose history "
                        "is in memory, on disk, on another replica or nowhere (bench_kv_tiers)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 30000],
                        help="--tiers: history lengths, about")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.source is None:
        args.source = "builtin:tiny" if args.preemption else "builtin:bench"
    if args.time_limit_s is None:
        args.time_limit_s = 900.0 if args.preemption else 300.0
    if args.tiers:
        from load.agent_turns.kv_tiers import run_tiers

        run_tiers(args.source, args.tokens, args.runs)
        return
    if args.preemption:
        from load.agent_turns.preemption import preemption

        sys.exit(preemption(args))
    if args.memory:
        from load.agent_turns.memory import memory

        sys.exit(memory(args))
    if args.admission or args.sessions_8k:
        from load.agent_turns.admission import admission, sessions

        sys.exit(admission(args) if args.admission else sessions(args))
    if args.suite:
        from load.agent_turns.over_http import suite

        suite(args)
        return
    started = time.perf_counter()
    off = bench(0, args)
    on = bench(args.cache_bytes, args)
    print(f"\n{args.source}: {args.conversations} conversations x {args.turns} turns, {args.runs} runs each; "
          "TTFT medians over conversations, then over runs (min-max of the run medians)")
    print(f"{'turn':>4} {'prompt tok':>10} {'cached tok':>10} {'off ms':>16} {'on ms':>16} "
          f"{'on/off':>16}")
    for t in range(args.turns):
        offs = [median_ttft(r, t) * 1000 for r in off]
        ons = [median_ttft(r, t) * 1000 for r in on]
        ratios = [a / b for a, b in zip(ons, offs)]
        prompt = statistics.median(turn.prompt_tokens for r in on for turn in r.turns[t])
        cached = statistics.median(turn.cached_tokens for r in on for turn in r.turns[t])
        print(f"{t + 1:>4} {prompt:>10.0f} {cached:>10.0f} {spread(offs).text('.0f'):>16} "
              f"{spread(ons).text('.0f'):>16} {spread(ratios).text('.2f'):>16}")
    turns = [turn for r in on for turns in r.turns for turn in turns]
    prompt_total = sum(t.prompt_tokens for t in turns)
    cached_total = sum(t.cached_tokens for t in turns)
    hits = sum(1 for t in turns if t.cached_tokens > 0)
    print(f"cache on: {hits}/{len(turns)} requests hit, {cached_total}/{prompt_total} prompt "
          f"tokens from the cache ({cached_total / prompt_total:.0%}); "
          f"wall {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
