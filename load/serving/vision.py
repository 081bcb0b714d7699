"""Images through a vision model: mlx-vlm's own generation in-process vs Orchard's chat
completions over HTTP, same model, one run.

    python -m load.serving.vision [--model builtin:vision] [--images 0 1 4] [--repeat 3]

Each request asks about `--images` distinct pictures (random noise, `--size` pixels
square, PNG data URLs: no two requests share an image, so Orchard's prefix cache never
skips the vision tower) and generates `--max-tokens` tokens greedily.

- Raw: `mlx_vlm.stream_generate` on the same model files, one request after another; TTFT
  is the time to its first token.
- HTTP: a real `serve run` of the model alone on 127.0.0.1; first one request at a time
  (TTFT: the first streamed content), then `--concurrency` requests at once (images/s with
  continuous batching: the text of all of them decodes as one batch).

Each image count alternates raw and HTTP `--repeat` times (the server paused during raw
runs); prints medians with their range, and HTTP/raw as the median of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from typing import Any

import httpx
import numpy as np

from load.harness.servers import BASE, paused, start_server, stop_server
from load.harness.stats import at_least_three, Run, spread

MODEL = "bench-vision"
QUESTION = "Describe these pictures."


def pictures(count: int, size: int, rng: np.random.Generator) -> list[bytes]:
    """Distinct PNGs of random noise."""
    from PIL import Image

    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


class Raw:
    """mlx-vlm's generation on the same files: the reference a vision server is held to."""

    def __init__(self, source: str) -> None:
        from mlx_vlm import load

        from replicas.sources import resolve_source

        self.model, self.processor = load(str(resolve_source(source)))

    def run(self, requests: list[list[bytes]], max_tokens: int) -> Run:
        from mlx_vlm import stream_generate
        from PIL import Image

        ttfts = []
        start = time.perf_counter()
        for images in requests:
            content = [{"type": "text", "text": QUESTION}] + [{"type": "image"}] * len(images)
            prompt = self.processor.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
            began = time.perf_counter()
            opened = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
            for n, _ in enumerate(stream_generate(self.model, self.processor, prompt,
                                                  image=opened or None, max_tokens=max_tokens,
                                                  temperature=0.0)):
                if n == 0:
                    ttfts.append(time.perf_counter() - began)
        return Run(len(requests), time.perf_counter() - start, ttfts)


def body(images: list[bytes], max_tokens: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    content += [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b).decode()}} for b in images]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}


async def one(client: httpx.AsyncClient, images: list[bytes], max_tokens: int) -> float:
    """One streamed request; its TTFT."""
    start = time.perf_counter()
    first = 0.0
    async with client.stream("POST", f"{BASE}/v1/chat/completions",
                             json=body(images, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                first = time.perf_counter() - start
    return first


async def http_run(requests: list[list[bytes]], max_tokens: int, concurrency: int) -> Run:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        ttfts: list[float] = []
        for at in range(0, len(requests), concurrency):
            wave = requests[at:at + concurrency]
            ttfts += await asyncio.gather(*(one(client, r, max_tokens) for r in wave))
        return Run(len(requests), time.perf_counter() - start, ttfts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="builtin:vision")
    parser.add_argument("--images", type=int, nargs="+", default=[0, 1, 4])
    parser.add_argument("--size", type=int, default=64, help="pixels per side")
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    at_least_three(args.repeat, "--repeat")
    rng = np.random.default_rng(1234)
    raw = Raw(args.model)
    raw.run([pictures(1, args.size, rng)], 2)  # warm up
    proc = start_server(args.model, MODEL)
    rows = []
    try:
        asyncio.run(http_run([pictures(1, args.size, rng)], 2, 1))  # warm up the path
        for count in args.images:
            raws, serial, batched = [], [], []
            for _ in range(args.repeat):
                work = [pictures(count, args.size, rng) for _ in range(args.requests)]
                with paused(proc.pid):
                    raws.append(raw.run(work, args.max_tokens))
                serial.append(asyncio.run(http_run(work, args.max_tokens, 1)))
                fresh = [pictures(count, args.size, rng) for _ in range(args.requests)]
                batched.append(asyncio.run(http_run(fresh, args.max_tokens, args.concurrency)))
            rows.append((count, raws, serial, batched))
    finally:
        stop_server(proc)
    print(f"model {args.model}, {args.size}x{args.size} PNGs, {args.requests} requests per run "
          f"of {args.max_tokens} tokens, {args.repeat} alternating runs; medians (min-max)")
    print(f"{'images':>6}{'raw TTFT ms':>22}{'HTTP TTFT ms':>22}{'TTFT HTTP/raw':>16}"
          f"{'raw req/s':>18}{'HTTP req/s':>18}{f'HTTP x{args.concurrency} req/s':>22}"
          f"{f'x{args.concurrency} images/s':>20}")
    for count, raws, serial, batched in rows:
        raw_ttft = [statistics.median(r.ttft) for r in raws]
        http_ttft = [statistics.median(r.ttft) for r in serial]
        ratio = statistics.median(h / r for h, r in zip(http_ttft, raw_ttft))
        print(f"{count:>6}{spread(raw_ttft).text('.1f', 1000):>22}{spread(http_ttft).text('.1f', 1000):>22}"
              f"{ratio:>16.2f}{spread([r.rate for r in raws]).text():>18}"
              f"{spread([r.rate for r in serial]).text():>18}"
              f"{spread([r.rate for r in batched]).text():>22}"
              f"{spread([r.rate * count for r in batched]).text() if count else '-':>20}")


if __name__ == "__main__":
    main()
