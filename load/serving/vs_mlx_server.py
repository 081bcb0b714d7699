"""Orchard vs mlx_lm.server: the same model, prompts and client, one server at a time.

    python load/bench_vs_mlx_server.py --model builtin:bench --max-tokens 64

Starts `mlx_lm.server` on 127.0.0.1:8101 (as shipped, then with its prompt cache off), then
Orchard (`serve run`, 127.0.0.1:8100) with one replica and with two, never two servers at
once, and drives each with the same streamed chat requests at each concurrency: a closed
loop of N workers sending `rounds x N` requests (at least --min-requests), greedy,
`max_tokens` each. Prints per level aggregate output tokens/s, TTFT p50/p99, inter-chunk
latency (ITL) p50/p99, TPOT p50/p99 and errors, then the Orchard/mlx_lm.server ratios and
Orchard's two-replica scale-out; writes load/out/bench_vs_mlx_server.json and .png.

Output tokens are counted from usage: both servers honour `stream_options.include_usage`.
Every prompt starts with a unique hash, so no two requests share more than the chat
template's opening tokens. mlx_lm.server still reuses those from its prompt cache (Orchard
has none), so it runs twice: as shipped, and with `--prompt-cache-size 0` for an
engine-to-engine comparison; the cached prompt tokens it reports are printed. Both batch
with the same limits: 32 sequences decoding, 8 prompts prefilling.

Equal work is checked, not assumed: end-of-sequence is suppressed (the same `logit_bias` to
both) so every request must produce exactly `max_tokens` tokens, and both servers must
count the same prompt tokens for each prompt. A request that fails or comes back short is
work not done: it adds 0 tokens but its time to the level's tokens/s. The verdict lines
say when any of this did not hold, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script

from load.bench_results import Level, Sample, by_prompt, problems  # noqa: E402
from load.serve_settings import serve_settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "load" / "out"
HOST = "127.0.0.1"
ORCHARD_PORT, MLX_PORT = 8100, 8102  # Orchard's: its replica; Serve's proxy takes 8101
MAX_BATCH, PREFILL_BATCH = 32, 8  # the same batching limits on both servers
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 300
PROMPTS = json.loads((ROOT / "load" / "payloads.json").read_text(encoding="utf-8"))["bench_prompts"]


@dataclass(frozen=True)
class Target:
    label: str
    base: str
    model: str  # the name sent as `model`


async def one_request(client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int,
                      logit_bias: dict[str, float] | None = None) -> Sample:
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
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    samples: list[Sample] = []
    indexes = iter(range(requests))  # shared by the workers: one event loop, no locking needed
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        async def worker() -> None:
            for i in indexes:
                # The hash goes first: a readable counter would be a prefix that requests share.
                unique = hashlib.sha256(f"{tag}-{i}".encode()).hexdigest()[:8]
                prompt = f"{unique} {PROMPTS[i % len(PROMPTS)]}"
                samples.append(await one_request(client, target, prompt, max_tokens, logit_bias))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return Level(target.label, concurrency, seconds, samples)


def wait_ready(proc: subprocess.Popen[bytes], target: Target, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    probe = {"model": target.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{target.label} exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            r = httpx.post(f"{target.base}/v1/chat/completions", json=probe, timeout=60)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{target.label} did not come up in {STARTUP_TIMEOUT_S} s; log: {log_path}")


@contextmanager
def running(target: Target, command: list[str], log_path: Path) -> Iterator[Target]:
    """The server process for the duration of the block; its whole process group after."""
    port = int(target.base.rsplit(":", 1)[1])
    with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
        raise RuntimeError(f"{HOST}:{port} is already taken (a stale server?): refusing to "
                           f"benchmark it as {target.label}")
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            wait_ready(proc, target, log_path)
            yield target
            if proc.poll() is not None:  # whatever answered after it exited was not ours
                raise RuntimeError(f"{target.label} exited ({proc.returncode}) during the run")
        finally:
            os.killpg(proc.pid, signal.SIGINT)  # serve run shuts Serve and Ray down on Ctrl-C
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def mlx_server(model_path: Path, prompt_cache: bool) -> tuple[Target, list[str]]:
    label = "mlx_lm.server" if prompt_cache else "mlx_lm.server no-cache"
    command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_path),
               "--host", HOST, "--port", str(MLX_PORT), "--temp", "0",
               "--decode-concurrency", str(MAX_BATCH), "--prompt-concurrency", str(PREFILL_BATCH)]
    if not prompt_cache:
        command += ["--prompt-cache-size", "0"]  # every entry is evicted as soon as it is stored
    return Target(label, f"http://{HOST}:{MLX_PORT}", "default_model"), command


def orchard(source: str, replicas: int, workdir: Path) -> tuple[Target, list[str]]:
    config = {
        **serve_settings(ORCHARD_PORT),
        "applications": [{
            "name": "orchard", "route_prefix": "/", "import_path": "deployments.app:build_app",
            "args": {"models": [{
                "id": "bench", "source": source, "num_replicas": replicas, "max_ongoing_requests": 64,
                "engine": {"max_batch_size": MAX_BATCH, "prefill_batch_size": PREFILL_BATCH},
            }]},
        }],
    }
    path = workdir / f"orchard_x{replicas}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    serve = Path(sys.executable).with_name("serve")
    return Target(f"orchard x{replicas}", f"http://{HOST}:{ORCHARD_PORT}", "bench"), [str(serve), "run", str(path)]


def local_path(source: str) -> Path:
    if source.startswith("builtin:"):
        # The one project import here: mlx_lm.server needs the directory the project builds.
        from replicas.builtin import ensure_builtin

        return ensure_builtin(source.removeprefix("builtin:"))
    return Path(source)


def eos_bias(model_path: Path) -> dict[str, float]:
    """A logit_bias that keeps end-of-sequence from being sampled, so every request runs to
    max_tokens on both servers (both accept OpenAI's logit_bias)."""
    from mlx_lm.utils import load_tokenizer

    return {str(t): -100.0 for t in sorted(load_tokenizer(model_path).eos_token_ids)}


def bench(target: Target, args: argparse.Namespace, bias: dict[str, float]) -> list[Level]:
    asyncio.run(run_level(target, 4, 4, args.max_tokens, "warmup", bias))  # load, allocate, first batches
    levels = []
    for c in args.concurrency:
        level = asyncio.run(run_level(target, c, max(args.min_requests, args.rounds * c),
                                      args.max_tokens, f"c{c}", bias))
        print(f"  {target.label:<22} c={c:<3} {level.summary()['tokens_per_s']:8.1f} tokens/s", flush=True)
        levels.append(level)
    return levels


def concurrencies(results: dict[str, list[Level]]) -> list[int]:
    return [lv.concurrency for lv in next(iter(results.values()))]


def table(results: dict[str, list[Level]]) -> str:
    # One TTFT and one TPOT per request: below 100 requests a nearest-rank p99 is the max.
    lines = [("| concurrency | server | output tok/s | TTFT p50 ms | TTFT p99/max ms | ITL p50 ms "
             "| ITL p99 ms | TPOT p50 ms | TPOT p99/max ms | errors |"),
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, c in enumerate(concurrencies(results)):
        for label, levels in results.items():
            s = levels[i].summary()
            lines.append(f"| {c} | {label} | {s['tokens_per_s']:.1f} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} "
                         f"| {s['itl_p50_ms']:.1f} | {s['itl_p99_ms']:.1f} | {s['tpot_p50_ms']:.1f} "
                         f"| {s['tpot_p99_ms']:.1f} | {s['errors']}/{s['requests']} |")
    return "\n".join(lines)


def ratios(results: dict[str, list[Level]]) -> str:
    """Each Orchard run over each mlx_lm.server run: above 1 is better for tok/s, worse for TTFT."""
    lines = ["| concurrency | orchard | baseline | tok/s ratio | TTFT p50 ratio | TTFT p99/max ratio |",
             "|---:|---|---|---:|---:|---:|"]
    mine = [label for label in results if label.startswith("orchard")]
    bases = [label for label in results if label.startswith("mlx_lm.server")]
    for i, c in enumerate(concurrencies(results)):
        for label in mine:
            s = results[label][i].summary()
            for base in bases:
                b = results[base][i].summary()
                lines.append(f"| {c} | {label} | {base} | {s['tokens_per_s'] / b['tokens_per_s']:.2f} "
                             f"| {s['ttft_p50_ms'] / b['ttft_p50_ms']:.2f} | {s['ttft_p99_ms'] / b['ttft_p99_ms']:.2f} |")
    return "\n".join(lines)


def notes(results: dict[str, list[Level]]) -> list[str]:
    out = []
    one, two = results.get("orchard x1"), results.get("orchard x2")
    if one and two:
        factors = ", ".join(f"c={a.concurrency}: {b.summary()['tokens_per_s'] / a.summary()['tokens_per_s']:.2f}x"
                            for a, b in zip(one, two))
        out.append(f"scale-out, orchard x2 / x1 tokens/s: {factors}")
    for label, levels in results.items():
        if not label.startswith("mlx_lm.server"):
            continue
        cached = sum(lv.summary()["cached_prompt_tokens"] for lv in levels) / sum(len(lv.ok) for lv in levels)
        out.append(f"{label}: {cached:.1f} prompt tokens per request served from its prompt cache")
        if one:
            # Samples are in completion order; the prompt pairs the same request across servers.
            same = ", ".join(f"c={la.concurrency}: {sum(by_prompt(la).get(k) == t for k, t in by_prompt(lb).items())}"
                             f"/{len(la.samples)}" for la, lb in zip(levels, one))
            out.append(f"  identical greedy outputs vs orchard x1: {same}")
    return out


def chart(results: dict[str, list[Level]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = concurrencies(results)
    for label, levels in results.items():
        sums = [lv.summary() for lv in levels]
        tps.plot(xs, [s["tokens_per_s"] for s in sums], marker="o", label=label)
        line, = ttft.plot(xs, [s["ttft_p50_ms"] for s in sums], marker="o", label=f"{label} p50")
        ttft.plot(xs, [s["ttft_p99_ms"] for s in sums], marker="x", linestyle="--",
                  color=line.get_color(), label=f"{label} p99")
    ttft.set_yscale("log")  # TTFT spans seconds at c=1 to minutes at c=32 on a CPU
    for ax, title, unit in ((tps, "aggregate output tokens/s", "tokens/s"), (ttft, "time to first token", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:bench", help="model source (builtin:NAME or a local path)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = rounds x concurrency")
    parser.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="Orchard replica counts to run")
    parser.add_argument("--mlx", choices=["both", "cache", "no-cache", "none"], default="both",
                        help="mlx_lm.server runs: with its prompt cache, without, both, or none")
    parser.add_argument("--allow-eos", action="store_true",
                        help="do not suppress end-of-sequence (requests that end early then "
                             "count as work not done)")
    return parser


def main() -> int:
    args = build_parser().parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    model_path = local_path(args.model)  # built before any server starts
    bias = {} if args.allow_eos else eos_bias(model_path)
    caches = {"both": [True, False], "cache": [True], "no-cache": [False], "none": []}[args.mlx]
    servers = [mlx_server(model_path, cache) for cache in caches]
    workdir = Path(tempfile.mkdtemp(prefix="orchard-bench-"))
    servers += [orchard(args.model, n, workdir) for n in args.replicas]
    results: dict[str, list[Level]] = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for target, command in servers:
        print(f"{target.label}: starting", flush=True)
        log = OUT / f"bench_{target.label.replace(' ', '_')}.log"
        with running(target, command, log):
            results[target.label] = bench(target, args, bias)

    print(f"\nmodel {args.model}, {args.max_tokens} tokens per request, greedy, started {started}, "
          f"load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n")
    print(table(results))
    print()
    print(ratios(results))
    print()
    for line in notes(results):
        print(line)
    broken = problems(results, args.max_tokens)
    print("\nlike for like: " + ("yes (every request produced max_tokens tokens; prompt token "
                                  "counts agree)" if not broken else "NO"))
    for line in broken:
        print(f"  {line}")
    (OUT / "bench_vs_mlx_server.json").write_text(json.dumps({
        "args": vars(args), "started": started,
        "levels": {label: [lv.summary() | {"concurrency": lv.concurrency} for lv in levels]
                   for label, levels in results.items()},
        "errors": {label: [s.error for lv in levels for s in lv.samples if s.error] for label, levels in results.items()},
        "problems": broken,
    }, indent=2))
    chart(results, OUT / "bench_vs_mlx_server.png")
    print(f"wrote {OUT / 'bench_vs_mlx_server.json'} and {OUT / 'bench_vs_mlx_server.png'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
