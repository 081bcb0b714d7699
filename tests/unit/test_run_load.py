"""`load/locust/run_load.py`'s verdicts, failing paths included, without a server or locust: the
e2e smoke run only ever sees a passing run, so these show each threshold can fail it."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path
from typing import Any

import pytest

from load.locust import run_load
from load.locust.run_load import StatsRow, evaluate, read_stats

CSV_HEADER = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time",
              "Average Response Time", "95%", "99%"]


def post(name: str, count: int, failures: int = 0) -> StatsRow:
    return StatsRow("POST", name, count, failures, 10.0, 10.0, 20.0, 30.0)


def ttft(name: str, p95: float | None) -> StatsRow:
    return StatsRow("TTFT", name, 5, 0, 5.0, 5.0, p95, p95)


def test_a_clean_run_passes() -> None:
    rows = [post("chat", 10), ttft("chat", 150.0), post("messages", 4), ttft("messages", 900.0)]
    assert evaluate(rows, max_failure_ratio=0.0, max_p95_ttft_ms=1000.0) == []


@pytest.mark.parametrize("rows", [
    [],  # locust wrote no rows at all
    [post("chat", 0)],  # rows, but no request
    [post("chat", 3, failures=3), ttft("chat", 10.0)],  # every request failed
], ids=["no-rows", "no-requests", "all-failed"])
def test_nothing_completed_fails(rows: list[StatsRow]) -> None:
    assert evaluate(rows, max_failure_ratio=1.0, max_p95_ttft_ms=1e9) == ["no request completed"]


def test_failure_ratio_above_the_threshold_fails() -> None:
    rows = [post("chat", 8, failures=1), post("messages", 2, failures=1), ttft("chat", 10.0)]
    assert evaluate(rows, max_failure_ratio=0.2, max_p95_ttft_ms=1e9) == []  # 2/10 = 0.2
    problems = evaluate(rows, max_failure_ratio=0.1, max_p95_ttft_ms=1e9)
    assert problems == ["failure ratio 2/10 = 0.200 > 0.1"]
    assert evaluate(rows, max_failure_ratio=0.0, max_p95_ttft_ms=1e9) != []


def test_metric_rows_do_not_count_as_requests() -> None:
    # A failed TTFT metric row is not a failed request: only POST rows are requests.
    rows = [post("chat", 4), StatsRow("TTFT", "chat", 4, 4, 1.0, 1.0, 2.0, 2.0)]
    assert evaluate(rows, max_failure_ratio=0.0, max_p95_ttft_ms=100.0) == []


def test_missing_ttft_samples_fail() -> None:
    assert evaluate([post("chat", 5)], 0.0, 1e9) == ["no TTFT samples"]


def test_each_payloads_p95_ttft_is_checked() -> None:
    rows = [post("chat", 5), post("messages", 5), ttft("chat", 100.0),
            ttft("messages", 2500.0), ttft("mixed", None)]  # no samples: nothing to judge
    assert evaluate(rows, 0.0, 2000.0) == ["p95 TTFT of messages is 2500 ms > 2000 ms"]
    assert evaluate(rows, 0.0, 2500.0) == []  # at the bound passes
    both = evaluate([post("chat", 5, failures=5)] + rows, 0.0, 50.0)
    assert both[0].startswith("failure ratio 5/15") and len(both) == 3


def test_read_stats_skips_the_aggregate_and_reads_na(tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    write_csv(prefix, [["POST", "chat", "3", "1", "12", "13.5", "40", "50"],
                       ["TTFT", "chat", "2", "0", "N/A", "", "90", "95"],
                       ["", "Aggregated", "5", "1", "12", "13", "90", "95"]])
    rows = read_stats(str(prefix))
    assert rows == [StatsRow("POST", "chat", 3, 1, 12.0, 13.5, 40.0, 50.0),
                    StatsRow("TTFT", "chat", 2, 0, None, None, 90.0, 95.0)]


def write_csv(prefix: Path, rows: list[list[str]]) -> None:
    with open(f"{prefix}_stats.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        writer.writerows(rows)


def fake_locust(monkeypatch: pytest.MonkeyPatch, rows: list[list[str]] | None,
                code: int = 0) -> list[list[str]]:
    """Replace the locust subprocess: it 'writes' these stats rows (None: none) and exits."""
    calls: list[list[str]] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        if rows is not None:
            write_csv(Path(command[command.index("--csv") + 1]), rows)
        return subprocess.CompletedProcess(command, code)

    monkeypatch.setattr(run_load.subprocess, "run", run)
    return calls


def args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--host", "http://127.0.0.1:8000", "--run-time", "1s",
            "--csv", str(tmp_path / "out" / "run"), "--html", str(tmp_path / "out" / "r.html"),
            *extra]


def test_main_exits_1_when_a_threshold_breaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    calls = fake_locust(monkeypatch, [["POST", "chat", "10", "1", "1", "1", "1", "1"],
                                      ["TTFT", "chat", "9", "0", "1", "1", "3000", "3000"]])
    code = run_load.main(args(tmp_path, "--max-failure-ratio", "0",
                              "--max-p95-ttft-ms", "2000"))
    assert code == 1 and len(calls) == 1
    err = capsys.readouterr().err
    assert "FAIL: failure ratio 1/10" in err and "FAIL: p95 TTFT of chat is 3000 ms" in err


def test_main_exits_0_on_the_same_stats_with_looser_thresholds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_locust(monkeypatch, [["POST", "chat", "10", "1", "1", "1", "1", "1"],
                              ["TTFT", "chat", "9", "0", "1", "1", "3000", "3000"]])
    assert run_load.main(args(tmp_path, "--max-failure-ratio", "0.1",
                              "--max-p95-ttft-ms", "3000")) == 0


@pytest.mark.parametrize(("rows", "code"), [(None, 0), ([], 1)], ids=["no-stats", "locust-failed"])
def test_main_exits_2_when_locust_did_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              rows: list[list[str]] | None, code: int) -> None:
    fake_locust(monkeypatch, rows, code)
    assert run_load.main(args(tmp_path)) == 2


def test_main_exits_2_when_locust_hangs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def hang(command: list[str], **kwargs: Any) -> None:
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(run_load.subprocess, "run", hang)
    assert run_load.main(args(tmp_path)) == 2


@pytest.mark.parametrize("host", ["http://10.0.0.2:8000", "http://example.com", "ftp://127.0.0.1"])
def test_main_refuses_hosts_off_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             host: str) -> None:
    calls = fake_locust(monkeypatch, [])
    argv = args(tmp_path)
    argv[argv.index("--host") + 1] = host
    assert run_load.main(argv) == 2 and calls == []


def test_bad_run_time_is_a_usage_error_before_anything_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run_load.parse_args(["--host", "http://127.0.0.1:8000", "--run-time", "30x"])
    assert exited.value.code == 2 and "bad run time '30x'" in capsys.readouterr().err
