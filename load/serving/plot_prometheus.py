"""A PNG of what Prometheus scraped during a run: TTFT p50/p99 and output tokens/s.

    python -m load.serving.plot_prometheus --prometheus http://127.0.0.1:9090 \\
        --start 1700000000 --end 1700000060 --out docs/observability-run.png

Queries the same expressions as the dashboard (`docs/grafana-dashboard.json`) over
`--start`..`--end` (Unix seconds) and plots them, so a README can show a real run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

WINDOW = "15s"  # rate window: a few scrapes at the 1-5 s intervals a short run uses
TTFT = ("histogram_quantile({q}, sum by (le) "
        f"(rate(orchard_time_to_first_token_seconds_bucket[{WINDOW}])))")
TOKENS = f"sum(rate(orchard_output_tokens_total[{WINDOW}]))"


def query_range(base: str, expr: str, start: float, end: float,
                step: float) -> list[tuple[float, float]]:
    answer = httpx.get(f"{base}/api/v1/query_range", timeout=30, params={
        "query": expr, "start": start, "end": end, "step": step}).json()
    if answer.get("status") != "success":
        raise RuntimeError(f"{expr}: {answer}")
    result = answer["data"]["result"]
    if not result:
        return []
    return [(float(t), float(v)) for t, v in result[0]["values"] if v not in ("NaN", "+Inf")]


def plot(base: str, start: float, end: float, out: Path, step: float = 2.0) -> Path:
    series = {f"TTFT p{int(q * 100)}": query_range(base, TTFT.format(q=q), start, end, step)
              for q in (0.5, 0.99)}
    tokens = query_range(base, TOKENS, start, end, step)
    if not tokens or not any(series.values()):
        raise RuntimeError("Prometheus has no orchard_* samples in that range")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for label, points in series.items():
        top.plot([t - start for t, _ in points], [v * 1000 for _, v in points], label=label)
    top.set_ylabel("time to first token (ms)")
    top.legend(loc="upper right")
    top.grid(alpha=0.3)
    bottom.plot([t - start for t, _ in tokens], [v for _, v in tokens], color="tab:green")
    bottom.set_ylabel("output tokens/s")
    bottom.set_xlabel("seconds into the run")
    bottom.grid(alpha=0.3)
    fig.suptitle("Orchard metrics scraped by Prometheus during a Locust run")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--start", type=float, required=True, help="Unix seconds")
    parser.add_argument("--end", type=float, required=True, help="Unix seconds")
    parser.add_argument("--step", type=float, default=2.0, help="seconds between points")
    parser.add_argument("--out", type=Path, default=Path("docs/observability-run.png"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(plot(args.prometheus, args.start, args.end, args.out, args.step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
