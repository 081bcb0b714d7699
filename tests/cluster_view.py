"""What the cluster-view suites share (tests/e2e/test_cluster_http.py,
tests/e2e/test_dashboard_browser.py, tests/sharded/test_cluster_view.py): load that keeps a
model decoding while a test watches the snapshot, the snapshot, and `orchard status`'s
replicas."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def snapshot(base_url: str) -> dict[str, Any]:
    """`GET /v1/cluster`, which must answer."""
    response = httpx.get(f"{base_url}/v1/cluster", timeout=10)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


@contextmanager
def decoding(base_url: str, model: str, max_tokens: int = 300) -> Iterator[None]:
    """Streams to `model`, one after another, until the block ends."""
    done = threading.Event()

    def load() -> None:
        body = {"model": model, "prompt": "count:", "max_tokens": max_tokens, "stream": True}
        while not done.is_set():
            with httpx.stream("POST", f"{base_url}/v1/completions", json=body,
                              timeout=120) as response:
                for _ in response.iter_lines():
                    if done.is_set():
                        break

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=60)


def status_replicas(base_url: str) -> list[str]:
    """The replica each row of `python -m deployments.cluster status`'s node table names
    (a replica's row, or a shard's): the table's last column. The faults below it name
    replicas too, so only the node table is read."""
    result = subprocess.run([sys.executable, "-m", "deployments.cluster", "status", "--url",
                             base_url], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NODE"))
    return [line.split()[-1] for line in lines[start + 1:lines.index("", start)]
            if "#" in line.split()[-1]]
