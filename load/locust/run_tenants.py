"""The issue-61 Locust test: a heavy tenant with 48 long streams beside a light tenant sending
one short request at a time; the light tenant's TTFT p95 must stay within 2x its TTFT alone.

    python -m load.locust.run_tenants --seconds 30

Two servers, one after the other (`load.harness.tenant_server`, `builtin:tiny`, a 16-row
batch): Orchard with the two tenants at equal share (fair share), then without tenants
(first come, first served: the baseline). On each, headless Locust runs (its own process,
bounded like `run_load`) the light tenant alone for `--seconds`/2, then both tenants for
`--seconds` after the heavy streams' `--warmup`. Prints each phase's light TTFT p50/p95,
the p95 ratio with the heavy tenant over alone, and the output tokens/s (heavy and light
streams that ended in the run, over its time) with the throughput cost of fair share.
Exit status 1 when fair share's ratio is above `--max-ratio` (2.0, the issue's goal).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from load.harness.servers import eos_bias, local_path
from load.harness.tenant_server import KEYS, MODEL, server
from load.locust.run_load import REPORT_GRACE_S, STOP_TIMEOUT_S, StatsRow, read_stats

LOCUSTFILE = Path(__file__).with_name("tenants.py")


@dataclass(frozen=True)
class Phase:
    ttft: StatsRow | None  # the light tenant's; None: none of its requests got a token
    output_tokens: float  # every stream that ended, both tenants
    seconds: float
    failures: int

    @property
    def p95(self) -> float:
        return float("inf") if self.ttft is None or self.ttft.p95 is None else self.ttft.p95

    def row(self) -> str:
        output = f"output {self.output_tokens / self.seconds:7.1f} tok/s ({self.failures} failed)"
        if self.ttft is None:
            return f"light TTFT: no request got its first token within the run  {output}"
        return (f"light TTFT p50 {self.ttft.median or float('nan'):7.0f} ms  p95 "
                f"{self.p95:7.0f} ms  ({self.ttft.count} requests)  {output}")


def run_phase(base: str, heavy: int, seconds: float, warmup: float, args: argparse.Namespace,
              bias: dict[str, float], prefix: Path) -> Phase:
    """Locust for `seconds` (+ `warmup` with heavy streams); the light tenant starts after
    the warm-up, so only its requests beside a busy replica are timed."""
    run_time = int(seconds + (warmup if heavy else 0))
    classes = ["HeavyTenant", "LightTenant"] if heavy else ["LightTenant"]
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
               "--host", base, "--users", str(heavy + 1), "--spawn-rate", "100",
               "--run-time", f"{run_time}s", "--stop-timeout", "0", "--csv", str(prefix),
               "--only-summary", "--exit-code-on-error", "0", "--model", MODEL,
               "--heavy-users", str(heavy), "--heavy-tokens", str(args.heavy_tokens),
               "--light-tokens", str(args.light_tokens),
               "--light-delay", str(warmup if heavy else 0), "--logit-bias", json.dumps(bias),
               *classes]
    env_keys = {"ORCHARD_HEAVY_KEY": KEYS["heavy"], "ORCHARD_LIGHT_KEY": KEYS["light"]}
    log = prefix.with_name(prefix.name + "_locust.log")
    with log.open("w") as out:
        code = subprocess.run(command, check=False, stdout=out, stderr=subprocess.STDOUT,
                              timeout=run_time + STOP_TIMEOUT_S + REPORT_GRACE_S,
                              env={**os.environ, **env_keys}).returncode
    if code != 0 or not Path(f"{prefix}_stats.csv").exists():
        raise SystemExit(f"locust exited with {code}; log: {log}\n{log.read_text()[-2000:]}")
    rows = {(r.kind, r.name): r for r in read_stats(str(prefix))}
    ttft = rows.get(("TTFT", "light"))  # none: its one request waited past the run
    tokens = sum((r.average or 0) * r.count for (kind, _), r in rows.items() if kind == "TOKENS")
    failures = sum(r.failures for (kind, _), r in rows.items() if kind == "POST")
    return Phase(ttft, tokens, float(run_time), failures)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heavy", type=int, default=48, help="the heavy tenant's streams")
    parser.add_argument("--rows", type=int, default=16, help="the replica's max_batch_size")
    parser.add_argument("--seconds", type=float, default=30.0, help="the phase with both")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--heavy-tokens", type=int, default=256)
    parser.add_argument("--light-tokens", type=int, default=8)
    parser.add_argument("--max-ratio", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("load/out/tenants"))
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the server without tenants (first come)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bias = eos_bias(local_path("builtin:tiny"))
    servers = [("fair share (tenants)", True)]
    if not args.no_baseline:
        servers.append(("first come (no tenants)", False))
    results: dict[str, tuple[Phase, Phase]] = {}
    for label, tenants in servers:
        tag = "fair" if tenants else "fifo"
        with server(tenants, args.rows) as base:
            alone = run_phase(base, 0, args.seconds / 2, 0, args, bias,
                              args.out / f"{tag}_alone")
            mixed = run_phase(base, args.heavy, args.seconds, args.warmup, args, bias,
                              args.out / f"{tag}_mixed")
        results[label] = (alone, mixed)
        print(f"{label}\n  alone:       {alone.row()}\n  with heavy:  {mixed.row()}",
              flush=True)
    ratios = {label: mixed.p95 / alone.p95 for label, (alone, mixed) in results.items()}
    for label, ratio in ratios.items():
        print(f"{label}: light TTFT p95 with heavy / alone = {ratio:.2f}x")
    if len(results) == 2:
        (_, fair), (_, fifo) = results.values()
        cost = 1 - (fair.output_tokens / fair.seconds) / (fifo.output_tokens / fifo.seconds)
        print(f"throughput cost of fair share: {cost * 100:+.1f}% of first come's output tok/s")
    ok = ratios["fair share (tenants)"] <= args.max_ratio
    print(f"{'PASS' if ok else 'FAIL'}: fair share's ratio "
          f"{ratios['fair share (tenants)']:.2f}x against the goal {args.max_ratio:g}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
