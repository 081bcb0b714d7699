"""A setting against the shipped config, on this box's drift: Orchard serving
`builtin:ceiling` as `load/serving/ceiling.py` starts it (`shipped`), and the same with each
`--variant` changed, one server after another in an order that rotates every round.

    python -m load.serving.settings_ab --variant 'nice0={"model": {"ray_actor_options":
        {"num_cpus": 0, "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}}}}'

A variant is NAME=JSON. Its `model` keys merge into the model's entry under `models:` (as a
user writes them); its `app` keys into the application: Serve's `logging_config`, or `args`
merged into Orchard's (`{"app": {"args": {"observability": {"metrics": false}}}}`). A level
is a warm-up request, then `--streams` workers in a closed loop of `--waves` requests each
(`load.serving.driver.measure_http`, with the server's CPU by process). Every variant's ratio is
to the shipped run of the same round, then the median over rounds: on a shared 2-core box
the shipped run alone moves by 10% or more from one server start to the next, and a lever
smaller than that shows only in the paired ratios, if at all. Writes
load/out/bench_settings_ab.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from load.harness.servers import OUT
from load.harness.stats import spread
from load.serving.driver import (MODEL_ID, LevelRun, measure_http, orchard_flush_ms,
                                 orchard_server, serve_levels)

REPLICA = "model replica"  # `process_cpu`'s role for the process that serves HTTP and decodes


@dataclass(frozen=True)
class Variant:
    """The shipped config with `model` merged into the model's entry and `app` into the
    application."""

    name: str
    model: dict[str, Any] = field(default_factory=dict)
    app: dict[str, Any] = field(default_factory=dict)


SHIPPED = Variant("shipped")


def parse_variant(text: str) -> Variant:
    name, sep, body = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: a variant is NAME=JSON")
    try:
        spec = json.loads(body)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"variant {name}: {exc}") from exc
    if not isinstance(spec, dict) or not spec or set(spec) - {"model", "app"} or not all(
            isinstance(v, dict) for v in spec.values()):
        raise argparse.ArgumentTypeError(
            f"variant {name}: the JSON is an object of `model` and/or `app` objects")
    if name.strip() == SHIPPED.name:
        raise argparse.ArgumentTypeError(f"{SHIPPED.name!r} is the baseline's name")
    return Variant(name.strip(), spec.get("model", {}), spec.get("app", {}))


def run_variant(variant: Variant, args: argparse.Namespace, tag: str) -> LevelRun:
    """One server start of `variant`, one measured level, the server stopped."""
    server = orchard_server(variant.name, args.model, MODEL_ID, wait=True,
                            flush_ms=orchard_flush_ms(), settings=variant.model, app=variant.app)
    return serve_levels(server, [args.streams],
                        lambda live, n: measure_http(live, n, args, {}, tag))[args.streams]


def summarize(variants: list[Variant], rounds: list[dict[str, LevelRun]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in variants:
        runs = [r[v.name] for r in rounds]
        ratios = [r[v.name].tps / max(r[SHIPPED.name].tps, 1e-9) for r in rounds]
        tokens = sum(run.tokens for run in runs) or 1
        ttfts = [statistics.median(run.ttft_ms) for run in runs if run.ttft_ms]
        out[v.name] = {
            "spec": {"model": v.model, "app": v.app},
            "per_round_tps": [run.tps for run in runs],
            "tps": spread([run.tps for run in runs])._asdict(),
            "over_shipped": spread(ratios)._asdict(),
            "per_round_over_shipped": ratios,
            "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
            "replica_cpu_ms_per_token": sum(run.cpu_s.get(REPLICA, 0.0) for run in runs)
            * 1e3 / tokens,
            "errors": sum(run.errors for run in runs),
        }
    return out


def report(summary: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n{args.streams} streams, {args.tokens} tokens a request, {args.waves} requests "
          f"a stream; medians over {args.rounds} rounds (min-max)")
    width = max(len("variant"), *(len(name) for name in summary)) + 2
    print(f"{'variant':<{width}}{'tok/s':>22}{'over shipped':>22}{'TTFT p50':>10}"
          f"{'replica CPU ms/tok':>20}{'errors':>8}")
    for name, s in summary.items():
        t, r = s["tps"], s["over_shipped"]
        tps = f"{t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f})"
        ratio = f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
        ttft = "-" if s["ttft_p50_ms"] is None else f"{s['ttft_p50_ms']:.0f} ms"
        print(f"{name:<{width}}{tps:>22}{ratio:>22}{ttft:>10}"
              f"{s['replica_cpu_ms_per_token']:>20.4f}{s['errors']:>8}")
    print("over shipped: each round's tok/s over the shipped run of that round, then the "
          "median; the rounds' order rotates.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME=JSON, repeatable (see above)")
    parser.add_argument("--model", default="builtin:ceiling", help="model source")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per request")
    parser.add_argument("--waves", type=int, default=20,
                        help="requests per stream: long enough for a steady state")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each every variant")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=OUT / "bench_settings_ab.json")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    variants = [SHIPPED, *args.variant]
    if len({v.name for v in variants}) < len(variants):
        raise SystemExit("variant names must differ")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rounds: list[dict[str, LevelRun]] = []
    for index in range(args.rounds):
        turn = index % len(variants)  # drift within a round falls on each variant in turn
        runs: dict[str, LevelRun] = {}
        for v in variants[turn:] + variants[:turn]:
            runs[v.name] = run_variant(v, args, f"r{index}-{v.name}")
            print(f"  round {index + 1} {v.name:<18}{runs[v.name].tps:>9.1f} tok/s"
                  f"{f'  {runs[v.name].errors} errors' if runs[v.name].errors else ''}",
                  flush=True)
        rounds.append(runs)
    summary = summarize(variants, rounds)
    report(summary, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(sys.argv), "started": started,
        "args": {k: v for k, v in vars(args).items() if k not in ("variant", "out")},
        "variants": summary,
        "rounds": [{name: asdict(run) for name, run in r.items()} for r in rounds],
    }, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
