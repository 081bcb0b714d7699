"""`load/agent_turns/bench.py --preemption`: KV reservation against preemption (issue 33) for
concurrent agent sessions on one in-process replica at a time (no Ray, no HTTP, nothing
on the network).

Each session is one request as a coding agent sends it: a `--session-tokens` prompt (8192)
of random token ids, seeded per session and run (ids 10..740 as `--sessions-8k` draws them,
so the prefix cache shares nothing between sessions), and Claude Code's `max_tokens`
(`--session-max-tokens`, 32000). `--sessions` of them (32) start at once on a replica with
`--memory-budget` bytes of KV, once with `kv_reservation="whole"` (each reserves prompt +
max_tokens up front and is never preempted: the behaviour before issue 33) and once with
`"grow"` (each reserves its prompt plus a cache step and grows; the youngest is preempted
when the batch would pass the budget, and resumes by prefill), alternating, `--runs` times
each. The same seeds give both modes the same prompts and turn lengths.

How a turn ends: a real agent turn stops after a few hundred tokens, but a test model
on random token ids ends wherever its weights take it, or never. So the end tokens are banned (`logit_bias` -100 on the
model's EOS ids: no session ends by itself), and the client stops reading after a
per-session length drawn uniformly from `--turn-output MIN MAX` (64 512, seeded) and
closes the stream. Closing the stream cancels the request in the engine, which frees its
KV and its reservation exactly as an end token would (the replica's `stream` cancels a
request whose reader leaves), so the model generates the turn and stops. The engine may
run a step or two past the length before the cancel lands; only the tokens up to the
length are counted.

Every run gets its own replica, started and warmed (one 256-token session) just before
it, so each starts from the same state and none sits idle while the other mode runs: the
engine's stuck-step check counts an idle spell into the first step after it, so a replica
idle for over `stuck_after_s` (120 s) fails the submits that arrive during that step
("engine step stuck"; load/RESULTS.md, issue 33's section).

The prefix cache is off (`--preemption-cache-bytes`, 0): a preempted session resumes by
prefilling its prompt and everything it generated (vLLM's recompute preemption), and
"whole" gets nothing from a cache either, since no two prompts share a prefix.

Prints each run, then per mode the medians over runs with their spread (min-max): sessions
held at once (peak running, and the mean over the run), output tokens/s (tokens read up to
each session's length) and sessions completed per second, preemptions per minute, median
TTFT, peak projected KV against the budget and any failures (a `Failed` event, a session
that ended by itself, one cut by `--time-limit-s`); and the grow/whole ratios of
throughput and of sessions held, paired run by run.

The budget (`--memory-budget`, default 128 MiB: four 32768-token whole reservations of
`builtin:tiny`, 1 KiB of KV per token) must hold one whole session: otherwise preparation
would lower `max_tokens` to what the budget holds and "whole" would not reserve what it
does in service; the bench refuses to run then. The model's context still caps
`max_tokens` (tiny's 32768 lowers 32000 to 24576 for an 8192-token prompt), and the bench
says so. On a CPU-only box an 8192-token prefill takes tens of seconds, so the defaults run
for far longer than `--time-limit-s`; load/RESULTS.md records a run scaled to a quarter
(2048-token prompts, max_tokens 8000, 40 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from contextlib import aclosing
from dataclasses import dataclass, replace

from load.harness.replica import MIB, budget_replica, random_session, watched
from load.harness.stats import spread
from replicas.contract import Failed, Finished, GenerationRequest, TokenIds
from replicas.engine.kv.budget import round_up
from replicas.replica import ModelReplica

MODES = ("whole", "grow")
DEFAULT_BUDGET = 128 * MIB
_WARMUP_RUN = -1
_WARMUP_PROMPT = 256
_WARMUP_TOKENS = 16


@dataclass(frozen=True)
class Session:
    target: int  # output tokens the client reads before it closes the stream
    read: int  # tokens read, up to `target`
    ttft_s: float | None  # to the first token
    end: str  # "done", "failed:<kind>", "ended:<reason>" (by itself), "timed out", "no end"
    message: str = ""  # a failure's message


@dataclass(frozen=True)
class RunResult:
    mode: str
    wall_s: float
    sessions: list[Session]
    peaks: Counter[str]
    preempted: int
    refused: int

    @property
    def done(self) -> int:
        return sum(1 for s in self.sessions if s.end == "done")

    @property
    def tokens(self) -> int:
        return sum(s.read for s in self.sessions)

    @property
    def mean_running(self) -> float:
        return self.peaks["active_sum"] / max(1, self.peaks["samples"])

    @property
    def median_ttft_s(self) -> float:
        ttfts = [s.ttft_s for s in self.sessions if s.ttft_s is not None]
        return statistics.median(ttfts) if ttfts else float("nan")

    @property
    def failures(self) -> Counter[str]:
        return Counter(s.end for s in self.sessions if s.end != "done")

    @property
    def messages(self) -> Counter[str]:
        return Counter(s.message for s in self.sessions if s.message)


def turn_length(i: int, run: int, args: argparse.Namespace) -> int:
    low, high = args.turn_output
    return random.Random(f"turn-{run}-{i}").randint(low, high)


def _request(rep: ModelReplica, i: int, run: int, args: argparse.Namespace) -> GenerationRequest:
    """`random_session`'s prompt with the agent's max_tokens, the end tokens banned and token ids
    reported (the client counts tokens by them)."""
    base = random_session(i, run, args)
    ban = {token: -100.0 for token in rep.model.eos_token_ids}
    return replace(base, report_tokens=True,
                   sampling=replace(base.sampling, max_tokens=args.session_max_tokens,
                                    logit_bias=ban))


async def _one(rep: ModelReplica, request: GenerationRequest, target: int) -> Session:
    """Read up to `target` tokens, then close the stream (the replica cancels the request)."""
    started = time.perf_counter()
    ttft, read = None, 0
    end = "no end"
    try:
        async with aclosing(rep.stream(request)) as stream:
            async for batch in stream:
                for event in batch:
                    if isinstance(event, TokenIds):
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        read = min(target, read + len(event.ids))
                    elif isinstance(event, Failed):
                        return Session(target, read, ttft, f"failed:{event.kind.value}",
                                       event.message)
                    elif isinstance(event, Finished):
                        return Session(target, read, ttft, f"ended:{event.reason.value}")
                if read >= target:
                    end = "done"
                    break
    except asyncio.CancelledError:  # the bench's time limit: the stream is closed above
        return Session(target, read, ttft, "timed out")
    return Session(target, read, ttft, end)


async def _sessions(rep: ModelReplica, run: int, args: argparse.Namespace, count: int,
                    timeout_s: float, target: int | None = None) -> list[Session]:
    targets = [target or turn_length(i, run, args) for i in range(count)]
    tasks = [asyncio.create_task(_one(rep, _request(rep, i, run, args), n))
             for i, n in enumerate(targets)]
    await asyncio.wait(tasks, timeout=max(0.001, timeout_s))
    for task in tasks:
        task.cancel()  # only those still running: a finished task ignores it
    ends = await asyncio.gather(*tasks, return_exceptions=True)
    sessions = []
    for end, n in zip(ends, targets):
        if isinstance(end, asyncio.CancelledError):  # cancelled before `_one` started
            end = Session(n, 0, None, "timed out")
        if isinstance(end, BaseException):
            raise end
        sessions.append(end)
    return sessions


def _run(rep: ModelReplica, mode: str, run: int, args: argparse.Namespace,
         timeout_s: float) -> RunResult:
    before = rep.stats().memory
    peaks: Counter[str] = Counter()
    started = time.perf_counter()
    sessions = asyncio.run(watched(rep, _sessions(rep, run, args, args.sessions, timeout_s),
                                    peaks))
    wall = time.perf_counter() - started
    after = rep.stats().memory
    assert before is not None and after is not None
    return RunResult(mode, wall, sessions, peaks, after.preempted - before.preempted,
                     after.refused - before.refused)


def _check_budget(rep: ModelReplica, args: argparse.Namespace) -> str:
    """What one whole reservation holds; refuses a budget that would lower max_tokens."""
    kv = rep._engine.kv_budget  # noqa: SLF001 - the bench reports it
    asked = args.session_tokens + args.session_max_tokens
    reach = min(asked, rep.context_length)
    if kv.max_tokens < reach:
        raise SystemExit(
            f"--memory-budget {kv.budget_bytes} holds one sequence of at most {kv.max_tokens} "
            f"tokens, and a session reaches {reach}: preparation would lower max_tokens to "
            f"fit the budget. Give at least {kv.layout.bytes_for(reach)} bytes.")
    whole = round_up(reach)
    note = "" if reach == asked else (
        f" (max_tokens {args.session_max_tokens} is lowered to {reach - args.session_tokens} "
        f"by the model's {rep.context_length}-token context, not by the budget)")
    return (f"{args.source}: {kv.layout.describe()}; budget {kv.budget_bytes / MIB:.1f} MiB. "
            f"A session: {args.session_tokens} prompt tokens, max_tokens "
            f"{args.session_max_tokens}{note}, reads {args.turn_output[0]}-"
            f"{args.turn_output[1]} tokens. \"whole\" reserves {whole} tokens "
            f"({kv.layout.bytes_for(whole) / MIB:.1f} MiB): "
            f"{kv.budget_bytes // kv.layout.bytes_for(whole)} fit at once; \"grow\" reserves "
            f"{round_up(args.session_tokens + 1)} to start (the prompt and the next token, "
            f"rounded up to a cache step) and grows. {args.sessions} sessions, "
            f"prefix cache {args.preemption_cache_bytes} bytes.")


def _line(r: RunResult, run: int, budget: int) -> str:
    failures = dict(r.failures) or "none"
    return (f"{r.mode:>5} run {run + 1}: {r.done}/{len(r.sessions)} sessions, {r.tokens} tokens "
            f"in {r.wall_s:.1f}s; peak running {r.peaks['active']} (mean "
            f"{r.mean_running:.1f}), peak waiting {r.peaks['waiting']}, {r.preempted} "
            f"preempted, refused {r.refused}; median TTFT {r.median_ttft_s * 1000:.0f} ms; "
            f"peak projected {r.peaks['projected'] / MIB:.1f}/{budget / MIB:.1f} MiB; "
            f"failures {failures}" + "".join(f"\n    {n} x {message!r}"
                                               for message, n in r.messages.items()))


def _table(results: dict[str, list[RunResult]], budget: int) -> None:
    print(f"\nmedians over runs (min-max); budget {budget / MIB:.1f} MiB")
    print(f"{'mode':>5} {'runs':>4} {'held (peak)':>14} {'held (mean)':>16} {'out tok/s':>18} "
          f"{'sessions/s':>20} {'preempt/min':>16} {'TTFT p50 ms':>20} "
          f"{'peak projected MiB':>20}  failures")
    for mode in MODES:
        runs = results[mode]
        if not runs:
            continue
        failures = sum((r.failures for r in runs), Counter())
        print(f"{mode:>5} {len(runs):>4} "
              f"{spread([float(r.peaks['active']) for r in runs]).text('.0f'):>14} "
              f"{spread([r.mean_running for r in runs]).text('.1f'):>16} "
              f"{spread([r.tokens / r.wall_s for r in runs]).text('.1f'):>18} "
              f"{spread([r.done / r.wall_s for r in runs]).text('.3f'):>20} "
              f"{spread([r.preempted / r.wall_s * 60 for r in runs]).text('.1f'):>16} "
              f"{spread([r.median_ttft_s * 1000 for r in runs]).text('.0f'):>20} "
              f"{spread([r.peaks['projected'] / MIB for r in runs]).text('.1f'):>20}  "
              f"{dict(failures) or 'none'}")
    pairs = list(zip(results["whole"], results["grow"]))
    if pairs:
        tokens = [g.tokens / g.wall_s / (w.tokens / w.wall_s) for w, g in pairs]
        done = [(g.done / g.wall_s) / (w.done / w.wall_s) if w.done else float("nan")
                for w, g in pairs]
        held = [g.peaks["active"] / w.peaks["active"] for w, g in pairs]
        mean = [g.mean_running / w.mean_running for w, g in pairs]
        print(f"grow/whole, paired by run ({len(pairs)} pairs): output tokens/s "
              f"{spread(tokens).text('.2f')}, sessions/s {spread(done).text('.2f')}, sessions held "
              f"(peak) {spread(held).text('.2f')}, (mean) {spread(mean).text('.2f')}")


def _fresh_run(mode: str, run: int, args: argparse.Namespace, budget: int,
               deadline: float) -> RunResult | None:
    """One run on a replica started for it and warmed with one short session; None when
    the time limit leaves no time for it."""
    rep = budget_replica(args, budget, kv_reservation=mode,
                   prompt_cache_bytes=args.preemption_cache_bytes)
    try:
        if run == 0 and mode == MODES[0]:
            print(_check_budget(rep, args), flush=True)
        warm_args = argparse.Namespace(**{**vars(args), "session_tokens": _WARMUP_PROMPT})
        warm = asyncio.run(_sessions(rep, _WARMUP_RUN, warm_args, 1,
                                     deadline - time.monotonic(), _WARMUP_TOKENS))
        if warm[0].end != "done":
            print(f"{mode} warmup: {warm[0].end} {warm[0].message}", flush=True)
        left = deadline - time.monotonic()
        return _run(rep, mode, run, args, left) if left > 0 else None
    finally:
        rep.shutdown()


def preemption(args: argparse.Namespace) -> int:
    budget = args.memory_budget if args.memory_budget is not None else DEFAULT_BUDGET
    deadline = time.monotonic() + args.time_limit_s
    results: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    for run in range(args.runs):
        for mode in MODES:  # alternating, so both modes see the box's load alike
            result = _fresh_run(mode, run, args, budget, deadline)
            if result is None:
                break
            results[mode].append(result)
            print(_line(result, run, budget), flush=True)
        if deadline <= time.monotonic():
            print(f"--time-limit-s {args.time_limit_s:.0f} reached in round {run + 1} of "
                  f"{args.runs}", flush=True)
            break
    _table(results, budget)
    return 0
