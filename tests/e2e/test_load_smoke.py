"""A short headless Locust run against the session's `serve run`: the CI load smoke test.

Every workload runs with its output checks on, so besides "no request failed" this also
says that stops, guided JSON and reasoning stay exact while requests share a batch.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from load.run_load import main as run_load

pytestmark = pytest.mark.e2e

USERS = 4
RUN_TIME = "20s"
# Loose on purpose: a shared 2-core CI box has TTFT spikes; this catches stalls, not speed
# (speed targets live in the benchmarks).
MAX_P95_TTFT_MS = 5000


def test_locust_run_has_no_failures_and_reports_ttft(server: str, tmp_path: Path) -> None:
    prefix = tmp_path / "smoke"
    code = run_load([
        "--host", server, "--users", str(USERS), "--spawn-rate", str(USERS), "--run-time", RUN_TIME,
        "--csv", str(prefix), "--html", str(tmp_path / "smoke.html"),
        "--max-failure-ratio", "0", "--max-p95-ttft-ms", str(MAX_P95_TTFT_MS),
    ])
    log = Path(f"{prefix}_locust.log")
    assert code == 0, log.read_text()[-5000:] if log.exists() else "no locust log"

    with open(f"{prefix}_stats.csv", newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] != "Aggregated"]
    requests = [r for r in rows if r["Type"] == "POST"]
    assert sum(int(r["Request Count"]) for r in requests) >= USERS
    assert all(int(r["Failure Count"]) == 0 for r in rows)
    ttft = [r for r in rows if r["Type"] == "TTFT"]
    assert ttft and all(int(r["Request Count"]) > 0 for r in ttft)
    assert (tmp_path / "smoke.html").stat().st_size > 0
