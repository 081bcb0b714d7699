"""`load/locust/run_load.py --plot`: the PNG from a small synthetic locust history."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from load.locust.plot import plot_history, read_history
from load.locust.run_load import locust_command, parse_args

COLUMNS = ["Timestamp", "User Count", "Type", "Name", "Requests/s", "Failures/s", "50%", "95%"]


def _history(path: Path, per_payload: bool = True) -> Path:
    rows = []
    for second in range(10):
        stamp = str(1_700_000_000 + second)
        rows.append([stamp, "4", "", "Aggregated", "3", "0", "100", "200"])
        if not per_payload:
            continue
        for name in ("chat", "messages"):
            rows += [[stamp, "4", "POST", name, "1.5", "0", "300", "500"],
                     [stamp, "4", "TTFT", name, "1.5", "0", str(40 + second), str(90 + second)],
                     [stamp, "4", "ITL", name, "1.5", "0", "5", "N/A" if second == 0 else "9"],
                     [stamp, "4", "TOKENS", name, "1.5", "0", "32", "40"]]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    return path


def test_plot_writes_a_png(tmp_path: Path) -> None:
    history = _history(tmp_path / "run_stats_history.csv")
    by_type = read_history(history)
    assert set(by_type) == {"POST", "TTFT", "ITL", "TOKENS"}  # the aggregate is left out
    assert len(by_type["TTFT"]) == 10 and len(by_type["TTFT"][1_700_000_000.0]) == 2
    out = plot_history(history, tmp_path / "out" / "run_plot.png")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_a_history_without_payload_rows_is_an_error(tmp_path: Path) -> None:
    history = _history(tmp_path / "h.csv", per_payload=False)
    with pytest.raises(ValueError, match="--csv-full-history"):
        plot_history(history, tmp_path / "p.png")


def test_plot_flag_asks_locust_for_the_full_history() -> None:
    base = ["--host", "http://127.0.0.1:8000"]
    assert "--csv-full-history" in locust_command(parse_args([*base, "--plot"]))
    assert "--csv-full-history" not in locust_command(parse_args(base))
