"""CPU time of a server's process tree, by role (proxy, ingress, model replica, Ray's own).

The serving path's cost per token is CPU taken from decode on a small machine, and wall
clock alone cannot say which process spends it. Read from `/proc` (Linux only): the
benchmark snapshots before and after its HTTP runs and divides by the tokens served.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
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


@dataclass(frozen=True)
class CpuSnapshot:
    by_pid: dict[int, tuple[str, float]]

    @classmethod
    def take(cls, pids: list[int]) -> "CpuSnapshot":
        return cls({pid: (role(pid), cpu_seconds(pid)) for pid in pids})

    def since(self, before: "CpuSnapshot") -> dict[str, float]:
        """CPU seconds spent per role between `before` and this snapshot."""
        spent: dict[str, float] = defaultdict(float)
        for pid, (name, now) in self.by_pid.items():
            spent[name] += now - before.by_pid.get(pid, (name, 0.0))[1]
        return dict(spent)


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
