"""`load/agent_turns/bench.py --memory`: a bounded run of many agent turns on one in-process
replica, checking that its memory stays within the model, the prompt cache's bound
(`--cache-bytes`) and a stated margin.

The turns run as N conversations at once (`--conversations`), each of `--memory-turns / N`
turns, with a cache bound small enough that eviction runs long before the end. After every
turn the process's resident memory (this process is the replica) and MLX's own counters
(active, cached buffers) are sampled. The margin covers what is neither model nor cache:
the batch's live KV (every conversation's whole prompt at once), the runtime (Python, the
tokenizer, the pipeline) and the allocator's kept buffers, measured as the resident memory
after the model loaded and one warm-up turn ran.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from load.agent_turns.workload import one_turn, text
from replicas.contract import ChatMessage
from replicas.engine.config import EngineConfig
from replicas.replica import ModelReplica, ReplicaOptions

MIB = 2**20


def rss_bytes() -> int:
    """Resident memory now (Linux), else the peak so far (macOS reports no current value)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS


async def drive(rep: ModelReplica, args: argparse.Namespace,
                samples: list[tuple[int, int, int]]) -> int:
    rng = random.Random("memory")
    system = ChatMessage("system", "You are a coding agent. " + text(rng, args.system_words))
    history = [[system] for _ in range(args.conversations)]
    turns = 0
    per_conversation = -(-args.memory_turns // args.conversations)
    for t in range(per_conversation):
        for conv in history:
            conv.append(ChatMessage("user", text(rng, args.turn_words)))
        results = await asyncio.gather(*(
            one_turn(rep, f"mem-{c}-{t}", tuple(conv), args.max_tokens)
            for c, conv in enumerate(history)))
        for conv, (_, reply) in zip(history, results):
            conv.append(ChatMessage("assistant", reply))
        turns += len(results)
        samples.append((rss_bytes(), mx.get_active_memory(), mx.get_cache_memory()))
        if t % 5 == 4:
            s = rep.stats()
            print(f"  {turns} turns: rss {samples[-1][0] / MIB:.0f} MiB, cache "
                  f"{s.cache_bytes / MIB:.1f} MiB in {s.cache_entries} entries, "
                  f"{s.cache_evictions} evictions", flush=True)
    return turns


def memory(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    base = rss_bytes()
    rep = ModelReplica(ReplicaOptions(model_id="bench", source=args.source,
                                      engine=EngineConfig(prompt_cache_bytes=args.cache_bytes)))
    rep.start()
    try:
        loaded = rep._model  # noqa: SLF001 - the bench reads the model's size
        assert loaded is not None
        model_bytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
        warm = argparse.Namespace(**{**vars(args), "memory_turns": args.conversations})
        asyncio.run(drive(rep, warm, []))
        after_warmup = rss_bytes()
        samples: list[tuple[int, int, int]] = []
        turns = asyncio.run(drive(rep, args, samples))
        stats = rep.stats()
    finally:
        rep.shutdown()
    peak = max(s[0] for s in samples)
    margin = args.margin_mib * MIB
    runtime = max(0, after_warmup - base - model_bytes)  # process, runtime, first batch
    bound = base + model_bytes + args.cache_bytes + runtime + margin
    print(f"\n{args.source}: {turns} turns ({args.conversations} conversations at once), "
          f"cache bound {args.cache_bytes / MIB:.0f} MiB, wall {time.perf_counter() - started:.0f}s")
    print(f"model {model_bytes / MIB:.1f} MiB; rss before load {base / MIB:.0f} MiB, after "
          f"warm-up {after_warmup / MIB:.0f} MiB (runtime + first batch {runtime / MIB:.0f} MiB)")
    print(f"rss during the run: first {samples[0][0] / MIB:.0f}, peak {peak / MIB:.0f}, last "
          f"{samples[-1][0] / MIB:.0f} MiB; MLX active peak "
          f"{max(s[1] for s in samples) / MIB:.0f} MiB, MLX buffer cache peak "
          f"{max(s[2] for s in samples) / MIB:.0f} MiB")
    print(f"prompt cache: {stats.cache_hits} hits, {stats.cache_misses} misses, "
          f"{stats.cache_evictions} evictions, {stats.cache_bytes / MIB:.1f} MiB held at the end")
    ok = peak <= bound
    print(f"{'PASS' if ok else 'FAIL'}: peak rss {peak / MIB:.0f} MiB "
          f"{'<=' if ok else '>'} before-load + model + cache bound + runtime + margin "
          f"({args.margin_mib} MiB) = {bound / MIB:.0f} MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit("run it as: python -m load.agent_turns.bench --memory")
