"""Headless Locust run against a loopback Orchard, with pass/fail thresholds.

    python -m load.locust.run_load --host http://127.0.0.1:8000 --users 4 --spawn-rate 4 \\
        --run-time 30s --csv load/out/smoke --html load/out/smoke.html \\
        --max-failure-ratio 0 --max-p95-ttft-ms 2000

Runs `locust -f load/locust/locustfile.py --headless` in a subprocess (its own process, so gevent's
monkey-patching stays out of this one), then reads the CSV stats it wrote. Exit status: 0 when
every threshold holds, 1 when the failure ratio of the streamed requests or some payload's
p95 time to first token is above its threshold (or nothing completed), 2 when the host is
not loopback or locust itself did not run. Hosts other than 127.0.0.0/8, ::1 and localhost
are refused, so a load test can never leave this machine.
"""

from __future__ import annotations

import argparse
import csv
import ipaddress
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# --workload names -> the locustfile's user classes.
WORKLOADS = {
    "chat": "OpenAIChatUser",
    "completions": "OpenAICompletionsUser",
    "messages": "AnthropicMessagesUser",
    "mixed": "MixedUser",
}
# Seconds locust gets after --run-time to let in-flight streams finish (--stop-timeout) and
# to write its reports; past that the run is killed, so every run is bounded.
STOP_TIMEOUT_S = 60
REPORT_GRACE_S = 60


def loopback_error(url: str) -> str | None:
    """Why `url` is not an allowed load-test target, or None when it is loopback HTTP."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL"
    if parts.hostname == "localhost":
        return None
    try:
        if ipaddress.ip_address(parts.hostname).is_loopback:
            return None
    except ValueError:
        pass
    return f"refusing {url!r}: load tests target only loopback (127.0.0.0/8, ::1, localhost)"


def run_time_seconds(text: str) -> float:
    """Locust's --run-time syntax (`30s`, `2m`, `1h30m`, or plain seconds) in seconds."""
    if re.fullmatch(r"\d+", text):
        return float(text)
    parts = re.findall(r"(\d+)\s*([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise argparse.ArgumentTypeError(f"bad run time {text!r}; use e.g. 30s, 2m, 1h30m")
    scale = {"h": 3600, "m": 60, "s": 1}
    return float(sum(int(n) * scale[u] for n, u in parts))


@dataclass(frozen=True)
class StatsRow:
    """One row of locust's `<prefix>_stats.csv`; times are in milliseconds."""

    kind: str  # the request type: POST (the HTTP request) or a metric (TTFT, ITL, ...)
    name: str
    count: int
    failures: int
    median: float | None
    average: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def from_csv(cls, row: dict[str, str]) -> StatsRow:
        def number(key: str) -> float | None:
            value = row.get(key, "")
            return None if value in ("", "N/A") else float(value)

        return cls(row["Type"], row["Name"], int(row["Request Count"]), int(row["Failure Count"]),
                   number("Median Response Time"), number("Average Response Time"),
                   number("95%"), number("99%"))


def read_stats(csv_prefix: str) -> list[StatsRow]:
    with open(f"{csv_prefix}_stats.csv", newline="", encoding="utf-8") as f:
        return [StatsRow.from_csv(row) for row in csv.DictReader(f) if row["Name"] != "Aggregated"]


def evaluate(rows: list[StatsRow], max_failure_ratio: float, max_p95_ttft_ms: float) -> list[str]:
    """The thresholds that were broken, as sentences; empty when the run passes.

    The failure ratio counts only the HTTP rows (metric rows are derived from successful
    streams). p95 TTFT is checked per payload: if every payload's p95 is within the bound, so
    is the p95 over all of them.
    """
    requests = [r for r in rows if r.kind == "POST"]
    total = sum(r.count for r in requests)
    failed = sum(r.failures for r in requests)
    problems = []
    if total == 0 or failed == total:
        problems.append("no request completed")
    elif failed / total > max_failure_ratio:
        problems.append(f"failure ratio {failed}/{total} = {failed / total:.3f} > {max_failure_ratio}")
    ttft = [r for r in rows if r.kind == "TTFT"]
    if total and not ttft:
        problems.append("no TTFT samples")
    for row in ttft:
        if row.p95 is not None and row.p95 > max_p95_ttft_ms:
            problems.append(f"p95 TTFT of {row.name} is {row.p95:.0f} ms > {max_p95_ttft_ms:.0f} ms")
    return problems


def report(rows: list[StatsRow], summary_path: Path) -> str:
    """One line per payload: requests, failures, and the p50/p95 of each latency metric."""
    by_name: dict[str, dict[str, StatsRow]] = {}
    for row in rows:
        by_name.setdefault(row.name, {})[row.kind] = row

    def cell(row: StatsRow | None, value: str) -> str:
        number = getattr(row, value) if row is not None else None
        return f"{number:>9.0f}" if number is not None else f"{'-':>9}"

    metrics = ("TTFT", "ITL", "TPOT", "E2E")
    header = "".join(f"{f'{m} p50':>9}{f'{m} p95':>9}" for m in metrics)
    lines = [f"{'payload (ms)':<28}{'reqs':>6}{'fail':>6}{header}{'tokens':>9}"]
    for name in sorted(by_name):
        kinds = by_name[name]
        post = kinds.get("POST")
        latency = "".join(cell(kinds.get(m), "median") + cell(kinds.get(m), "p95") for m in metrics)
        lines.append(f"{name:<28}{post.count if post else 0:>6}{post.failures if post else 0:>6}"
                     f"{latency}{cell(kinds.get('TOKENS'), 'average')}")
    if summary_path.exists():
        s = json.loads(summary_path.read_text())
        lines.append(f"aggregate: {s['output_tokens']} output tokens in {s['seconds']:.1f} s = "
                     f"{s['output_tokens_per_s']:.1f} tokens/s over {s['completed']} streams "
                     f"({s['failed']} failed)")
    return "\n".join(lines)


def locust_command(args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", args.host, "--users", str(args.users), "--spawn-rate", str(args.spawn_rate),
        "--run-time", args.run_time, "--stop-timeout", str(STOP_TIMEOUT_S),
        "--csv", args.csv, "--html", args.html, "--only-summary",
        # Thresholds are ours; locust's own exit code then only means "it ran or it did not".
        "--exit-code-on-error", "0",
        "--model", args.model, "--payloads", str(args.payloads), "--think-time", str(args.think_time),
    ]
    if args.max_tokens:
        command += ["--max-tokens", str(args.max_tokens)]
    if args.no_output_checks:
        command.append("--no-output-checks")
    if args.plot:
        command.append("--csv-full-history")  # per-payload rows over time, for the plot
    return command + [WORKLOADS[w] for w in args.workload]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", required=True, help="Orchard base URL, loopback only")
    parser.add_argument("--users", type=int, default=4, help="concurrent users (streams)")
    parser.add_argument("--spawn-rate", type=float, default=4, help="users started per second")
    parser.add_argument("--run-time", default="30s", help="how long to run (locust syntax: 30s, 2m)")
    parser.add_argument("--csv", default="load/out/run", help="CSV prefix (<prefix>_stats.csv ...)")
    parser.add_argument("--html", default="load/out/run.html", help="HTML report path")
    parser.add_argument("--workload", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS),
                        help="user classes to run (default: all, by their weights)")
    parser.add_argument("--model", default="orchard-tiny", help="the model name clients send")
    parser.add_argument("--payloads", type=Path, default=Path(__file__).resolve().parents[1] / "payloads.json")
    parser.add_argument("--max-tokens", type=int, default=0, help="override every payload's max_tokens")
    parser.add_argument("--think-time", type=float, default=0.0, help="seconds a user waits between requests")
    parser.add_argument("--no-output-checks", action="store_true",
                        help="skip payload `expect` checks (for models other than orchard-tiny)")
    parser.add_argument("--plot", action="store_true",
                        help="also write <csv prefix>_plot.png: TTFT, ITL and throughput "
                             "over the run (needs matplotlib, in the `load` extra)")
    parser.add_argument("--max-failure-ratio", type=float, default=0.0)
    parser.add_argument("--max-p95-ttft-ms", type=float, default=2000.0)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # reject a malformed run time before anything starts, as a usage error (exit 2)
        run_time_seconds(args.run_time)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refused = loopback_error(args.host)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    for path in (Path(args.csv).parent, Path(args.html).parent):
        path.mkdir(parents=True, exist_ok=True)
    timeout = run_time_seconds(args.run_time) + STOP_TIMEOUT_S + REPORT_GRACE_S
    log_path = Path(f"{args.csv}_locust.log")  # locust's own console tables and logs
    try:
        with log_path.open("w") as log:
            code = subprocess.run(locust_command(args), check=False, timeout=timeout, stdout=log,
                                  stderr=subprocess.STDOUT).returncode
    except subprocess.TimeoutExpired:
        print(f"locust ran past {timeout:.0f} s and was killed; log: {log_path}", file=sys.stderr)
        return 2
    if code != 0 or not Path(f"{args.csv}_stats.csv").exists():
        print(log_path.read_text()[-3000:], file=sys.stderr)
        print(f"locust exited with status {code} or wrote no stats; log: {log_path}", file=sys.stderr)
        return 2
    rows = read_stats(args.csv)
    print(report(rows, Path(f"{args.csv}_summary.json")))
    problems = evaluate(rows, args.max_failure_ratio, args.max_p95_ttft_ms)
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    reports = [f"{args.csv}_stats.csv", args.html, str(log_path)]
    if args.plot:
        from load.locust.plot import plot_history  # matplotlib only when asked for

        reports.append(str(plot_history(Path(f"{args.csv}_stats_history.csv"),
                                        Path(f"{args.csv}_plot.png"))))
    print(f"reports: {', '.join(reports)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
