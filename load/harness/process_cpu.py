"""CPU time of a server's process tree, by role (proxy, ingress, model replica, Ray's own).

The serving path's cost per token is CPU taken from decode on a small machine, and wall
clock alone cannot say which process spends it. Read from `/proc` (Linux only): the
benchmark snapshots before and after its HTTP runs and divides by the tokens served.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")

# (role, what its command line contains), first match wins. Ray names its workers
# `ray::<Actor>`; a Serve replica's actor name carries its app and deployment.
_ROLES = (
    ("proxy", "ray::ProxyActor"),
    ("ingress replica", "ray::ServeReplica:orchard:Ingress"),
    ("model replica", "ray::ServeReplica:"),
    ("serve controller", "ray::ServeController"),
    ("haproxy", "haproxy"),
    ("gcs", "gcs_server"),
    ("raylet", "raylet"),
    ("dashboard", "dashboard"),
)


def role(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return "gone"
    return next((name for name, mark in _ROLES if mark in cmdline), "other ray")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of one process, all its threads, in seconds (0 once gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of one process by thread: its main thread, each thread Orchard named for
    the OS (`replicas.os_thread`: the engine's loop), the threads those started (Linux
    gives a new thread its creator's name: MLX's compute threads, started from the engine
    thread, as "orchard-engine's threads"), and all the others together (event loops,
    Ray's own; in raw mlx-lm, MLX's compute)."""
    spent: dict[str, float] = defaultdict(float)
    tasks = Path(f"/proc/{pid}/task")
    first: dict[str, int] = {}  # a named thread is the oldest of its name: the lowest id
    rows: list[tuple[int, str, float]] = []
    for tid in sorted(map(int, os.listdir(tasks))) if tasks.is_dir() else []:
        try:
            name = (tasks / str(tid) / "comm").read_text().strip()
            fields = (tasks / str(tid) / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        first.setdefault(name, tid)
        rows.append((tid, name, (int(fields[11]) + int(fields[12])) * _TICK_S))
    for tid, name, seconds in rows:
        if tid == pid:
            kind = "main thread"
        elif not name.startswith("orchard-"):
            kind = "other threads"
        else:
            kind = name if first[name] == tid else f"{name}'s threads"
        spent[kind] += seconds
    return dict(spent)


def threads_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per kind of thread between two `thread_seconds` readings (a thread that
    ended meanwhile takes its seconds with it: the kinds measured are long-lived)."""
    return {kind: seconds - before.get(kind, 0.0) for kind, seconds in after.items()}


@dataclass(frozen=True)
class CpuSnapshot:
    by_pid: dict[int, tuple[str, float]]
    # The model replica's threads (`thread_seconds`), the replicas' together.
    replica_threads: dict[str, float] = field(default_factory=dict)

    @classmethod
    def take(cls, pids: list[int]) -> "CpuSnapshot":
        by_pid = {pid: (role(pid), cpu_seconds(pid)) for pid in pids}
        threads: dict[str, float] = defaultdict(float)
        for pid, (name, _) in by_pid.items():
            if name == "model replica":
                for kind, seconds in thread_seconds(pid).items():
                    threads[kind] += seconds
        return cls(by_pid, dict(threads))

    def since(self, before: "CpuSnapshot") -> dict[str, float]:
        """CPU seconds spent per role between `before` and this snapshot."""
        spent: dict[str, float] = defaultdict(float)
        for pid, (name, now) in self.by_pid.items():
            spent[name] += now - before.by_pid.get(pid, (name, 0.0))[1]
        return dict(spent)

    def replica_threads_since(self, before: "CpuSnapshot") -> dict[str, float]:
        return threads_between(before.replica_threads, self.replica_threads)


def per_token_table(spent: dict[str, float], tokens: int, raw_ms_per_token: float) -> list[str]:
    """Rows of milliseconds of CPU per token by role, busiest first. The model replica also
    decodes, so its row is shown as well less raw mlx-lm's own CPU per token: what the
    replica spends on serving."""
    rows = []
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        ms = seconds * 1e3 / tokens
        extra = f"   (serving share, less raw decode's {raw_ms_per_token:.2f}: " \
                f"{ms - raw_ms_per_token:.2f})" if name == "model replica" else ""
        rows.append(f"  {name:<18}{ms:>8.2f} ms CPU/token{extra}")
    outside = sum(s for n, s in spent.items() if n != "model replica") * 1e3 / tokens
    rows.append(f"  {'outside the model replica':<18}{outside:>8.2f} ms CPU/token")
    return rows


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, from /proc (Linux; else `root` alone)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # The parent pid follows the command name, which may hold spaces and ")".
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree
