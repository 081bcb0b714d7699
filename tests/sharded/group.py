"""A sharded replica's process group: its ranks (found through the dashboard) and what they
hold, read from /proc (Linux: both test nodes are this machine), so a test can tell that a
replaced group left nothing behind: no process, no listening port, no ring connection.

A socket is known by its inode: a port may be taken again by the replacement (Ray's worker
ports come from one small range), but an inode still listed in /proc/net/tcp is a socket
some process still holds (a child that inherited it, a process that did not exit).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.cluster.conftest import DASHBOARD, LocalCluster

_LISTEN, _ESTABLISHED = "0A", "01"  # /proc/net/tcp's `st` column
# From a resumed stream's end until nothing of the replaced group is left (the replacement
# served it, so the old group was stopping or gone by then).
GONE_S = 60.0


@dataclass(frozen=True)
class Socket:
    local: str  # "HEXADDR:HEXPORT", as /proc/net/tcp{,6} writes it
    remote: str
    state: str

    @property
    def port(self) -> int:
        return int(self.local.rsplit(":", 1)[1], 16)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone but for its parent's wait
            return stat.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:  # reaped meanwhile
        return False


def tcp_sockets() -> dict[int, Socket]:
    """Every TCP socket some process holds, by inode (this network namespace: Ray's too)."""
    found: dict[int, Socket] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)  # the header
            for row in rows:
                cols = row.split()
                inode = int(cols[9])
                if inode:  # 0: no process holds it (TIME_WAIT, an orphan closing)
                    found[inode] = Socket(cols[1], cols[2], cols[3])
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets `pid` holds open; none once it is gone."""
    inodes: set[int] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


@dataclass(frozen=True)
class GroupSockets:
    """A live group's processes (rank 0, the Serve replica, first) and its TCP sockets."""

    pids: tuple[int, ...]
    listening: dict[int, int]  # inode -> port, the LISTEN sockets of every rank
    # inode -> port: both ends of each connection between two ranks that is not Ray's (a
    # connection to a listening port of theirs): MLX's ring. The ring closes its listening
    # socket once its peer connected, so the ports `deployments.shards` picked live here.
    ring: dict[int, int]

    @classmethod
    def take(cls, pids: tuple[int, ...]) -> GroupSockets:
        sockets = tcp_sockets()
        owner = {inode: pid for pid in pids for inode in socket_inodes(pid) if inode in sockets}
        listening = {i: sockets[i].port for i in owner if sockets[i].state == _LISTEN}
        ports = set(listening.values())
        local = {sockets[i].local: i for i in owner}
        ring: dict[int, int] = {}
        for inode, pid in owner.items():
            sock = sockets[inode]
            peer = local.get(sock.remote)
            if sock.state == _ESTABLISHED and peer is not None and owner[peer] != pid \
                    and not {sock.port, sockets[peer].port} & ports:
                ring[inode] = sock.port
        return cls(pids, listening, ring)

    def left_behind(self) -> list[str]:
        """What of this group is still there: live processes, and sockets still held."""
        left = [f"pid {pid} is alive" for pid in self.pids if alive(pid)]
        now = tcp_sockets()
        for what, held in (("listening port", self.listening), ("ring port", self.ring)):
            left += [f"{what} {port} (socket {inode}) is still held"
                     for inode, port in held.items() if inode in now]
        # The same ports, bound again by an old process (say, a leftover ring listener).
        old = set(self.listening.values()) | set(self.ring.values())
        for pid in self.pids:
            left += [f"pid {pid} listens on {now[i].port}" for i in socket_inodes(pid)
                     if i in now and now[i].state == _LISTEN and now[i].port in old]
        return left


def running_replicas(cluster: LocalCluster, model: str) -> dict[str, int]:
    """Replica id to process id (rank 0's, on a sharded model) of `model`'s running replicas."""
    deployment = cluster.app()["deployments"][f"model:{model}"]
    return {r["replica_id"]: r["pid"] for r in deployment["replicas"] if r["state"] == "RUNNING"}


def shard_actors(cluster: LocalCluster, model: str) -> list[dict[str, Any]]:
    """The live rank-1 actors of `model`'s replicas (named by `deployments.shards`)."""
    r = httpx.get(f"{DASHBOARD}/api/v0/actors?limit=1000&detail=true", timeout=30,
                  headers={"Authorization": f"Bearer {cluster.token}"})
    r.raise_for_status()
    actors = r.json()["data"]["result"]["result"]
    return [a for a in actors if a["state"] == "ALIVE"
            and (a.get("name") or "").startswith(f"orchard-shard:{model}:")]


def group_of(cluster: LocalCluster, model: str) -> GroupSockets:
    """`model`'s one running replica (two ranks): their processes and the sockets they hold."""
    (rank0,) = running_replicas(cluster, model).values()
    (rank1,) = shard_actors(cluster, model)
    group = GroupSockets.take((rank0, rank1["pid"]))
    assert group.listening, group  # Ray's own servers, at least: the check can bite
    # MLX's ring on two ranks: rank 1 connected to rank 0's address, rank 0 to rank 1's.
    assert len(group.ring) == 4, f"expected both ends of two ring connections: {group}"
    return group


def assert_replaced(cluster: LocalCluster, model: str, old: GroupSockets) -> None:
    """Within `GONE_S`: a new replica with a new rank 1 serves `model`, and nothing of `old`
    is left (`GroupSockets.left_behind`)."""
    deadline = time.monotonic() + GONE_S
    while True:
        left = old.left_behind()
        ranks0 = set(running_replicas(cluster, model).values())
        ranks1 = {a["pid"] for a in shard_actors(cluster, model)}
        if not left and len(ranks0) == len(ranks1) == 1 and not (ranks0 | ranks1) & set(old.pids):
            return
        assert time.monotonic() < deadline, f"{GONE_S:g} s after the stream: {left}; " \
            f"rank 0 {ranks0}, rank 1 {ranks1} (old {old})"
        time.sleep(1)
