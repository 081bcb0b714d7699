"""A real `redis-server` for the Responses store's tests: its own port and directory, an
append-only file so a kill -9 and a restart keep what it acknowledged, no snapshots.

Shared by the unit suite (the store itself) and the cluster suite (two ingress replicas).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.serve_process import free_port

START_TIMEOUT_S = 20


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:  # fail, not skip: the shared store is only proven against a server
        pytest.fail("redis-server is missing: install it with `apt-get install -y "
                    "--no-install-recommends redis-server` (Debian/Ubuntu) or "
                    "`brew install redis` (macOS)")
    return binary


class RedisServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # appendfsync always: each write is on disk before its reply, so the test's kill -9
        # can lose nothing (everysec, Redis's default, may lose the last second on a crash).
        command = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                   "--dir", str(self.root), "--save", "", "--appendonly", "yes",
                   "--appendfsync", "always", "--daemonize", "no", "--protected-mode", "no",
                   "--logfile", str(self.root / "redis.log")]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                # A server still loading its append-only file answers LOADING: not yet.
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{self.log()}")
            time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        """kill -9, as a crash would: no shutdown save, only what the AOF already holds."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def log(self) -> str:
        path = self.root / "redis.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""
