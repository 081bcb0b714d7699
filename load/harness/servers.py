"""Servers the benchmarks start and stop: Orchard's `serve run` of a config written for the
run, and `mlx_lm.server`, each on its own loopback port, never two on one port, and never
someone else's server measured in their place."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from load.harness.serve_settings import serve_settings
from load.harness.process_cpu import process_tree

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "load" / "out"
HOST = "127.0.0.1"
PORT = 8000  # Orchard as the shipped config serves it: its replica; Serve's proxy one above
BASE = f"http://{HOST}:{PORT}"
ORCHARD_PORT, MLX_PORT = 8100, 8102  # vs_mlx_server's: Orchard's replica (proxy 8101), mlx_lm.server
MAX_BATCH, PREFILL_BATCH = 32, 8  # the same batching limits on both servers
STARTUP_TIMEOUT_S = 300
PORT_WAIT_S = 600  # a shared machine: someone else's server may hold 8000 for a while

# Ray Serve's HAProxy direct ingress (README, "Layouts"): read where Ray starts, so they go
# into `serve run`'s environment. 1024 connections keep HAProxy within a 4096-descriptor limit.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_MAXCONN": "1024"}

# `--layout`: the config's `ingress.colocate`; "default" leaves it unset, as a user does.
LAYOUTS: dict[str, dict[str, bool]] = {"default": {}, "two-hop": {"colocate": False},
                                       "colocated": {"colocate": True}}


@dataclass(frozen=True)
class Target:
    """A server as its clients see it: a label, its base URL and the model name it serves."""

    label: str
    base: str
    model: str  # the name sent as `model`

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether something already answers on the port: a stale server would be measured."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def wait_port_free(port: int) -> None:
    """Another engineer's server on the port is waited out, never stopped."""
    deadline = time.monotonic() + PORT_WAIT_S
    while port_in_use(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"127.0.0.1:{port} stayed busy for {PORT_WAIT_S} s")
        print(f"  127.0.0.1:{port} is busy; waiting", flush=True)
        time.sleep(15)


def require_alive(proc: subprocess.Popen[bytes]) -> None:
    """Our own `serve run` must still be the one answering, not something left behind."""
    if proc.poll() is not None:
        raise RuntimeError(f"serve run exited (code {proc.returncode}); the figures would "
                           "come from whatever else answers on the port")


@contextlib.contextmanager
def paused(root: int) -> Iterator[None]:
    """Freeze the server's whole process tree (SIGSTOP), so a raw run sees the machine as it
    would be without Orchard; a few seconds is far inside Ray's health-check timeouts."""
    pids = process_tree(root)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def orchard_config(source: str, model: str, flush_ms: float | None = None,
                   layout: str = "default", haproxy: bool = False, metrics: bool = True,
                   settings: dict[str, object] | None = None, actor_calls: bool = False,
                   app: dict[str, Any] | None = None, port: int = PORT) -> dict[str, object]:
    """One model's config, with the Serve settings `serve_config.yaml` ships (its
    `controller_options`); `flush_ms`: its `stream_flush_ms` (None: Orchard's default); `metrics`:
    `observability`'s metrics and request logs (on by default, as shipped); `settings` are more of the
    model's config fields; `actor_calls`: Serve's own default transport between its proxy
    and the replica (Ray actor calls) instead of the shipped gRPC; `app`: more of the
    application's keys (Serve's `logging_config`), its `args` merged into Orchard's
    (`observability`)."""
    extra = dict(app or {})
    entry: dict[str, Any] = {"id": model, "source": source, "max_ongoing_requests": 64}
    if flush_ms is not None:
        entry["stream_flush_ms"] = flush_ms
    args: dict[str, Any] = {"models": [{**entry, **(settings or {})}], "ingress": LAYOUTS[layout],
                            # Off: no metrics and no request log lines, for the on/off ratio.
                            "observability": {"metrics": metrics, "request_logs": metrics}}
    application: dict[str, Any] = {
        "name": "orchard", "route_prefix": "/", "import_path": "deployments.app:build_app",
        "args": {**args, **extra.pop("args", {})}, **extra}
    return {
        # HAProxy takes the port itself and Serve gives each replica one of its own range.
        **serve_settings(port, direct=not haproxy,
                         **({"RAY_SERVE_PROXY_USE_GRPC": "0"} if actor_calls else {})),
        "applications": [application],
    }


def start_server(source: str, model: str, flush_ms: float | None = None,
                 layout: str = "default", haproxy: bool = False, metrics: bool = True,
                 settings: dict[str, object] | None = None, actor_calls: bool = False,
                 app: dict[str, Any] | None = None, port: int = PORT,
                 ready: Callable[[], bool] | None = None) -> subprocess.Popen[bytes]:
    """`serve run` of one model (`orchard_config`), returned once it answers a completion
    (or `ready()` says it serves)."""
    config = orchard_config(source, model, flush_ms, layout, haproxy, metrics, settings,
                            actor_calls, app, port)
    return run_config(config, [model], env=HAPROXY_ENV if haproxy else {}, ready=ready,
                      port=port)


def run_config(config: dict[str, object], models: list[str],
               env: dict[str, str] | None = None,
               ready: Callable[[], bool] | None = None,
               port: int = PORT) -> subprocess.Popen[bytes]:
    """`serve run` of `config` on 127.0.0.1 (with the shipped Serve settings unless it sets
    its own), returned once every model answers a completion on `port` (or `ready()` says
    the server serves); refuses a port something else already answers on."""
    if port_in_use(port):
        raise RuntimeError(f"something already listens on 127.0.0.1:{port} (a stale "
                           "`serve run`? `serve shutdown -y` / `ray stop`); refusing to "
                           "benchmark it")
    path = Path(tempfile.mkdtemp()) / "bench_config.yaml"
    path.write_text(json.dumps({**serve_settings(), **config}))
    serve = Path(sys.executable).with_name("serve")
    proc = subprocess.Popen([str(serve), "run", str(path)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited during startup (code {proc.returncode})")
        try:
            if ready() if ready is not None else all(
                    httpx.post(f"http://{HOST}:{port}/v1/completions", timeout=60, json={
                        "model": m, "prompt": "hi", "max_tokens": 1}).status_code == 200
                    for m in models):
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError("serve run did not come up")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the process group: `serve run` shuts Serve and Ray down on Ctrl-C."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], target: Target, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    probe = {"model": target.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{target.label} exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            r = httpx.post(f"{target.base}/v1/chat/completions", json=probe, timeout=60)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{target.label} did not come up in {STARTUP_TIMEOUT_S} s; log: {log_path}")


@contextlib.contextmanager
def running(target: Target, command: list[str], log_path: Path) -> Iterator[Target]:
    """The server process for the duration of the block; its whole process group after."""
    if port_in_use(target.port):
        raise RuntimeError(f"{HOST}:{target.port} is already taken (a stale server?): refusing "
                           f"to benchmark it as {target.label}")
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            wait_ready(proc, target, log_path)
            yield target
            if proc.poll() is not None:  # whatever answered after it exited was not ours
                raise RuntimeError(f"{target.label} exited ({proc.returncode}) during the run")
        finally:
            stop_server(proc)


def mlx_server(model_path: Path, prompt_cache: bool) -> tuple[Target, list[str]]:
    """`mlx_lm.server` on `MLX_PORT` with Orchard's batching limits, as shipped or with its
    prompt cache off (every entry evicted as soon as it is stored)."""
    label = "mlx_lm.server" if prompt_cache else "mlx_lm.server no-cache"
    command = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_path),
               "--host", HOST, "--port", str(MLX_PORT), "--temp", "0",
               "--decode-concurrency", str(MAX_BATCH), "--prompt-concurrency", str(PREFILL_BATCH)]
    if not prompt_cache:
        command += ["--prompt-cache-size", "0"]
    return Target(label, f"http://{HOST}:{MLX_PORT}", "default_model"), command


def local_path(source: str) -> Path:
    if source.startswith("builtin:"):
        # mlx_lm.server needs the directory the project builds.
        from replicas.builtin import ensure_builtin

        return ensure_builtin(source.removeprefix("builtin:"))
    return Path(source)


def eos_bias(model_path: Path) -> dict[str, float]:
    """A logit_bias that keeps end-of-sequence from being sampled, so every request runs to
    max_tokens on both servers (both accept OpenAI's logit_bias)."""
    from mlx_lm.utils import load_tokenizer

    return {str(t): -100.0 for t in sorted(load_tokenizer(model_path).eos_token_ids)}
