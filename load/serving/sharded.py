"""One model on one process vs sharded over two (issue 22), same server, same run.

    python -m load.serving.sharded --rounds 3 --tokens 64

Starts one `serve run` on 127.0.0.1 serving `builtin:bench` twice: `bench` (whole) and
`bench-x2` (`shards: 2`, tensor parallel, the ranks on loopback). Each round measures both,
in alternating order, at 1 and 8 concurrent streams: aggregate tokens/s and the median
TTFT over HTTP, and for the sharded model the collective time per step (rank 0's wait for
the other rank to take the step's batch record, from the deployment's own counters).
Prints each figure's median over the rounds with its spread (min-max), and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from load.harness.clients import http_streams
from load.harness.serve_settings import serve_settings
from load.harness.servers import PORT, run_config, stop_server
from load.harness.stats import at_least_three, Run, spread

MODELS = {"bench": 1, "bench-x2": 2}


def config(source: str) -> dict[str, Any]:
    models = [{"id": name, "source": source, "shards": shards, "max_ongoing_requests": 64,
               # Loopback only: both ranks run here.
               **({"distributed": {"host": "127.0.0.1"}} if shards > 1 else {})}
              for name, shards in MODELS.items()]
    return {**serve_settings(PORT),
            "applications": [{"name": "orchard", "route_prefix": "/",
                              "import_path": "deployments.app:build_app",
                              "args": {"models": models,
                                       "observability": {"request_logs": False}}}]}


def sync_totals() -> tuple[int, float]:
    """The sharded replica's steps and seconds spent syncing so far (its `stats`)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address="auto", namespace="serve", log_to_driver=False)
    stats = serve.get_deployment_handle("model:bench-x2", app_name="orchard") \
        .stats.remote().result()
    return int(stats["sync_steps"]), float(stats["sync_seconds"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", default="builtin:bench")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    return parser


def main() -> None:
    args = build_parser().parse_args()
    at_least_three(args.rounds, "--rounds")
    proc = run_config(config(args.source), list(MODELS))
    tps: dict[tuple[str, int], list[float]] = {}
    ttft: dict[tuple[str, int], list[float]] = {}
    sync_ms: dict[int, list[float]] = {}
    try:
        for r in range(args.rounds):
            order = list(MODELS) if r % 2 == 0 else list(reversed(MODELS))
            for model in order:
                for c in args.concurrency:
                    before = sync_totals() if MODELS[model] > 1 else None
                    run: Run = asyncio.run(http_streams(c, args.tokens, model,
                                                        f"Round {r}. Tell me a story."))
                    tps.setdefault((model, c), []).append(run.rate)
                    ttft.setdefault((model, c), []).append(statistics.median(run.ttft))
                    if before is not None:
                        steps, seconds = (a - b for a, b in zip(sync_totals(), before))
                        sync_ms.setdefault(c, []).append(1000 * seconds / max(1, steps))
                    print(f"round {r + 1} {model} x{c}: {run.rate:.1f} tok/s", flush=True)
    finally:
        stop_server(proc)
    print(f"\n{args.source}, {args.tokens} tokens per stream, {args.rounds} rounds "
          "(median, min-max):")
    print("| streams | shards | tok/s | TTFT ms | sync ms/step | tok/s vs 1 shard |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        base = statistics.median(tps[("bench", c)])
        for model, shards in MODELS.items():
            ratio = statistics.median(tps[(model, c)]) / base
            sync = spread(sync_ms[c]).text(".2f") if shards > 1 else "-"
            print(f"| {c} | {shards} | {spread(tps[(model, c)]).text('.1f')} | "
                  f"{spread([t * 1000 for t in ttft[(model, c)]]).text('.0f')} | {sync} | "
                  f"{ratio:.2f}x |")


if __name__ == "__main__":
    main()
