"""Serving throughput: raw mlx-lm in-process vs Orchard over HTTP, same model, one run.

    python -m load.serving.overhead --model builtin:bench --tokens 128

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
import os
import statistics
import time

from load.harness.clients import http_streams
from load.harness.process_cpu import CpuSnapshot, per_token_table
from load.harness.prompts import PROMPT
from load.harness.servers import LAYOUTS, paused
from load.harness.stats import Run, median_interval, median_run, pct
from load.harness.targets import RawModel
from load.serving.driver import Live, orchard_server, serve_levels


def pair_prompt(index: int) -> str:
    """Each raw/HTTP pair's own prompt: Orchard's prefix cache would otherwise skip the
    prefill of a prompt it has seen, which raw mlx-lm never does."""
    return f"Story {index}. {PROMPT}"


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
    raw_runs: list[Run] = []
    http_runs: list[Run] = []
    spent: dict[str, float] = {}
    raw_cpu = 0.0
    server = orchard_server("orchard", args.model, "bench", flush_ms=args.flush_ms,
                            layout=args.layout, haproxy=args.haproxy, metrics=not args.no_metrics)

    def pairs(live: Live) -> None:
        """Single streams alternate raw and HTTP, so the machine's drift hits both alike."""
        nonlocal raw_cpu
        assert live.proc is not None
        for index in range(args.repeat):
            text = pair_prompt(index)
            with paused(live.proc.pid):
                cpu = time.process_time()
                raw_runs.append(raw.single(args.tokens, text))
                raw_cpu += time.process_time() - cpu
            before = CpuSnapshot.take(live.pids())
            http_runs.append(asyncio.run(http_streams(1, args.tokens, "bench", text)))
            for name, seconds in CpuSnapshot.take(live.pids()).since(before).items():
                spent[name] = spent.get(name, 0.0) + seconds
            live.check()

    http_many = serve_levels(server, args.concurrency,
                             lambda _, c: asyncio.run(http_streams(c, args.tokens, "bench")),
                             before=pairs)
    raw1, http1 = median_run(raw_runs), median_run(http_runs)
    pair_ratios = sorted(h.rate / r.rate for r, h in zip(raw_runs, http_runs))

    print(f"model {args.model}, {args.tokens} tokens per request, greedy, "
          f"stream_flush_ms {args.flush_ms:g}, layout {args.layout}"
          f"{', HAProxy direct ingress' if args.haproxy else ''}"
          f"{', metrics off' if args.no_metrics else ''}")
    print(f"{'run':<34}{'tokens/s':>10}{'ratio':>10}{'TTFT p50 ms':>14}")
    print(f"{'raw mlx_lm.stream_generate x1':<34}{raw1.rate:>10.1f}{1.0:>10.2f}{raw1.ttft[0]*1e3:>14.1f}")
    for c, run in raw_batches.items():
        print(f"{f'raw BatchGenerator x{c}':<34}{run.rate:>10.1f}{run.rate / raw1.rate:>10.2f}{'':>14}")
    print(f"{'orchard HTTP x1':<34}{http1.rate:>10.1f}{http1.rate / raw1.rate:>10.2f}{pct(http1.ttft, .5)*1e3:>14.1f}")
    for c, run in http_many.items():
        print(f"{f'orchard HTTP x{c}':<34}{run.rate:>10.1f}{run.rate / http1.rate:>10.2f}"
              f"{pct(run.ttft, .5)*1e3:>14.1f}   (ratio vs orchard x1; vs raw batched "
              f"{run.rate / raw_batches[c].rate:.2f})")
    low, high = median_interval(pair_ratios)
    print(f"single stream, {args.repeat} alternating raw/HTTP pairs: HTTP/raw median "
          f"{statistics.median(pair_ratios):.3f} (90% bootstrap interval {low:.3f}-{high:.3f}), "
          f"range {pair_ratios[0]:.2f}-{pair_ratios[-1]:.2f} (x1 rows above are the median runs)")
    overhead_ms = (1 / http1.rate - 1 / raw1.rate) * 1e3
    print(f"serving-path overhead per token (single stream): {overhead_ms:.3f} ms "
          f"(raw decode {1e3 / raw1.rate:.3f} ms/token)")
    raw_cpu_ms = raw_cpu * 1e3 / sum(r.count for r in raw_runs)
    print(f"CPU per token by process over the single-stream HTTP runs (raw mlx-lm in-process: "
          f"{raw_cpu_ms:.2f} ms CPU/token):")
    print("\n".join(per_token_table(spent, sum(r.count for r in http_runs), raw_cpu_ms)))


if __name__ == "__main__":
    main()
