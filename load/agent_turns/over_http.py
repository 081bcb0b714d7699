"""`load/agent_turns/bench.py --suite`: the agent-turns workload over HTTP, in one run, against
Orchard (`serve run`) with the prefix cache off and on, with 1 and 2 replicas and routing
on and off, and against `mlx_lm.server` on the same model and conversations.

Every target gets the same conversations (the same salts), streamed chat completions at
temperature 0 with end-of-sequence suppressed (each reply is exactly `--max-tokens` long).
Only 127.0.0.1; each server is stopped before the next starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from load.agent_turns.workload import Turn, TurnLog, median_ttft, text
from load.harness.servers import (
    HOST,
    MAX_BATCH,
    ORCHARD_PORT,
    OUT,
    PREFILL_BATCH,
    Target,
    eos_bias,
    local_path,
    mlx_server,
    running,
)
from load.harness.serve_settings import serve_settings
from load.harness.stats import spread

TIMEOUT_S = 600


@dataclass(frozen=True)
class Setup:
    label: str
    replicas: int = 1
    cache_bytes: int | None = None  # None: the config's default
    routing: str = "auto"


ORCHARD_SETUPS = (
    Setup("orchard x1 cache off", cache_bytes=0),
    Setup("orchard x1"),
    Setup("orchard x2 routing on", replicas=2, routing="prefix"),
    Setup("orchard x2 routing off", replicas=2, routing="none"),
)
MLX = "mlx_lm.server"


def orchard_command(setup: Setup, source: str, workdir: Path) -> tuple[Target, list[str]]:
    model: dict[str, object] = {
        "id": "bench", "source": source, "num_replicas": setup.replicas,
        "max_ongoing_requests": 64, "routing": {"policy": setup.routing},
        "engine": {"max_batch_size": MAX_BATCH, "prefill_batch_size": PREFILL_BATCH}}
    if setup.cache_bytes is not None:
        model["prompt_cache"] = {"max_bytes": setup.cache_bytes}
    config = {**serve_settings(ORCHARD_PORT),
              "applications": [{"name": "orchard", "route_prefix": "/",
                                "import_path": "deployments.app:build_app",
                                "args": {"models": [model]}}]}
    path = workdir / f"{setup.label.replace(' ', '_')}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    serve = Path(sys.executable).with_name("serve")
    return Target(setup.label, f"http://{HOST}:{ORCHARD_PORT}", "bench"), [str(serve), "run",
                                                                         str(path)]


async def http_turn(client: httpx.AsyncClient, target: Target, messages: list[dict[str, str]],
                    max_tokens: int, bias: dict[str, float]) -> tuple[Turn, str]:
    body = {"model": target.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": bias}
    start = time.perf_counter()
    ttft, usage, pieces = None, None, []
    async with client.stream("POST", f"{target.base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{target.label}: HTTP {r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            data = line[len("data:"):].strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{target.label}: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning")):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                pieces.append(delta.get("content") or "")
    if usage is None:
        raise RuntimeError(f"{target.label}: a stream without usage")
    if ttft is None:  # the tokens decoded to no text: the whole stream stands in for TTFT
        ttft = time.perf_counter() - start
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Turn(ttft, int(usage["prompt_tokens"]), cached), "".join(pieces)


async def conversations(target: Target, args: argparse.Namespace, salt: str,
                        bias: dict[str, float]) -> TurnLog:
    """The in-process bench's workload, over HTTP: the same text for the same salt."""
    rng = random.Random(salt)
    system = f"[{salt}] You are a coding agent. " + text(rng, args.system_words)
    history = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
    run = TurnLog()
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        for _ in range(args.turns):
            for conv in history:
                conv.append({"role": "user", "content": text(rng, args.turn_words)})
            results = await asyncio.gather(*(
                http_turn(client, target, list(conv), args.max_tokens, bias) for conv in history))
            run.turns.append([turn for turn, _ in results])
            for conv, (_, reply) in zip(history, results):
                conv.append({"role": "assistant", "content": reply})
    return run


def bench_target(target: Target, command: list[str], args: argparse.Namespace,
                 bias: dict[str, float], log: Path) -> list[TurnLog]:
    with running(target, command, log):
        warm = argparse.Namespace(**{**vars(args), "turns": 1})
        asyncio.run(conversations(target, warm, "warmup", bias))
        runs = []
        for i in range(args.runs):
            runs.append(asyncio.run(conversations(target, args, f"run-{i}", bias)))
            print(f"  {target.label}: run {i + 1} done", flush=True)
        return runs


def reuse(runs: list[TurnLog]) -> tuple[float, float]:
    """Hit rate from turn 2 on, and the share of reusable prompt tokens (each turn's
    previous prompt in the same conversation) that came from the cache."""
    hits = total = cached = reusable = 0
    for run in runs:
        for t in range(1, len(run.turns)):
            for before, now in zip(run.turns[t - 1], run.turns[t]):
                total += 1
                hits += now.cached_tokens > 0
                cached += min(now.cached_tokens, before.prompt_tokens)
                reusable += before.prompt_tokens
    return hits / max(total, 1), cached / max(reusable, 1)


def report(results: dict[str, list[TurnLog]], args: argparse.Namespace) -> None:
    labels = list(results)
    print(f"\n{args.source}: {args.conversations} conversations x {args.turns} turns, "
          f"{args.runs} runs; TTFT ms: median over conversations, then over runs (min-max)")
    print("| turn | prompt tok | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for t in range(args.turns):
        prompt = statistics.median(x.prompt_tokens for r in results[labels[0]] for x in r.turns[t])
        cells = []
        for label in labels:
            ttfts = [median_ttft(r, t) * 1000 for r in results[label]]
            cached = statistics.median(x.cached_tokens for r in results[label] for x in r.turns[t])
            cells.append(f"{spread(ttfts).text('.0f')} [{cached:.0f}]")
        print(f"| {t + 1} | {prompt:.0f} | " + " | ".join(cells) + " |")
    print("(in brackets: median cached prompt tokens)\n")
    print("| target | hit rate (turn 2+) | reusable tokens from cache | TTFT turn 3+ / "
          "cache off | TTFT turn 3+ / mlx_lm.server |")
    print("|---|---|---|---|---|")
    for label in labels:
        hit, share = reuse(results[label])
        print(f"| {label} | {hit:.0%} | {share:.0%} | {_ratio(results, label, labels[0], args)}"
              f" | {_ratio(results, label, MLX, args)} |")


def _ratio(results: dict[str, list[TurnLog]], label: str, base: str,
           args: argparse.Namespace) -> str:
    """Median over turns 3+ of the per-run ratio of median TTFTs (min-max over runs)."""
    if base not in results or args.turns < 3:
        return "-"
    ratios = [statistics.median(median_ttft(a, t) / median_ttft(b, t)
                                for t in range(2, args.turns))
              for a, b in zip(results[label], results[base])]
    return spread(ratios).text(".2f")


def suite(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    model_path = local_path(args.source)
    bias = eos_bias(model_path)
    out = OUT
    out.mkdir(exist_ok=True)
    results: dict[str, list[TurnLog]] = {}
    with tempfile.TemporaryDirectory(prefix="agent-turns-") as tmp:
        for setup in ORCHARD_SETUPS:
            target, command = orchard_command(setup, args.source, Path(tmp))
            results[setup.label] = bench_target(target, command, args, bias,
                                                out / f"agent_{setup.label.replace(' ', '_')}.log")
        if not args.no_mlx:
            target, command = mlx_server(model_path, prompt_cache=True)
            results[MLX] = bench_target(target, command, args, bias, out / "agent_mlx.log")
    report(results, args)
    print(f"wall {time.perf_counter() - started:.0f}s")
