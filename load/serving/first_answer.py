"""The first answer (issue 62): fresh `serve run serve_config.yaml`s, each timed to its first
streamed token, with the startup split each one logged (`deployments.startup_split`).

    python -m load.serving.first_answer --runs 5
    python -m load.serving.first_answer --runs 3 --baseline /tmp/orchard-before

Each run is a clean start, as on a fresh clone: the shipped config on a free port (the
replica there, Serve's proxy on the next), a Ray of its own (`RAY_TMPDIR`) and an empty
Orchard cache (`ORCHARD_CACHE_DIR`), so the built-in model's weights are written and checked
again; `--warm-cache` keeps one cache across runs (the second start of a checkout). The
client streams a chat completion from the moment `serve run` starts, again until one
answers; the figure is the time to its first content chunk. Beside it, the CPU seconds
each of the start's processes spent until then, by role (`StartupCpu`): on a 2-core box
CPU is what a start waits for, and these, unlike wall time, hold on a loaded box.
`--baseline DIR`: another
checkout (say `git archive` of an older commit), run alternately with this one, so both see
the same load; its ratio is printed. Median and spread per checkout, and each run's phases
as its replica logged them (a checkout older than the split logs none). Bounded: every run
stops at `--timeout` seconds; each `serve run` is stopped with Ctrl-C, and the processes it
left (Ray's) are ended by their ids.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from load.harness.process_cpu import cpu_seconds, process_tree, role
from load.harness.serve_settings import serve_settings
from load.harness.servers import stop_server

ROOT = Path(__file__).resolve().parents[2]
MODEL = "orchard-tiny"
SPLIT = re.compile(r"first answer (\d+\.\d)s after ([^:]+): (.*)")


@dataclass
class Run:
    checkout: str
    seconds: float | None  # to the first streamed token, as the client saw it
    split: str = ""  # the replica's line, as logged
    phases: dict[str, float] = field(default_factory=dict)
    load_avg: float = 0.0  # the machine's 1-minute load average when the run started
    cpu: dict[str, float] = field(default_factory=dict)  # CPU s to the first answer, by role


# Roles finer than `process_cpu.role`'s, for a start: Ray's own processes by name (their
# command lines, as Ray titles them), first match wins; the rest as `role` names them.
_STARTUP_ROLES = (
    ("serve run", "bin/serve run"),
    ("build task", "build_serve_application"),
    ("idle workers", "ray::IDLE"),  # prestarted by Ray, unused by Serve's runtime env
    ("raylet", "/ray/raylet/raylet "),
    ("starting worker", "/ray/_private/workers/"),  # not titled yet: its role comes later
    ("board", "ray::_Board"),
    ("dashboard", "ray::DashboardAgent"),
    ("dashboard", "ray-dashboard-"),
    ("dashboard", "multiprocessing.forkserver"),
    ("runtime env agent", "ray::RuntimeEnvAgent"),
    ("log monitor", "log_monitor.py"),
    ("autoscaler", "autoscaler/_private/monitor.py"),
)

_PROVISIONAL = ("idle workers", "starting worker", "other ray")  # a later title replaces


class StartupCpu:
    """CPU seconds of a start's process tree, sampled every `_SAMPLE_S` on a thread, so a
    process that exits before the first answer (Serve's build task) keeps its last reading;
    a process keeps the first role it shows other than an idle worker's (a prestarted
    worker that runs the build task is titled `ray::IDLE` again after it, and a worker
    still starting has no title yet)."""

    _SAMPLE_S = 0.25

    def __init__(self, root: int) -> None:
        self._root = root
        self._seen: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        for pid in process_tree(self._root):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
            except OSError:
                continue
            name = next((n for n, mark in _STARTUP_ROLES if mark in cmdline), None) or role(pid)
            known = self._seen.get(pid)
            if known is not None and known[0] not in _PROVISIONAL:
                name = known[0]
            self._seen[pid] = (name, max(cpu_seconds(pid), known[1] if known else 0.0))

    def stop(self) -> dict[str, float]:
        """A last sample; CPU seconds by role, largest first, with their total."""
        self._stop.set()
        self._thread.join()
        self.sample()
        spent: dict[str, float] = {}
        for name, seconds in self._seen.values():
            spent[name] = spent.get(name, 0.0) + seconds
        ordered = dict(sorted(spent.items(), key=lambda kv: -kv[1]))
        return {"total": sum(ordered.values()), **ordered}


def _free_port() -> int:
    """A free port whose next is free too (the replica's and Serve's proxy's)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        with suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", port + 1))
            return port


def _first_token(url: str, deadline: float, proc: subprocess.Popen[bytes]) -> float | None:
    body = {"model": MODEL, "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello!"}]}
    with httpx.Client() as client:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with client.stream("POST", url, json=body, timeout=60) as response:
                    if response.status_code == 200:
                        for line in response.iter_lines():
                            if line.startswith("data:") and '"content"' in line:
                                return time.monotonic()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    return None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to `serve run`'s group (it shuts Serve and Ray down), then whatever it left."""
    left = process_tree(proc.pid)[1:]
    if proc.poll() is None:
        stop_server(proc)
    for pid in left:
        with suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def one_run(checkout: Path, label: str, cache: Path | None, timeout_s: float,
            log_dir: Path) -> Run:
    tmp = Path(tempfile.mkdtemp(prefix="first-answer-", dir="/tmp"))
    port = _free_port()
    # The checkout's config, moved to `port` with this checkout's Serve blocks.
    config = {**yaml.safe_load((checkout / "serve_config.yaml").read_text()),
              **serve_settings(port)}
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    own_cache = cache or tmp / "cache"
    env = {**os.environ, "ORCHARD_CACHE_DIR": str(own_cache), "RAY_TMPDIR": str(tmp / "ray"),
           "PYTHONPATH": str(checkout), "RAY_DEDUP_LOGS": "0"}
    (tmp / "ray").mkdir()
    log_path = log_dir / f"{label}-{int(time.time())}.log"
    load_avg = os.getloadavg()[0]
    serve = shutil.which("serve") or str(Path(sys.executable).with_name("serve"))
    with log_path.open("w") as log:
        started = time.monotonic()
        proc = subprocess.Popen([serve, "run", str(path)], cwd=checkout, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        cpu = StartupCpu(proc.pid)
        try:
            first = _first_token(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 started + timeout_s, proc)
            spent = cpu.stop()
            # The replica's line follows its first token by up to a poll and Ray's relay.
            seen = time.monotonic()
            while first is not None and not SPLIT.search(log_path.read_text()) \
                    and time.monotonic() - seen < 5:
                time.sleep(0.2)
        finally:
            _stop(proc)
            shutil.rmtree(tmp, ignore_errors=True)
    match = SPLIT.search(log_path.read_text(errors="replace"))
    phases = {name.strip(): float(s) for name, s in
              re.findall(r"([a-z ]+) (\d+\.\d)s", match[3])} if match else {}
    return Run(label, None if first is None else first - started,
               match[0] if match else "", phases, load_avg, spent)


def _summary(runs: list[Run]) -> str:
    times = [r.seconds for r in runs if r.seconds is not None]
    if not times:
        return "no run answered"
    spread = f"{min(times):.1f}-{max(times):.1f}"
    failed = len(runs) - len(times)
    return (f"median {statistics.median(times):.1f} s (spread {spread}, {len(times)} runs"
            f"{f', {failed} without an answer' if failed else ''})")


def _median_phases(runs: list[Run]) -> str:
    names = [n for r in runs for n in r.phases]
    ordered = list(dict.fromkeys(names))
    return ", ".join(f"{n} {statistics.median(r.phases[n] for r in runs if n in r.phases):.1f}s"
                     for n in ordered)


def _median_cpu(runs: list[Run]) -> str:
    names = list(dict.fromkeys(n for r in runs for n in r.cpu))
    return ", ".join(f"{n} {statistics.median(r.cpu.get(n, 0.0) for r in runs):.1f}"
                     for n in names)


def _cpu_line(cpu: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu.items())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh starts per checkout")
    parser.add_argument("--checkout", type=Path, default=ROOT,
                        help="the checkout measured (default: this one)")
    parser.add_argument("--baseline", type=Path, help="another checkout, run alternately")
    parser.add_argument("--warm-cache", action="store_true",
                        help="one Orchard cache for all runs (built by the first)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    parser.add_argument("--json", type=Path, help="write every run here")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    checkouts = [("current", args.checkout.resolve())] + ([("baseline", args.baseline.resolve())]
                                       if args.baseline else [])
    log_dir = ROOT / "load" / "out" / "first_answer"
    log_dir.mkdir(parents=True, exist_ok=True)
    caches = {label: Path(tempfile.mkdtemp(prefix=f"first-answer-cache-{label}-"))
              for label, _ in checkouts} if args.warm_cache else {}
    runs: list[Run] = []
    try:
        for i in range(args.runs):
            # Alternate which goes first, so neither always follows the other's teardown.
            for label, checkout in checkouts[::1 if i % 2 == 0 else -1]:
                run = one_run(checkout, label, caches.get(label), args.timeout, log_dir)
                runs.append(run)
                answered = "no answer" if run.seconds is None else f"{run.seconds:.1f} s"
                print(f"{label} run {i + 1}: first token {answered} (load {run.load_avg:.1f})"
                      f"\n  {run.split or 'no split line'}"
                      f"\n  CPU s to the first answer: {_cpu_line(run.cpu)}", flush=True)
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    print()
    for label, _ in checkouts:
        mine = [r for r in runs if r.checkout == label]
        print(f"{label}: {_summary(mine)}\n  phases (medians): {_median_phases(mine)}"
              f"\n  CPU s by role (medians): {_median_cpu(mine)}")
    if args.baseline:
        medians = {label: [r.seconds for r in runs if r.checkout == label and r.seconds]
                   for label, _ in checkouts}
        if all(medians.values()):
            ratio = statistics.median(medians["current"]) / statistics.median(medians["baseline"])
            print(f"current / baseline: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    main()
