"""The ceiling (issue 23): on a near-zero-cost model the serving path, not decode, sets
throughput. Raw mlx-lm, Orchard and mlx_lm.server on `builtin:ceiling`, same 2 cores.

    python -m load.serving.ceiling

At each of `--streams` concurrent streams, `--tokens` greedy tokens per request:

- raw: mlx-lm's `BatchGenerator` in this process (`RawModel.batched`, one sequence at 1):
  all N sequences start and end together, so no row ever joins or leaves mid-batch;
- raw_arrivals: the same engine, N sequences in flight, each replaced the step it ends, as
  the servers' closed loop of clients does (`RawModel.arrivals`): what joining and leaving
  cost mlx-lm itself, without HTTP. Reported beside the targets, which stay against raw;
- orchard: a real `serve run` of the shipped settings, default layout: its replica serves
  127.0.0.1:8000 itself (`--via-proxy`: the same server through Serve's proxy at 8001);
- mlx_server: `mlx_lm.server` on the same model files, on 127.0.0.1:8102, with the batching
  limits of `load/serving/vs_mlx_server.py` (32 decoding, 8 prefilling: Orchard's defaults).

`--rounds` alternating rounds (raw, then Orchard started / all levels / stopped, then
mlx_lm.server the same), never two servers at once, so the machine's drift hits all three
alike. A level is a warm-up request, then a closed loop of N workers making `--waves`
requests each; tok/s = tokens from usage / wall seconds. Every prompt has a unique hash
prefix (no prefix cache helps). `builtin:ceiling` never picks EOS (its special tokens' logits
are 0, far below its best), so nothing is sent to suppress it, as raw runs nothing either:
a `logit_bias` is a logits processor, which mlx-lm applies row by row in Python and which
halves a 32-row batch's rate on this model (`--eos-bias` adds it to both servers). Each
request makes exactly `--tokens`; a failed or short request adds 0 tokens, as an error.
Reports medians over rounds with min-max, orchard/raw and orchard/mlx_server as the median
of per-round ratios, CPU ms per token by process, the load generator's own, and the issue's
targets. Writes load/out/bench_ceiling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from load.harness.servers import OUT, eos_bias, local_path, mlx_server
from load.harness.stats import spread
from load.harness.targets import TARGETS as TABLE
from load.harness.targets import RawModel
from load.serving.driver import (MODEL_ID, LevelRun, Live, arrivals_level, command_server,
                                 measure_http, orchard_flush_ms, orchard_server, raw_level,
                                 serve_levels)

# The preset's targets, from the harness's table (`--via-proxy`: orchard_proxy's port).
TARGETS = ("raw", "raw_arrivals", "orchard", "mlx_server")
RAW = tuple(t for t in TARGETS if TABLE[t].port is None)  # in this process, no HTTP
SERVERS = tuple(t for t in TARGETS if TABLE[t].port is not None)


def one_round(index: int, raw: RawModel, model_path: Path, bias: dict[str, float],
              args: argparse.Namespace) -> dict[str, dict[int, LevelRun]]:
    runs: dict[str, dict[int, LevelRun]] = {t: {} for t in TARGETS}

    def show(target: str, n: int, run: LevelRun) -> None:
        print(f"  round {index + 1} {target:<11} x{n:<3}{run.tps:>9.1f} tok/s"
              f"{f'  {run.errors} errors' if run.errors else ''}", flush=True)

    for n in args.streams:
        runs["raw"][n] = raw_level(raw, n, args)
        show("raw", n, runs["raw"][n])
        runs["raw_arrivals"][n] = arrivals_level(raw, n, args, f"r{index}-arrivals-x{n}")
        show("raw_arrivals", n, runs["raw_arrivals"][n])
    settings = {} if args.chunks_per_s is None else {"stream_chunks_per_s": args.chunks_per_s}
    connect = TABLE["orchard_proxy" if args.via_proxy else "orchard"].port
    assert connect is not None
    target, command = mlx_server(model_path, prompt_cache=True)  # as shipped
    servers = {
        "orchard": orchard_server("orchard", args.model, MODEL_ID, connect=connect, wait=True,
                                  flush_ms=args.flush_ms, layout="default",
                                  haproxy=args.haproxy, settings=settings,
                                  actor_calls=args.actor_calls),
        "mlx_server": command_server(target, command, OUT / "bench_ceiling_mlx_server.log"),
    }
    tags = {"orchard": "orchard", "mlx_server": "mlx"}
    for name in SERVERS:
        def measure(live: Live, n: int, name: str = name) -> LevelRun:
            run = measure_http(live, n, args, bias, f"r{index}-{tags[name]}-x{n}")
            show(name, n, run)
            return run

        runs[name] = serve_levels(servers[name], args.streams, measure)
    return runs


def fmt(values: list[float], width: int = 22) -> str:
    return f"{spread(values).text('.0f'):>{width}}"


def summarize(rounds: list[dict[str, dict[int, LevelRun]]],
              args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    levels: dict[str, dict[str, Any]] = {}
    for n in args.streams:
        tps = {t: [r[t][n].tps for r in rounds] for t in TARGETS}
        # Paired within a round (same drift), then the median over rounds.
        vs_raw = [r["orchard"][n].tps / r["raw"][n].tps for r in rounds]
        vs_mlx = [r["orchard"][n].tps / max(r["mlx_server"][n].tps, 1e-9) for r in rounds]
        vs_arrivals = [r["orchard"][n].tps / r["raw_arrivals"][n].tps for r in rounds]
        cpu: dict[str, dict[str, float]] = {}
        for t in TARGETS:
            tokens = sum(r[t][n].tokens for r in rounds) or 1
            spent: dict[str, float] = defaultdict(float)
            for r in rounds:
                for role, seconds in r[t][n].cpu_s.items():
                    spent["mlx_lm.server" if t == "mlx_server" else role] += seconds
                if t not in RAW:
                    spent["load generator"] += r[t][n].loadgen_cpu_s
            cpu[t] = {role: s * 1e3 / tokens for role, s in spent.items()}
        threads: dict[str, dict[str, float]] = {}
        for t in ("raw", "orchard"):
            tokens = sum(r[t][n].tokens for r in rounds) or 1
            by_kind: dict[str, float] = defaultdict(float)
            for r in rounds:
                for kind, seconds in r[t][n].threads_s.items():
                    by_kind[kind] += seconds
            threads[t] = {kind: s * 1e3 / tokens for kind, s in by_kind.items()}
        levels[str(n)] = {
            "tps": {t: spread(v)._asdict() for t, v in tps.items()},
            "per_round_tps": tps,
            "orchard_over_raw": spread(vs_raw)._asdict(),
            "orchard_over_mlx_server": spread(vs_mlx)._asdict(),
            "orchard_over_raw_arrivals": spread(vs_arrivals)._asdict(),
            "ttft_p50_ms": {t: statistics.median(statistics.median(r[t][n].ttft_ms)
                                                 for r in rounds if r[t][n].ttft_ms)
                            for t in SERVERS if any(r[t][n].ttft_ms for r in rounds)},
            "cpu_ms_per_token": cpu,
            "decoding_process_threads_ms_per_token": threads,
            "errors": {t: sum(r[t][n].errors for r in rounds) for t in TARGETS},
            "requests": {t: sum(r[t][n].requests for r in rounds) for t in TARGETS},
        }
    return levels


# (streams, baseline, minimum orchard/baseline ratio): issue 34's at 32 streams, issue 23's
# at 1 and 8.
ISSUE_TARGETS = ((32, "raw", 0.7), (32, "mlx_server", 2.0), (1, "raw", 0.7), (8, "raw", 0.5))


def report(levels: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[dict[str, object]]:
    print(f"\nthroughput, output tok/s: median over {args.rounds} rounds (min-max)")
    print(f"{'streams':>7}" + "".join(f"{t:>22}" for t in TARGETS)
          + f"{'orchard/raw':>14}{'orchard/arrivals':>18}{'orchard/mlx':>14}")
    for n, lv in levels.items():
        print(f"{n:>7}" + "".join(fmt(lv["per_round_tps"][t]) for t in TARGETS)
              + f"{lv['orchard_over_raw']['median']:>14.2f}"
              + f"{lv['orchard_over_raw_arrivals']['median']:>18.2f}"
              + f"{lv['orchard_over_mlx_server']['median']:>14.2f}")
    print("ratios: median of the per-round ratios (each round's targets ran back to "
          "back); their min-max:")
    for n, lv in levels.items():
        a, b = lv["orchard_over_raw"], lv["orchard_over_mlx_server"]
        c = lv["orchard_over_raw_arrivals"]
        print(f"  x{n:<3} orchard/raw {a['min']:.2f}-{a['max']:.2f}   "
              f"orchard/raw_arrivals {c['min']:.2f}-{c['max']:.2f}   "
              f"orchard/mlx_server {b['min']:.2f}-{b['max']:.2f}")
    print("raw batches all N sequences at once; raw_arrivals keeps N in flight, one joining "
          "as one leaves (no HTTP); both servers decode at most 32 together.")

    print("\nTTFT p50 ms (median over rounds): "
          + "; ".join(f"x{n} " + ", ".join(f"{t} {v:.0f}" for t, v in lv["ttft_p50_ms"].items())
                      for n, lv in levels.items()))

    print("\nCPU ms per output token, by process (all rounds' CPU / all rounds' tokens; "
          "total: the target's own processes, the load generator apart):")
    for n, lv in levels.items():
        for t in TARGETS:
            rows = sorted(lv["cpu_ms_per_token"][t].items(), key=lambda kv: -kv[1])
            total = sum(ms for role, ms in rows if role != "load generator")
            print(f"  x{n:<3} {t:<11} total {total:7.3f}   "
                  + ", ".join(f"{role} {ms:.3f}" for role, ms in rows if ms >= 0.0005))

    print("\nthe decoding process's CPU ms per output token, by thread (raw: this process; "
          "orchard: its model replica; the batch's Python loop is raw's main thread and "
          "orchard-engine):")
    for n, lv in levels.items():
        for t, kinds in lv["decoding_process_threads_ms_per_token"].items():
            print(f"  x{n:<3} {t:<11} " + ", ".join(
                f"{kind} {ms:.3f}" for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1])))

    errors = {f"{t} x{n}": e for n, lv in levels.items() for t, e in lv["errors"].items() if e}
    print("\nerrors: " + (", ".join(f"{k}: {v}" for k, v in errors.items()) if errors else
                          "none (every request made exactly --tokens tokens)"))

    verdicts = []
    print("\ntargets (orchard / baseline, median of per-round ratios)")
    for streams, base, minimum in ISSUE_TARGETS:
        at = levels.get(str(streams))
        ratio = at[f"orchard_over_{base}"]["median"] if at else None
        verdict = "not run" if ratio is None else "PASS" if ratio >= minimum else "MISS"
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        print(f"  {streams:>2} stream{'s' if streams > 1 else ' '}  orchard >= {f'{minimum:g}x':<4} {base:<11} measured "
              f"{shown:>6}  {verdict}")
        verdicts.append({"streams": streams, "baseline": base, "minimum": minimum,
                         "measured": ratio, "verdict": verdict})
    return verdicts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:ceiling", help="model source")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="concurrent streams per level")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--waves", type=int, default=2, help="requests per worker per level")
    parser.add_argument("--flush-ms", type=float, default=None,
                        help="Orchard's stream_flush_ms (default: Orchard's own, 5 today)")
    parser.add_argument("--chunks-per-s", type=float, default=None,
                        help="Orchard's stream_chunks_per_s (default: Orchard's own; 0: no "
                             "bound, one chunk per engine step as before issue 23)")
    parser.add_argument("--haproxy", action="store_true",
                        help="start Ray with Serve's HAProxy direct ingress (README, Layouts): "
                             "no chunk crosses Ray")
    parser.add_argument("--via-proxy", action="store_true",
                        help="send Orchard's requests through Serve's proxy (port 8001), not to "
                             "the replica's own port (8000) as the shipped config's clients do")
    parser.add_argument("--actor-calls", action="store_true",
                        help="with --via-proxy: Serve's own default transport between its proxy "
                             "and the replica (Ray actor calls), not the gRPC that "
                             "serve_config.yaml sets")
    parser.add_argument("--eos-bias", action="store_true",
                        help="send a logit_bias against EOS to both servers (for a model that "
                             "may end early; builtin:ceiling never does)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=OUT / "bench_ceiling.json")
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.haproxy and args.via_proxy:
        parser.error("--haproxy puts HAProxy on 8000 and starts no Serve proxy to go through")
    if args.flush_ms is None:
        args.flush_ms = orchard_flush_ms()
    command = shlex.join(["python", "-m", "load.serving.ceiling", *sys.argv[1:]])
    print(f"command: {command}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    model_path = local_path(args.model)  # built before anything starts
    bias = eos_bias(model_path) if args.eos_bias else {}
    raw = RawModel(args.model)
    rounds = []
    for index in range(args.rounds):
        rounds.append(one_round(index, raw, model_path, bias, args))
    eos = "EOS suppressed by logit_bias" if args.eos_bias else "no logit_bias"
    print(f"\nmodel {args.model} ({model_path}), {args.tokens} greedy tokens per request, "
          f"{eos}, {args.rounds} rounds x {args.waves} waves, orchard layout default"
          f"{' behind HAProxy direct ingress' if args.haproxy else ''}"
          f"{' through Serve proxy' if args.via_proxy else ''}"
          f"{', Ray actor calls (Serve default)' if args.actor_calls else ', gRPC (as shipped)'}, "
          f"stream_flush_ms {args.flush_ms:g}, stream_chunks_per_s "
          f"{'default' if args.chunks_per_s is None else f'{args.chunks_per_s:g}'}, mlx_lm.server as shipped (prompt cache on, "
          f"unique prompts); started {started}, load average now "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    levels = summarize(rounds, args)
    verdicts = report(levels, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": command, "started": started, "args": vars(args) | {"out": str(args.out)},
        "levels": levels, "targets": verdicts,
        "rounds": [{t: {n: asdict(run) for n, run in r[t].items()} for t in TARGETS}
                   for r in rounds],
    }, indent=2))
    print(f"\nwrote {args.out}")
    return 1 if any(e for lv in levels.values() for e in lv["errors"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
