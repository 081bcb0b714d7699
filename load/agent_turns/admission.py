"""`python -m load.agent_turns.bench --admission` and `--sessions-8k`: KV memory admission
(issue 25) on one in-process replica (no Ray, no HTTP, nothing on the network), with the
harness's replica helpers (`load.harness.replica`), as `--preemption` does.

`--admission`: the agent-turn workload (`load.agent_turns.workload`) with `--memory-budget`
bytes of KV and then with the default budget (75% of the machine less the weights, which
these runs never reach: admission never holds a request back, so it is "off"). Prints
turns per second, median TTFT and how many turns waited for memory.

`--sessions-8k`: sessions of `--session-tokens` prompt tokens (8192) and `--session-output`
new tokens (128) each, all at once, doubling from `--sessions-start` until one fails (the
overloaded error past `--max-waiting`, or anything else), `--max-sessions` or
`--time-limit-s` (a level cut short by the limit is not a failure; the run stops there).
Prints each level and the largest that finished without a failure, with
how many ran at once (the rest waited for memory). Prompts are random token ids, so the
prefix cache shares nothing between sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter

from load.agent_turns.workload import conversations
from load.harness.replica import MIB, budget_replica, random_session, watched
from replicas.contract import Failed, Finished, GenerationRequest
from replicas.replica import ModelReplica


def admission(args: argparse.Namespace) -> int:
    if args.memory_budget is None:
        raise SystemExit("--admission needs --memory-budget BYTES")
    for label, budget in ((f"on, {args.memory_budget / MIB:.1f} MiB", args.memory_budget),
                          ("off, default budget", None)):
        rep = budget_replica(args, budget)
        try:
            asyncio.run(conversations(rep, argparse.Namespace(**{**vars(args), "turns": 1}),
                                      f"warmup-{label}"))
            walls, ttfts, turns = [], [], 0
            peaks: Counter[str] = Counter()
            for i in range(args.runs):
                started = time.perf_counter()
                run = asyncio.run(watched(rep, conversations(rep, args, f"{label}-{i}"), peaks))
                walls.append(time.perf_counter() - started)
                done = [turn for per_turn in run.turns for turn in per_turn]
                turns += len(done)
                ttfts += [turn.ttft_s for turn in done]
            memory = rep.stats().memory
            assert memory is not None
            print(f"admission {label}: {turns} turns in {sum(walls):.1f}s = "
                  f"{turns / sum(walls):.2f} turns/s; median TTFT "
                  f"{statistics.median(ttfts) * 1000:.0f} ms; budget "
                  f"{memory.budget_bytes / MIB:.0f} MiB, peak projected "
                  f"{peaks['projected'] / MIB:.1f} MiB, peak running {peaks['active']}, "
                  f"peak waiting for memory {peaks['waiting']}, refused {memory.refused}",
                  flush=True)
        finally:
            rep.shutdown()
    return 0


async def _level(rep: ModelReplica, n: int, args: argparse.Namespace,
                 timeout_s: float) -> tuple[Counter[str], Counter[str]]:
    async def one(request: GenerationRequest) -> str:
        end = None
        async for batch in rep.stream(request):
            end = batch[-1] if batch else end
        if isinstance(end, Finished):
            return "finished"
        return f"failed:{end.kind.value}" if isinstance(end, Failed) else "no end"

    peaks: Counter[str] = Counter()
    work = asyncio.gather(*(one(random_session(i, n, args)) for i in range(n)))
    try:
        ends = await asyncio.wait_for(watched(rep, work, peaks), timeout_s)
    except asyncio.TimeoutError:
        return Counter({"timed out": n}), peaks
    return Counter(ends), peaks


def sessions(args: argparse.Namespace) -> int:
    rep = budget_replica(args, args.memory_budget)
    deadline = time.monotonic() + args.time_limit_s
    held, first_failure = 0, None
    try:
        layout = rep._engine.kv_budget.layout  # noqa: SLF001 - the bench reports it
        budget = rep._engine.kv_budget.budget_bytes  # noqa: SLF001
        need = layout.bytes_for(args.session_tokens + args.session_output)
        print(f"{args.source}: {layout.describe()}; budget {budget / MIB:.0f} MiB: "
              f"{budget // need} sessions of {args.session_tokens}+{args.session_output} "
              f"tokens ({need / MIB:.1f} MiB each) fit at once, {args.max_waiting} may wait",
              flush=True)
        n = args.sessions_start
        while n <= args.max_sessions and time.monotonic() < deadline:
            started = time.perf_counter()
            ends, peaks = asyncio.run(_level(rep, n, args, deadline - time.monotonic()))
            print(f"{n:>4} sessions: {dict(ends)} in {time.perf_counter() - started:.1f}s; "
                  f"peak running {peaks['active']}, peak waiting for memory "
                  f"{peaks['waiting']}, peak projected {peaks['projected'] / MIB:.0f} MiB",
                  flush=True)
            if "timed out" in ends:  # the bench's time limit, not the replica's failure
                break
            if ends.get("finished", 0) != n:
                first_failure = n
                break
            held = n
            n *= 2
    finally:
        rep.shutdown()
    stop = (f"first failure at {first_failure}" if first_failure else
            f"no failure before the limit (--max-sessions {args.max_sessions}, "
            f"--time-limit-s {args.time_limit_s:.0f})")
    print(f"largest level without a failure: {held} concurrent {args.session_tokens}-token "
          f"sessions; {stop}")
    return 0
