"""A PNG of a Locust run over time: TTFT, ITL and throughput, from `<prefix>_stats_history.csv`.

Needs the per-payload history rows, which locust writes with `--csv-full-history` (run_load
adds it with `--plot`). Each history row holds the percentiles of a recent window, so the
lines show how latency moved during the run rather than its totals.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI

import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen


def _number(text: str) -> float | None:
    return None if text in ("", "N/A") else float(text)


def read_history(path: Path) -> dict[str, dict[float, list[dict[str, str]]]]:
    """Type -> timestamp -> that second's rows (one per payload), the aggregate left out."""
    by_type: dict[str, dict[float, list[dict[str, str]]]] = defaultdict(lambda: defaultdict(list))
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["Name"] != "Aggregated" and row["Type"]:
                by_type[row["Type"]][float(row["Timestamp"])].append(row)
    return by_type


def _latency(rows_at: dict[float, list[dict[str, str]]], start: float,
             column: str, worst: bool) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for stamp in sorted(rows_at):
        values = [v for r in rows_at[stamp] if (v := _number(r[column])) is not None]
        if values:
            xs.append(stamp - start)
            ys.append(max(values) if worst else sum(values) / len(values))
    return xs, ys


def plot_history(history_csv: Path, out_png: Path) -> Path:
    """Write the PNG; raises ValueError when the history has no per-payload rows."""
    by_type = read_history(history_csv)
    if not by_type.get("TTFT") and not by_type.get("POST"):
        raise ValueError(f"{history_csv} has no per-payload rows; run locust with "
                         "--csv-full-history (load/locust/run_load.py --plot does)")
    start = min(stamp for rows_at in by_type.values() for stamp in rows_at)
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for ax, kind in zip(axes[:2], ("TTFT", "ITL")):
        rows_at = by_type.get(kind, {})
        ax.plot(*_latency(rows_at, start, "50%", worst=False), label="p50 (mean over payloads)")
        ax.plot(*_latency(rows_at, start, "95%", worst=True), label="p95 (worst payload)")
        ax.set_ylabel(f"{kind} (ms)")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
    streams, tokens = [], []
    for stamp in sorted(by_type.get("POST", {})):
        streams.append((stamp - start, sum(_number(r["Requests/s"]) or 0.0
                                           for r in by_type["POST"][stamp])))
    for stamp in sorted(by_type.get("TOKENS", {})):
        # Completed streams per second times their median length: about output tokens/s.
        rate = sum((_number(r["Requests/s"]) or 0.0) * (_number(r["50%"]) or 0.0)
                   for r in by_type["TOKENS"][stamp])
        tokens.append((stamp - start, rate))
    ax = axes[2]
    if tokens:
        ax.plot(*zip(*tokens), label="output tokens/s (approx.)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    if streams:
        right = ax.twinx()
        right.plot(*zip(*streams), color="tab:green", label="requests/s")
        right.set_ylabel("requests/s")
        right.legend(loc="upper left")
    if tokens:
        ax.legend(loc="upper right")
    axes[2].set_xlabel("seconds into the run")
    fig.suptitle(f"Locust run: {history_csv.name}")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
