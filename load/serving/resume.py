"""Stream continuity under faults (issue 32): streams keep going while replicas die.

    python -m load.serving.resume --streams 8 --duration 60 --kills 3

A real `serve run` on 127.0.0.1 (two-hop layout, `--replicas` replicas of the built-in
tiny model) serves waves of `--streams` concurrent greedy streams for `--duration` seconds,
while a killer sends SIGKILL to a random replica process of the model every
`--kill-every` seconds (jittered), `--kills` times in all. Every stream is checked against
the same request run uninterrupted before the faults start. Reported: streams started,
completed, intact (byte for byte the uninterrupted text and finish reason), failed (an
error event), and the streams that paused past `--gap-s` between two chunks, with those
pauses (median, p95). A healthy stream's gaps are tens of milliseconds; a paused one either
resumed on another replica or the replacement, or slowed while a replacement loaded beside
it on a small box: the client cannot tell which, so the count is an upper bound on resumes
and the pauses bound what a resume added. Bounded: the run ends after `--duration`, and every request has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from load.harness.process_cpu import process_tree
from load.harness.serve_settings import serve_settings
from load.harness.servers import BASE, OUT, port_in_use, run_config, stop_server
from load.harness.stats import pct

MODEL = "orchard-tiny"
# Prompts whose greedy continuation, with the end-of-turn token banned, runs to max_tokens.
PROMPTS = ["Hello!", "Tell me about the ocean.", "List five of the largest cities in the world.",
           "What has keys but can't open locks?"]


@dataclass
class Seen:
    prompt: int
    text: str = ""
    finish: str | None = None
    error: str | None = None
    gaps: list[float] = field(default_factory=list)

    @property
    def longest_gap(self) -> float:
        return max(self.gaps, default=0.0)


def body(prompt: int, tokens: int, eos_bias: dict[str, int]) -> dict[str, object]:
    return {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": tokens,
            "logit_bias": eos_bias, "messages": [{"role": "user", "content": PROMPTS[prompt]}]}


async def stream(client: httpx.AsyncClient, prompt: int, tokens: int,
                 eos_bias: dict[str, int]) -> Seen:
    seen = Seen(prompt)
    last = time.monotonic()
    async with client.stream("POST", f"{BASE}/v1/chat/completions",
                             json=body(prompt, tokens, eos_bias)) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            seen.gaps.append(now - last)
            last = now
            chunk = json.loads(line[6:])
            if "error" in chunk:
                seen.error = chunk["error"].get("message", "error")
                continue
            for choice in chunk["choices"]:
                seen.text += choice["delta"].get("content") or ""
                seen.finish = choice.get("finish_reason") or seen.finish
    return seen


def replica_pids(server: int) -> list[int]:
    """The model's replica processes under `serve run` (Ray names them by deployment)."""
    pids = []
    for pid in process_tree(server):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "ray::ServeReplica:" in cmdline and f"model:{MODEL}" in cmdline:
            pids.append(pid)
    return pids


async def killer(server: int, args: argparse.Namespace, kills: list[float]) -> None:
    rng = random.Random(args.seed)
    while len(kills) < args.kills:
        await asyncio.sleep(args.kill_every * rng.uniform(0.5, 1.5))
        pids = replica_pids(server)
        if pids:
            os.kill(rng.choice(pids), signal.SIGKILL)
            kills.append(time.monotonic())


async def measure(server: int, args: argparse.Namespace,
                  eos_bias: dict[str, int]) -> tuple[dict[int, Seen], list[Seen], list[float]]:
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        reference = {i: await stream(client, i, args.tokens, eos_bias)
                     for i in range(len(PROMPTS))}
        kills: list[float] = []
        faults = asyncio.create_task(killer(server, args, kills))
        seen: list[Seen] = []
        end = time.monotonic() + args.duration
        wave = 0
        while time.monotonic() < end:
            prompts = [(wave * args.streams + i) % len(PROMPTS) for i in range(args.streams)]
            seen += await asyncio.gather(*(stream(client, p, args.tokens, eos_bias)
                                           for p in prompts))
            wave += 1
        faults.cancel()
        return reference, seen, kills


def eos_bias() -> dict[str, int]:
    from transformers import AutoTokenizer

    from replicas.builtin import ensure_builtin

    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin("tiny"))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    return {str(i): -100 for i in ids}


def report(reference: dict[int, Seen], seen: list[Seen], kills: list[float],
           args: argparse.Namespace) -> dict[str, object]:
    intact = [s for s in seen if s.error is None and s.text == reference[s.prompt].text
              and s.finish == reference[s.prompt].finish]
    failed = [s for s in seen if s.error is not None]
    resumed = [s for s in seen if s.longest_gap > args.gap_s]
    added = [s.longest_gap for s in resumed if s.error is None]
    result: dict[str, object] = {
        "streams": len(seen), "completed": len(seen) - len(failed), "intact": len(intact),
        "failed": len(failed), "kills": len(kills), "paused": len(resumed),
        "pause_s": {"median": statistics.median(added) if added else None,
                             "p95": pct(added, 0.95) if added else None,
                             "min": min(added, default=None), "max": max(added, default=None)},
        "healthy_gap_s_median": statistics.median(
            [g for s in seen if s.longest_gap <= args.gap_s for g in s.gaps[1:]] or [0.0]),
        "errors": sorted({s.error for s in failed if s.error}),
        "args": vars(args) | {"out": str(args.out)},
    }
    print(f"streams {result['streams']}: completed {result['completed']}, intact "
          f"{result['intact']}, failed {result['failed']}; replicas killed {len(kills)}, "
          f"streams paused past {args.gap_s:g} s {len(resumed)}")
    if added:
        print(f"longest pause of a paused stream: median {statistics.median(added):.2f} s, "
              f"p95 {pct(added, 0.95):.2f} s (min {min(added):.2f}, max {max(added):.2f})")
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams per wave")
    parser.add_argument("--tokens", type=int, default=300, help="greedy tokens per stream")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of waves")
    parser.add_argument("--kills", type=int, default=3, help="replica processes killed")
    parser.add_argument("--kill-every", type=float, default=15.0, help="mean seconds apart")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--gap-s", type=float, default=0.3,
                        help="a pause longer than this between chunks is reported")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT / "bench_resume.json")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if port_in_use(8000):
        raise SystemExit("something already listens on 127.0.0.1:8000; refusing to measure it")
    config: dict[str, object] = {
        **serve_settings(8000),
        "applications": [{"name": "orchard", "route_prefix": "/",
                          "import_path": "deployments.app:build_app",
                          "args": {"ingress": {"colocate": False,
                                               "request_timeout_s": args.request_timeout},
                                   "models": [{"id": MODEL, "source": "builtin:tiny",
                                               "num_replicas": args.replicas}]}}]}
    bias = eos_bias()
    server = run_config(config, [MODEL])
    try:
        reference, seen, kills = asyncio.run(measure(server.pid, args, bias))
    finally:
        stop_server(server)
    result = report(reference, seen, kills, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**result, "streams_seen": [asdict(s) | {"gaps": None}
                                                              for s in seen]}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
