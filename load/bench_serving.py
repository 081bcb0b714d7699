"""Serving throughput: raw mlx-lm in-process vs Orchard over HTTP, same model, one run.

    python load/bench_serving.py --model builtin:bench --tokens 128

Prints single-stream tokens/s for raw `mlx_lm.stream_generate`, raw `BatchGenerator`
aggregate tokens/s at 8 and 32 sequences, and Orchard (a real `serve run` on 127.0.0.1)
single-stream and aggregate tokens/s at 8 and 32 concurrent streams, with the ratios, plus
the serving path's per-token overhead. Raw runs first, then the server, so they never
compete for the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PORT = 8000
BASE = f"http://127.0.0.1:{PORT}"
PROMPT = "Write a long story about a lighthouse keeper and the sea."


@dataclass(frozen=True)
class Run:
    tokens: int
    seconds: float
    ttft: list[float]

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def raw_single(source: str, max_tokens: int) -> Run:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from replicas.loading import load_model

    loaded = load_model(source)
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                  add_generation_prompt=True)
    sampler = make_sampler(temp=0.0)
    for _ in mlx_lm.stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=8, sampler=sampler):
        pass  # warm-up
    start = time.perf_counter()
    first = None
    n = 0
    for _ in mlx_lm.stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens,
                                    sampler=sampler):
        first = first or time.perf_counter() - start
        n += 1
    return Run(n, time.perf_counter() - start, [first or 0.0])


def raw_batched(source: str, max_tokens: int, batch: int) -> Run:
    from mlx_lm.generate import BatchGenerator

    from replicas.loading import load_model

    loaded = load_model(source)
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                  add_generation_prompt=True)
    gen = BatchGenerator(loaded.model, completion_batch_size=max(batch, 8), prefill_batch_size=8)
    start = time.perf_counter()
    gen.insert([list(prompt)] * batch, max_tokens=[max_tokens] * batch)
    n, live = 0, batch
    while live:
        _, responses = gen.next()
        for r in responses:
            n += 1
            live -= r.finish_reason is not None
    return Run(n, time.perf_counter() - start, [])


async def http_streams(concurrency: int, max_tokens: int, model: str) -> Run:
    async def one(client: httpx.AsyncClient) -> tuple[int, float]:
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                "max_tokens": max_tokens, "temperature": 0,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = 0.0
        tokens = 0
        async with client.stream("POST", f"{BASE}/v1/chat/completions", json=body) as r:
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
        await one(client)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return Run(sum(t for t, _ in results), seconds, [f for _, f in results])


def start_server(source: str, model: str, flush_ms: float) -> subprocess.Popen[bytes]:
    config = {
        "proxy_location": "EveryNode",
        "http_options": {"host": "127.0.0.1", "port": PORT},
        "applications": [{
            "name": "orchard", "route_prefix": "/", "import_path": "deployments.app:build_app",
            "args": {"models": [{"id": model, "source": source, "max_ongoing_requests": 64,
                                 "stream_flush_ms": flush_ms}]},
        }],
    }
    path = Path(tempfile.mkdtemp()) / "bench_config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    serve = Path(sys.executable).with_name("serve")
    proc = subprocess.Popen([str(serve), "run", str(path)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{BASE}/v1/models", timeout=2).status_code == 200:
                r = httpx.post(f"{BASE}/v1/completions", timeout=60,
                               json={"model": model, "prompt": "hi", "max_tokens": 1})
                if r.status_code == 200:
                    return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError("serve run did not come up")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="builtin:bench", help="model source")
    parser.add_argument("--tokens", type=int, default=128, help="max tokens per request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--flush-ms", type=float, default=5.0, help="stream_flush_ms for Orchard")
    args = parser.parse_args()

    raw1 = raw_single(args.model, args.tokens)
    raw_batches = {c: raw_batched(args.model, args.tokens, c) for c in args.concurrency}
    proc = start_server(args.model, "bench", args.flush_ms)
    try:
        http1 = asyncio.run(http_streams(1, args.tokens, "bench"))
        http_many = {c: asyncio.run(http_streams(c, args.tokens, "bench")) for c in args.concurrency}
    finally:
        stop_server(proc)

    print(f"model {args.model}, {args.tokens} tokens per request, greedy, "
          f"stream_flush_ms {args.flush_ms:g}")
    print(f"{'run':<34}{'tokens/s':>10}{'ratio':>10}{'TTFT p50 ms':>14}")
    print(f"{'raw mlx_lm.stream_generate x1':<34}{raw1.tps:>10.1f}{1.0:>10.2f}{raw1.ttft[0]*1e3:>14.1f}")
    for c, run in raw_batches.items():
        print(f"{f'raw BatchGenerator x{c}':<34}{run.tps:>10.1f}{run.tps / raw1.tps:>10.2f}{'':>14}")
    print(f"{'orchard HTTP x1':<34}{http1.tps:>10.1f}{http1.tps / raw1.tps:>10.2f}{pct(http1.ttft, .5)*1e3:>14.1f}")
    for c, run in http_many.items():
        print(f"{f'orchard HTTP x{c}':<34}{run.tps:>10.1f}{run.tps / http1.tps:>10.2f}"
              f"{pct(run.ttft, .5)*1e3:>14.1f}   (ratio vs orchard x1; vs raw batched "
              f"{run.tps / raw_batches[c].tps:.2f})")
    overhead_ms = (1 / http1.tps - 1 / raw1.tps) * 1e3
    print(f"serving-path overhead per token (single stream): {overhead_ms:.3f} ms "
          f"(raw decode {1e3 / raw1.tps:.3f} ms/token)")


if __name__ == "__main__":
    main()
