"""A short headless Locust run against the session's `serve run`: the CI load smoke test.

Every workload runs with its output checks on, so besides "no request failed" this also
says that stops, guided JSON and reasoning stay exact while requests share a batch.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from load.locust.run_load import main as run_load

pytestmark = pytest.mark.e2e

USERS = 4
RUN_SECONDS = 20
# What the serving path promises at this load: 4 users are far below the model's
# max_ongoing_requests (64), so every request joins the running batch at once and its first
# token is one short prefill away, never a wait for other requests' whole generations
# (E2E 0.3-2.6 s per payload, load/results/locust.md). Measured on a 2-core box, six runs (two of
# each layout): the worst payload's p95 TTFT 180-300 ms in five and 540 ms in the sixth,
# the box's load average at 5 from other runs (310 ms in load/results/locust.md beside a benchmark). 1.5 s is
# about three times the worst of those; serialized requests would wait seconds behind up to
# three others' generations. Speed targets live in the benchmarks.
MAX_P95_TTFT_MS = 1500
# Streams the run must complete: measured 204-335 in 20 s here (about 10 a second) and
# 5.4 a second beside a neighbour's benchmark (load/results/locust.md); 2 a second is under half the
# worst, and a server stalled for 16 of the 20 s falls short even at the best rate seen.
MIN_STREAMS = 2 * RUN_SECONDS


def test_locust_run_has_no_failures_and_reports_ttft(server: str, tmp_path: Path) -> None:
    prefix = tmp_path / "smoke"
    code = run_load([
        "--host", server, "--users", str(USERS), "--spawn-rate", str(USERS),
        "--run-time", f"{RUN_SECONDS}s",
        "--csv", str(prefix), "--html", str(tmp_path / "smoke.html"),
        "--max-failure-ratio", "0", "--max-p95-ttft-ms", str(MAX_P95_TTFT_MS),
    ])
    log = Path(f"{prefix}_locust.log")
    assert code == 0, log.read_text()[-5000:] if log.exists() else "no locust log"

    with open(f"{prefix}_stats.csv", newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] != "Aggregated"]
    requests = [r for r in rows if r["Type"] == "POST"]
    assert sum(int(r["Request Count"]) for r in requests) >= MIN_STREAMS, rows
    assert all(int(r["Failure Count"]) == 0 for r in rows)
    ttft = [r for r in rows if r["Type"] == "TTFT"]
    assert ttft and all(int(r["Request Count"]) > 0 for r in ttft)
    assert (tmp_path / "smoke.html").stat().st_size > 0
