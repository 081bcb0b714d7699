"""`orchard status` (and `python -m deployments.cluster status`): the cluster snapshot
(`GET /v1/cluster`) as a table in the terminal, once or every few seconds (`--watch`).

It asks the HTTP API, not Ray, so it runs from any machine that can reach the server, with
the same key as any client (`--key`, or `ORCHARD_API_KEY`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime
from typing import Any, Sequence

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


def fetch(url: str, key: str | None, timeout_s: float = 10.0) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(url.rstrip("/") + "/v1/cluster", headers=headers, timeout=timeout_s)
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise RuntimeError(f"GET /v1/cluster: {response.status_code} {message}")
    snapshot: dict[str, Any] = response.json()
    return snapshot


def _gib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**30:.1f}G"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in rows]


def render(snapshot: dict[str, Any], faults: int = 8) -> str:
    """The snapshot as text: one row per replica and shard under its node, the models'
    totals, and the latest `faults`."""
    at = datetime.fromtimestamp(snapshot["at"]).strftime("%H:%M:%S")
    lines = [f"Orchard cluster at {at}", ""]
    rows = [["NODE", "MEMORY", "METAL", "MODEL", "ROLE", "RANK", "STATE", "KV USED/BUDGET",
             "SHARED", "QUEUE", "STREAMS", "TOK/S", "REPLICA"]]
    for node in snapshot["nodes"]:
        metal = "?" if node["metal"] is None else "yes" if node["metal"] else "no"
        first = [node["name"], _gib(node["memory_bytes"]), metal]
        entries = [(r, 0) for r in node["replicas"]] + [(s, s["rank"]) for s in node["shards"]]
        if not entries:
            rows.append([*first, "-", "", "", "", "", "", "", "", "", ""])
        for entry, rank in entries:
            replica = "replica" not in entry  # a shard names the replica it belongs to
            rows.append([
                *first, entry["model"], entry["role"], str(rank), entry["state"],
                f"{_gib(entry['kv_used_bytes'])}/{_gib(entry['kv_budget_bytes'])}"
                if replica else f"-/{_gib(entry['kv_budget_bytes'])}",
                _gib(entry["kv_shared_bytes"]) if replica else "-",
                str(entry["queue"]) if replica else "-",
                str(entry["running"]) if replica else "-",
                f"{entry['tokens_per_s']:.1f}" if replica else "-",
                entry["id"] if replica else entry["replica"]])
            first = ["", "", ""]
    lines += _table(rows)
    lines += ["", *_table([["MODEL", "REPLICAS", "LOST", "RANKS", "STREAMS", "QUEUE", "TOK/S",
                            "KV USED/BUDGET", "PREEMPTED", "PULLS"]] + [
        [m["id"], str(m["replicas"]), str(m["lost"]), str(m["ranks"]), str(m["running"]),
         str(m["queue"]), f"{m['tokens_per_s']:.1f}",
         f"{_gib(m['kv_used_bytes'])}/{_gib(m['kv_budget_bytes'])}", str(m["preempted"]),
         str(m["pulls"])] for m in snapshot["models"]])]
    recent = snapshot["faults"][-faults:]
    lines += ["", "FAULTS" + ("" if recent else ": none")]
    for fault in reversed(recent):
        when = datetime.fromtimestamp(fault["at"]).strftime("%H:%M:%S")
        where = f" {fault['replica']}" if fault["replica"] else ""
        detail = f": {fault['detail']}" if fault["detail"] else ""
        lines.append(f"  {when}  {fault['kind']:<11} {fault['model']}{where}{detail}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("ORCHARD_URL", DEFAULT_URL),
                        help=f"the server (ORCHARD_URL, else {DEFAULT_URL})")
    parser.add_argument("--key", default=os.environ.get("ORCHARD_API_KEY"),
                        help="an API key, when the server has keys (ORCHARD_API_KEY)")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None,
                        metavar="SECONDS", help="redraw every SECONDS (2) until Ctrl-C")


def run(args: argparse.Namespace) -> int:
    while True:
        try:
            text = render(fetch(args.url, args.key))
        except (httpx.HTTPError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            if args.watch is None:
                return 1
            text = None
        if text is not None:
            # Clear and home on a terminal, so --watch redraws in place.
            prefix = "\x1b[H\x1b[2J" if args.watch is not None and sys.stdout.isatty() else ""
            print(prefix + text, flush=True)
        if args.watch is None:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`orchard status [--url URL] [--key KEY] [--watch [SECONDS]]`."""
    parser = argparse.ArgumentParser(prog="orchard", description="Orchard's command line.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_arguments(commands.add_parser("status", help="the cluster as a table (GET /v1/cluster)",
                                      description=__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
