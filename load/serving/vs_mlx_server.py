"""Orchard vs mlx_lm.server: the same model, prompts and client, one server at a time.

    python -m load.serving.vs_mlx_server --model builtin:bench --max-tokens 64

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
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from load.harness.clients import run_level
from load.harness.results import Level, by_prompt, problems
from load.harness.servers import OUT, eos_bias, local_path, mlx_server
from load.harness.targets import orchard_replicas
from load.serving.driver import Live, Server, command_server, serve_levels


def bench(server: Server, args: argparse.Namespace, bias: dict[str, float]) -> list[Level]:
    """The preset's levels on one server: a 4-request warm-up (load, allocate, first
    batches), then `rounds x c` requests (at least `--min-requests`) at each concurrency."""
    def warmup(live: Live) -> None:
        asyncio.run(run_level(live.target, 4, 4, args.max_tokens, "warmup", bias))

    def level(live: Live, c: int) -> Level:
        run = asyncio.run(run_level(live.target, c, max(args.min_requests, args.rounds * c),
                                    args.max_tokens, f"c{c}", bias))
        print(f"  {live.target.label:<22} c={c:<3} {run.summary()['tokens_per_s']:8.1f} tokens/s", flush=True)
        return run

    return list(serve_levels(server, args.concurrency, level, before=warmup).values())


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
    servers += [orchard_replicas(args.model, n, workdir) for n in args.replicas]
    results: dict[str, list[Level]] = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for target, command in servers:
        print(f"{target.label}: starting", flush=True)
        log = OUT / f"bench_{target.label.replace(' ', '_')}.log"
        results[target.label] = bench(command_server(target, command, log), args, bias)

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
