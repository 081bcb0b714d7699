"""httpx clients for streamed chat completions: N streams at once with their TTFTs, and one
request read whole (every chunk's arrival, its text and usage) for like-for-like checks.
The bare-socket client for CPU-bound runs is `bare_client`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from itertools import pairwise

import httpx

from load.harness.prompts import PROMPT, bench_prompts
from load.harness.results import Level, Sample
from load.harness.servers import BASE, Target
from load.harness.stats import Run

REQUEST_TIMEOUT_S = 300


async def http_streams(concurrency: int, max_tokens: int, model: str,
                       text: str = PROMPT, base: str = BASE) -> Run:
    """A warm-up request, then `concurrency` streams of `text` at once: tokens from usage,
    each stream's TTFT."""
    async def one(client: httpx.AsyncClient, max_tokens: int = max_tokens,
                  text: str = text) -> tuple[int, float]:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
                "max_tokens": max_tokens, "temperature": 0,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = 0.0
        tokens = 0
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not first and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return tokens, first

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, 8, "Warm up.")  # connections and the request path, not the prompt
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return Run(sum(t for t, _ in results), seconds, [f for _, f in results])


async def one_request(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int,
                      logit_bias: dict[str, float] | None = None) -> Sample:
    """One streamed request, every text-carrying chunk timed; short of `max_tokens` is an error."""
    body = {"model": target.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if logit_bias:
        body["logit_bias"] = logit_bias
    sample = Sample(prompt)
    arrivals: list[float] = []
    pieces: list[str] = []
    done, finish, usage = False, None, None
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{target.base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and mlx_lm.server's `: keepalive` comments
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    sample.error = f"error event: {chunk['error']}"
                    return sample
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = "".join(delta.get(k) or "" for k in ("content", "reasoning_content", "reasoning"))
                    if piece:
                        arrivals.append(time.perf_counter())
                        pieces.append(piece)
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        return sample
    if not (done and finish and usage and arrivals):
        sample.error = "truncated stream (no [DONE], finish reason, usage or text)"
        return sample
    sample.e2e = time.perf_counter() - start
    sample.ttft = arrivals[0] - start
    sample.gaps = [b - a for a, b in pairwise(arrivals)]
    sample.tokens = int(usage["completion_tokens"])
    sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    sample.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    sample.text = "".join(pieces)
    if sample.tokens != max_tokens:  # unequal work would skew the comparison: not done
        sample.error = f"short: {sample.tokens} of {max_tokens} tokens (finish {finish})"
    return sample


async def run_level(target: Target, concurrency: int, requests: int, max_tokens: int, tag: str,
                    logit_bias: dict[str, float] | None = None) -> Level:
    """`concurrency` workers share `requests` requests; each prompt is unique to (tag, index),
    and the same on every server, so outputs can be compared."""
    prompts = bench_prompts()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    samples: list[Sample] = []
    indexes = iter(range(requests))  # shared by the workers: one event loop, no locking needed
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def worker() -> None:
            for i in indexes:
                # The hash goes first: a readable counter would be a prefix that requests share.
                unique = hashlib.sha256(f"{tag}-{i}".encode()).hexdigest()[:8]
                prompt = f"{unique} {prompts[i % len(prompts)]}"
                samples.append(await one_request(client, target, prompt, max_tokens, logit_bias))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return Level(target.label, concurrency, seconds, samples)
