"""Orchard for the tenant benchmarks (issue 61): `builtin:tiny` on one replica with a small
batch, with two tenants of equal share ("heavy" and "light", their keys in the environment of
`serve run`) or without tenants (first come, first served). Shared by `load.serving.tenants`
(httpx threads) and `load.locust.run_tenants` (Locust user classes)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from load.harness.servers import HOST, orchard_config, run_config, stop_server

MODEL = "orchard-tiny"
KEYS = {"heavy": "sk-bench-heavy-0123456789", "light": "sk-bench-light-0123456789"}
KEYS_ENV = {"heavy": "ORCHARD_BENCH_HEAVY_KEYS", "light": "ORCHARD_BENCH_LIGHT_KEYS"}
TENANTS = {name: {"keys_env": env, "share": 1} for name, env in KEYS_ENV.items()}


def free_port() -> int:
    """A free port whose next is free too (the replica serves it, Serve's proxy the next)."""
    while True:
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        try:
            with socket.socket() as sock:
                sock.bind((HOST, port + 1))
            return port
        except OSError:
            continue


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@contextmanager
def server(tenants: bool, rows: int) -> Iterator[str]:
    """The server's base URL while it runs; with `tenants`, the two tenants (a key of
    either is accepted without them too: no keys are configured then)."""
    port = free_port()
    app: dict[str, Any] = {"args": {"tenants": TENANTS}} if tenants else {}
    config = orchard_config("builtin:tiny", MODEL, settings={
        "engine": {"max_batch_size": rows, "prefill_batch_size": min(rows, 8)}},
        app=app, port=port)
    base = f"http://{HOST}:{port}"
    env = {KEYS_ENV[name]: key for name, key in KEYS.items()}

    def ready() -> bool:
        answer = httpx.post(f"{base}/v1/completions", timeout=60, headers=auth("light"),
                            json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        return answer.status_code == 200

    proc = run_config(config, [MODEL], env=env, ready=ready, port=port)
    try:
        yield base
    finally:
        stop_server(proc)
