"""Fair share between tenants (issue 61): a heavy tenant against a light one on one replica.

The heavy tenant keeps `--heavy` long streams open (end of text banned, `--heavy-tokens`
each, asked back to back); the light tenant sends one short request at a time and we time
its first token. Two servers, one after the other, on `builtin:tiny` with a `--rows` batch:
Orchard with two tenants of equal share (fair share: a free row goes to the tenant with
fewer rows) and the same without tenants (first come, first served: the light request
waits behind the heavy tenant's queue). On each: the light tenant's TTFT alone, then beside
the heavy one, and the total output tokens/s under both (the throughput fair share costs).

    python -m load.serving.tenants --seconds 30

The same with Locust user classes per tenant (the issue's form): `load.locust.run_tenants`.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass

import httpx

from load.harness.servers import eos_bias, local_path
from load.harness.stats import nearest_rank
from load.harness.tenant_server import MODEL, auth, server

LIGHT = [{"role": "user", "content": "Hello!"}]
HEAVY = [{"role": "user", "content": "Tell me about the ocean."}]


@dataclass(frozen=True)
class Phase:
    light_ttft_s: list[float]
    output_tokens: int  # every request's, heavy and light, finished in the window
    seconds: float

    def row(self) -> str:
        p50 = statistics.median(self.light_ttft_s) * 1000 if self.light_ttft_s else float("nan")
        p95 = nearest_rank(self.light_ttft_s, 0.95) * 1000
        return (f"light TTFT p50 {p50:7.1f} ms  p95 {p95:7.1f} ms  ({len(self.light_ttft_s)} "
                f"requests)  output {self.output_tokens / self.seconds:7.1f} tok/s")


def _stream(client: httpx.Client, base: str, tenant: str, messages: list[dict[str, str]],
            max_tokens: int, bias: dict[str, float]) -> tuple[float | None, int]:
    """(seconds to the first content, completion tokens) of one streamed chat request."""
    started, first, tokens = time.perf_counter(), None, 0
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": bias}
    with client.stream("POST", f"{base}/v1/chat/completions", json=body,
                       headers=auth(tenant)) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
            if '"completion_tokens":' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
    return first, tokens


def phase(base: str, heavy: int, seconds: float, light_tokens: int, heavy_tokens: int,
          bias: dict[str, float]) -> Phase:
    """`heavy` streams (0: none) and the light tenant's one-at-a-time requests for `seconds`
    after a warm-up; the light TTFTs and every output token finished in the window."""
    warm_until = time.monotonic() + (5.0 if heavy else 0.0)
    end = warm_until + seconds
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def worker(tenant: str) -> None:
        with httpx.Client(timeout=600) as client:
            while time.monotonic() < end:
                light = tenant == "light"
                first, made = _stream(client, base, tenant, LIGHT if light else HEAVY,
                                      light_tokens if light else heavy_tokens, bias)
                now = time.monotonic()
                if warm_until <= now <= end:
                    with lock:
                        tokens[0] += made
                        if light and first is not None:
                            ttfts.append(first)

    threads = [threading.Thread(target=worker, args=(t,))
               for t in ["light", *["heavy"] * heavy]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Phase(ttfts, tokens[0], seconds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heavy", type=int, default=48, help="the heavy tenant's streams")
    parser.add_argument("--rows", type=int, default=16, help="the replica's max_batch_size")
    parser.add_argument("--seconds", type=float, default=30.0, help="each measured phase")
    parser.add_argument("--heavy-tokens", type=int, default=256)
    parser.add_argument("--light-tokens", type=int, default=8)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    bias = eos_bias(local_path("builtin:tiny"))
    results: dict[str, tuple[Phase, Phase]] = {}
    for label, tenants in (("fair share (tenants)", True), ("first come (no tenants)", False)):
        with server(tenants, args.rows) as base:
            alone = phase(base, 0, args.seconds / 2, args.light_tokens, args.heavy_tokens,
                          bias)
            mixed = phase(base, args.heavy, args.seconds, args.light_tokens,
                          args.heavy_tokens, bias)
        results[label] = (alone, mixed)
        print(f"{label}\n  alone:       {alone.row()}\n  with heavy:  {mixed.row()}",
              flush=True)
    (_, fair), (_, fifo) = results.values()
    for label, (alone, mixed) in results.items():
        ratio = nearest_rank(mixed.light_ttft_s, 0.95) / nearest_rank(alone.light_ttft_s, 0.95)
        print(f"{label}: light TTFT p95 with heavy / alone = {ratio:.2f}x")
    cost = 1 - (fair.output_tokens / fair.seconds) / (fifo.output_tokens / fifo.seconds)
    print(f"throughput cost of fair share: {cost * 100:+.1f}% of first come's output tok/s")


if __name__ == "__main__":
    main()
