"""Serving throughput: raw mlx-lm in-process vs Orchard over HTTP, same model, one run.

    python load/bench_serving.py --model builtin:bench --tokens 128

Prints single-stream tokens/s for raw `mlx_lm.stream_generate`, raw `BatchGenerator`
aggregate tokens/s at 8 and 32 sequences, and Orchard (a real `serve run` on 127.0.0.1)
single-stream and aggregate tokens/s at 8 and 32 concurrent streams, with the ratios, plus
the serving path's per-token overhead. Raw batched runs come first, before the server starts.
Single streams alternate, raw then HTTP, `--repeat` times, and the medians are reported
(the ratio's with a bootstrap interval, since one pair's ratio moves by +-15% on a small VM);
during each raw run the server's processes are paused (SIGSTOP), so raw mlx-lm never
competes with them for the CPU, and the machine's drift hits both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script

from load.process_cpu import CpuSnapshot, per_token_table, process_tree  # noqa: E402
from load.serve_settings import serve_settings  # noqa: E402

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


# Ray Serve's HAProxy direct ingress (README, "Layouts"): read where Ray starts, so they go
# into `serve run`'s environment. 1024 connections keep HAProxy within a 4096-descriptor limit.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_MAXCONN": "1024"}


def median_run(runs: list[Run]) -> Run:
    """The run with the median tokens/s: one request is noisy on a shared machine."""
    return sorted(runs, key=lambda r: r.tps)[len(runs) // 2]


class RawModel:
    """Raw mlx-lm on the same model files, loaded by the production loading code."""

    def __init__(self, source: str) -> None:
        from mlx_lm.sample_utils import make_sampler

        from replicas.sources import load_source as load_model

        self.loaded = load_model(source)
        self.prompt = self.tokens(PROMPT)
        self.sampler = make_sampler(temp=0.0)
        self.single(8)  # warm-up

    def tokens(self, text: str) -> list[int]:
        return list(self.loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True))

    def single(self, max_tokens: int, text: str = PROMPT) -> Run:
        import mlx_lm

        prompt = self.prompt if text == PROMPT else self.tokens(text)
        start = time.perf_counter()
        first = None
        n = 0
        for _ in mlx_lm.stream_generate(self.loaded.model, self.loaded.tokenizer, prompt,
                                        max_tokens=max_tokens, sampler=self.sampler):
            first = first or time.perf_counter() - start
            n += 1
        return Run(n, time.perf_counter() - start, [first or 0.0])

    def _generator(self, batch: int) -> Any:
        """mlx-lm's `BatchGenerator` with the servers' limits (8 prefilling at a time)."""
        from mlx_lm.generate import BatchGenerator

        return BatchGenerator(self.loaded.model, completion_batch_size=max(batch, 8),
                              prefill_batch_size=8)

    def batched(self, max_tokens: int, batch: int) -> Run:
        gen = self._generator(batch)
        start = time.perf_counter()
        gen.insert([list(self.prompt)] * batch, max_tokens=[max_tokens] * batch)
        n, live = 0, batch
        while live:
            _, responses = gen.next()
            for r in responses:
                n += 1
                live -= r.finish_reason is not None
        return Run(n, time.perf_counter() - start, [])

    def arrivals(self, max_tokens: int, batch: int, prompts: list[list[int]]) -> Run:
        """mlx-lm's `BatchGenerator` as a server drives it: `batch` sequences in flight, each
        replaced by the next of `prompts` (tokenized already) the step it ends, as a closed
        loop of clients would. The first `batch` end at staggered lengths, so rows join and
        leave one at a time as in a steady state; timed until the last prompt has joined."""
        gen = self._generator(batch)
        queue = iter(prompts)
        start = time.perf_counter()
        gen.insert([next(queue) for _ in range(batch)],
                   max_tokens=[max(1, max_tokens * (i + 1) // batch) for i in range(batch)])
        n, left = 0, len(prompts) - batch
        while left > 0:
            _, responses = gen.next()
            n += len(responses)
            for r in responses:
                if r.finish_reason is not None and left > 0:
                    gen.insert([next(queue)], max_tokens=[max_tokens])
                    left -= 1
        return Run(n, time.perf_counter() - start, [])


@contextlib.contextmanager
def paused(root: int) -> Iterator[None]:
    """Freeze the server's whole process tree (SIGSTOP), so a raw run sees the machine as it
    would be without Orchard; a few seconds is far inside Ray's health-check timeouts."""
    pids = process_tree(root)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def pair_prompt(index: int) -> str:
    """Each raw/HTTP pair's own prompt: Orchard's prefix cache would otherwise skip the
    prefill of a prompt it has seen, which raw mlx-lm never does."""
    return f"Story {index}. {PROMPT}"


async def http_streams(concurrency: int, max_tokens: int, model: str,
                       text: str = PROMPT) -> Run:
    async def one(client: httpx.AsyncClient, max_tokens: int = max_tokens,
                  text: str = text) -> tuple[int, float]:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
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
        await one(client, 8, "Warm up.")  # connections and the request path, not the prompt
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return Run(sum(t for t, _ in results), seconds, [f for _, f in results])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already answers on the port: a stale server would be measured."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def require_alive(proc: subprocess.Popen[bytes]) -> None:
    """Our own `serve run` must still be the one answering, not something left behind."""
    if proc.poll() is not None:
        raise RuntimeError(f"serve run exited (code {proc.returncode}); the figures would "
                           "come from whatever else answers on the port")


# `--layout`: the config's `ingress.colocate`; "default" leaves it unset, as a user does.
LAYOUTS: dict[str, dict[str, bool]] = {"default": {}, "two-hop": {"colocate": False},
                                       "colocated": {"colocate": True}}


def start_server(source: str, model: str, flush_ms: float, layout: str = "default",
                 haproxy: bool = False, metrics: bool = True,
                 settings: dict[str, object] | None = None,
                 actor_calls: bool = False,
                 app: dict[str, Any] | None = None) -> subprocess.Popen[bytes]:
    """`serve run` of one model (`bench_config`)."""
    if port_in_use(PORT):
        raise RuntimeError(f"something already listens on 127.0.0.1:{PORT} (a stale "
                           "`serve run`? `serve shutdown -y` / `ray stop`); refusing to "
                           "benchmark it")
    config = bench_config(source, model, flush_ms, layout, haproxy, metrics, settings,
                          actor_calls, app)
    return run_config(config, [model], env=HAPROXY_ENV if haproxy else {})


def bench_config(source: str, model: str, flush_ms: float, layout: str = "default",
                 haproxy: bool = False, metrics: bool = True,
                 settings: dict[str, object] | None = None,
                 actor_calls: bool = False,
                 app: dict[str, Any] | None = None) -> dict[str, object]:
    """One model's config, with the Serve settings `serve_config.yaml` ships (its
    `controller_options`); `settings` are more of the model's config fields; `actor_calls`:
    Serve's own default transport between its proxy and the replica (Ray actor calls)
    instead of the shipped gRPC; `app`: more of the application's keys (Serve's
    `logging_config`), its `args` merged into Orchard's (`observability`)."""
    extra = dict(app or {})
    application: dict[str, Any] = {
        "name": "orchard", "route_prefix": "/", "import_path": "deployments.app:build_app",
        "args": {"models": [{"id": model, "source": source, "max_ongoing_requests": 64,
                             "stream_flush_ms": flush_ms, **(settings or {})}],
                 "ingress": LAYOUTS[layout],
                 # Off: no metrics and no request log lines, for the on/off overhead ratio.
                 "observability": {"metrics": metrics, "request_logs": metrics},
                 **extra.pop("args", {})},
        **extra}
    return {
        # HAProxy takes the port itself and Serve gives each replica one of its own range.
        **serve_settings(PORT, direct=not haproxy,
                         **({"RAY_SERVE_PROXY_USE_GRPC": "0"} if actor_calls else {})),
        "applications": [application],
    }


def run_config(config: dict[str, object], models: list[str],
               env: dict[str, str] | None = None,
               ready: Callable[[], bool] | None = None) -> subprocess.Popen[bytes]:
    """`serve run` of `config` on 127.0.0.1 (with the shipped Serve settings unless it sets
    its own), returned once every model answers a completion (or `ready()` says the server
    serves)."""
    path = Path(tempfile.mkdtemp()) / "bench_config.yaml"
    path.write_text(json.dumps({**serve_settings(), **config}))
    serve = Path(sys.executable).with_name("serve")
    proc = subprocess.Popen([str(serve), "run", str(path)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited during startup (code {proc.returncode})")
        try:
            if ready() if ready is not None else all(
                    httpx.post(f"{BASE}/v1/completions", timeout=60, json={
                        "model": m, "prompt": "hi", "max_tokens": 1}).status_code == 200
                    for m in models):
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


def median_interval(values: list[float], confidence: float = 0.9,
                    resamples: int = 4000) -> tuple[float, float]:
    """A bootstrap interval for the median: on a noisy machine, whether a ratio clears a
    target is a question about this interval, not about one run."""
    rng = random.Random(0)  # the same pairs always give the same interval
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", default="builtin:bench", help="model source")
    parser.add_argument("--tokens", type=int, default=128, help="max tokens per request")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 32],
                        help="batched levels after the single streams (none: single only)")
    parser.add_argument("--flush-ms", type=float, default=5.0, help="stream_flush_ms for Orchard")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="default",
                        help="default: the config's own choice (colocated for one model on "
                             "one replica); two-hop: an ingress replica in front; colocated: "
                             "ingress.colocate set")
    parser.add_argument("--haproxy", action="store_true",
                        help="start Ray with Serve's HAProxy direct ingress (README, Layouts)")
    parser.add_argument("--no-metrics", action="store_true",
                        help="observability.metrics and request_logs off (compare a run with "
                             "and one without for the metrics overhead)")
    parser.add_argument("--repeat", type=int, default=20,
                        help="alternating raw/HTTP single-stream pairs; medians are reported")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    raw = RawModel(args.model)
    raw_batches = {c: raw.batched(args.tokens, c) for c in args.concurrency}
    proc = start_server(args.model, "bench", args.flush_ms, args.layout, args.haproxy,
                        metrics=not args.no_metrics)
    raw_runs: list[Run] = []
    http_runs: list[Run] = []
    spent: dict[str, float] = {}
    raw_cpu = 0.0
    try:
        # Single streams alternate raw and HTTP, so the machine's drift hits both alike.
        for index in range(args.repeat):
            text = pair_prompt(index)
            with paused(proc.pid):
                cpu = time.process_time()
                raw_runs.append(raw.single(args.tokens, text))
                raw_cpu += time.process_time() - cpu
            before = CpuSnapshot.take(process_tree(proc.pid))
            http_runs.append(asyncio.run(http_streams(1, args.tokens, "bench", text)))
            for name, seconds in CpuSnapshot.take(process_tree(proc.pid)).since(before).items():
                spent[name] = spent.get(name, 0.0) + seconds
            require_alive(proc)
        http_many = {c: asyncio.run(http_streams(c, args.tokens, "bench")) for c in args.concurrency}
        require_alive(proc)
    finally:
        stop_server(proc)
    raw1, http1 = median_run(raw_runs), median_run(http_runs)
    pair_ratios = sorted(h.tps / r.tps for r, h in zip(raw_runs, http_runs))

    print(f"model {args.model}, {args.tokens} tokens per request, greedy, "
          f"stream_flush_ms {args.flush_ms:g}, layout {args.layout}"
          f"{', HAProxy direct ingress' if args.haproxy else ''}"
          f"{', metrics off' if args.no_metrics else ''}")
    print(f"{'run':<34}{'tokens/s':>10}{'ratio':>10}{'TTFT p50 ms':>14}")
    print(f"{'raw mlx_lm.stream_generate x1':<34}{raw1.tps:>10.1f}{1.0:>10.2f}{raw1.ttft[0]*1e3:>14.1f}")
    for c, run in raw_batches.items():
        print(f"{f'raw BatchGenerator x{c}':<34}{run.tps:>10.1f}{run.tps / raw1.tps:>10.2f}{'':>14}")
    print(f"{'orchard HTTP x1':<34}{http1.tps:>10.1f}{http1.tps / raw1.tps:>10.2f}{pct(http1.ttft, .5)*1e3:>14.1f}")
    for c, run in http_many.items():
        print(f"{f'orchard HTTP x{c}':<34}{run.tps:>10.1f}{run.tps / http1.tps:>10.2f}"
              f"{pct(run.ttft, .5)*1e3:>14.1f}   (ratio vs orchard x1; vs raw batched "
              f"{run.tps / raw_batches[c].tps:.2f})")
    low, high = median_interval(pair_ratios)
    print(f"single stream, {args.repeat} alternating raw/HTTP pairs: HTTP/raw median "
          f"{statistics.median(pair_ratios):.3f} (90% bootstrap interval {low:.3f}-{high:.3f}), "
          f"range {pair_ratios[0]:.2f}-{pair_ratios[-1]:.2f} (x1 rows above are the median runs)")
    overhead_ms = (1 / http1.tps - 1 / raw1.tps) * 1e3
    print(f"serving-path overhead per token (single stream): {overhead_ms:.3f} ms "
          f"(raw decode {1e3 / raw1.tps:.3f} ms/token)")
    raw_cpu_ms = raw_cpu * 1e3 / sum(r.tokens for r in raw_runs)
    print(f"CPU per token by process over the single-stream HTTP runs (raw mlx-lm in-process: "
          f"{raw_cpu_ms:.2f} ms CPU/token):")
    print("\n".join(per_token_table(spent, sum(r.tokens for r in http_runs), raw_cpu_ms)))


if __name__ == "__main__":
    main()
