"""A real `serve run CONFIG` in its own process group, over loopback: start, wait until a
model answers, read its log, stop with Ctrl-C (Serve then shuts the app and Ray down).

Shared by the suites that run the real server from a config file.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from deployments.serve_options import serving_on
from load.harness.process_cpu import process_tree

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300


def serve_exe() -> str:
    return shutil.which("serve") or str(Path(sys.executable).with_name("serve"))


def free_port() -> int:
    """A free port whose next is free too: a config copy's replica serves the port and
    Serve's proxy the next (`serving_on`)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", port + 1))
            return port


def config_copy(tmp_dir: Path, port: int, models: list[dict[str, Any]] | None = None,
                base: Path = ROOT / "serve_config.yaml", *, direct: bool = True) -> Path:
    """`base` (the real config) serving on `port` (`serving_on`), with its models replaced
    when `models` is given."""
    config = serving_on(yaml.safe_load(base.read_text()), port, direct=direct)
    if models is not None:
        config["applications"][0]["args"]["models"] = models
    path = tmp_dir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def ready(client: httpx.Client, base_url: str, model: str) -> bool:
    """Serving: the model is listed and a one-token completion comes back."""
    try:
        models = client.get(f"{base_url}/v1/models", timeout=5)
        if models.status_code != 200:
            return False
        probe = client.post(f"{base_url}/v1/completions", timeout=30, json={
            "model": model, "prompt": "Hi", "max_tokens": 1})
        return probe.status_code == 200
    except httpx.HTTPError:
        return False


# How a test stops `serve run`: Ctrl-C (SIGINT to the process group), SIGINT to `serve run`
# alone, or SIGTERM to it (systemd, launchd, `docker stop`).
Stop = Literal["ctrl-c", "sigint", "sigterm"]

# How long a stop may take before `serve run` is killed, and how long what it started may
# outlive it before that is killed too (a leftover). Generous: a loaded CI box is slow.
STOP_TIMEOUT_S = 60
SETTLE_TIMEOUT_S = 30


@dataclass(frozen=True)
class Stopped:
    """How a `serve run` ended: its exit code (-9: killed after `STOP_TIMEOUT_S`), the
    seconds from the stop signal to its exit, and the command lines of the processes it had
    started that still ran `SETTLE_TIMEOUT_S` later (killed then). HAProxy is not counted:
    it runs in a session of its own and outlives `serve run` by design."""
    how: Stop
    returncode: int
    seconds: float
    leftovers: tuple[str, ...]


@dataclass
class ServeProcess:
    base_url: str
    log_path: Path
    proc: subprocess.Popen[bytes]
    stopped: Stopped | None = None  # set once the `serve_run` block has stopped it

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def handled(self, method: str, path: str) -> set[str]:
        """Ids of the requests to `path` the app handled, any status (Serve's access lines,
        `<id> -- POST /v1/messages 200 12.3ms`), and of every request a client hung up on
        once it had what it needed (Codex drops the stream at `response.completed`): only
        the proxy's cancel line records those, without a path, so count them over a window
        in which one client runs."""
        log = self.log()
        access = re.compile(rf"(\S+) -- {re.escape(method)} {re.escape(path)}(\?\S*)? \d{{3}} ")
        cancelled = re.compile(r"(\S+) -- Client for request \S+ disconnected")
        return {m[1] for m in access.finditer(log)} | {m[1] for m in cancelled.finditer(log)}

    def wait_handled(self, method: str, path: str, count: int,
                     timeout_s: float = 15.0) -> set[str]:
        """The handled ids once there are `count` (Ray forwards replica logs to the driver
        with a delay), or whatever they are after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(seen := self.handled(method, path)) < count \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        return seen


@contextmanager
def serve_run(config: Path, port: int, log_path: Path, *, model: str = "orchard-tiny",
              env: Mapping[str, str] | None = None,
              timeout_s: float = STARTUP_TIMEOUT_S,
              stop_with: Stop = "ctrl-c",
              headers: Mapping[str, str] | None = None) -> Iterator[ServeProcess]:
    """`serve run config` until the block ends; `port` must be the config's HTTP port;
    `headers` go with the readiness probes (an API key where the config asks for one)."""
    base_url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("w")
    # Dedup off: Ray holds back a line that another process logged too, and tests count lines.
    full_env = {**os.environ, **(env or {}), "RAY_SERVE_LOG_TO_STDERR": "1", "RAY_DEDUP_LOGS": "0",
                "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([serve_exe(), "run", str(config)], cwd=ROOT, env=full_env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(headers=dict(headers or {})) as client:
            while not ready(client, base_url, model):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"serve run did not come up; log:\n{log_path.read_text()[-5000:]}")
                time.sleep(1)
        serve = ServeProcess(base_url, log_path, proc)
        yield serve
    finally:
        stopped = stop(proc, stop_with)
        log.close()
    serve.stopped = stopped


def stop(proc: subprocess.Popen[bytes], how: Stop = "ctrl-c") -> Stopped:
    """Stop `serve run` `how`, kill it after `STOP_TIMEOUT_S`, then whatever it started that
    outlives it by `SETTLE_TIMEOUT_S`; how it went (a second stop: the first's code, 0 s)."""
    # Read before Ctrl-C: HAProxy (direct ingress) runs in a session of its own and outlives
    # `serve run`, holding the port, so every descendant left afterwards is killed too.
    descendants = _descendants(proc.pid)
    began = time.monotonic()
    if proc.poll() is None:
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # serve run shuts the app and Ray down
        else:
            os.kill(proc.pid, signal.SIGINT if how == "sigint" else signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = time.monotonic() - began
    # Ray's processes may take a moment to follow `serve run` out (SIGTERM aborts it):
    # wait for them, but not for HAProxy, which is meant to outlive it.
    settle = time.monotonic() + SETTLE_TIMEOUT_S
    while [c for _, c in _alive(descendants) if b"haproxy" not in c] \
            and time.monotonic() < settle:
        time.sleep(0.2)
    leftovers = []
    for pid, cmdline in _alive(descendants):
        if b"haproxy" not in cmdline:
            leftovers.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:200])
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    print(f"serve run stopped by {how} in {seconds:.1f}s, exit code {proc.returncode}, "
          f"{len(leftovers)} processes left", file=sys.stderr)
    return Stopped(how, proc.returncode, seconds, tuple(leftovers))


def _alive(processes: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """Those of `processes` still running (the same command line: not a reused pid)."""
    alive = []
    for pid, cmdline in processes:
        with contextlib.suppress(OSError):
            if _cmdline(pid) == cmdline:
                alive.append((pid, cmdline))
    return alive


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _descendants(root: int) -> list[tuple[int, bytes]]:
    """Every process below `root` with its command line (Linux; else none)."""
    found: list[tuple[int, bytes]] = []
    for pid in process_tree(root)[1:]:
        try:
            found.append((pid, _cmdline(pid)))
        except OSError:
            continue  # gone meanwhile
    return found


@contextmanager
def private_serve(tmp: Path, models: list[dict[str, Any]], builtins: tuple[str, ...],
                  ingress: dict[str, Any] | None = None,
                  port: int | None = None) -> Iterator[ServeProcess]:
    """The real config serving `models` on a free port, with a Ray and an Orchard cache of
    its own (the built-in models, built once here, shared through a link), so its store
    file and its Ray never meet another suite's; `ingress` is merged into the config's;
    `port`: this one rather than a free one."""
    from replicas.builtin import ensure_builtin
    from replicas.builtin.build import default_cache_root

    for name in builtins:
        ensure_builtin(name)
    cache = tmp / "cache"
    cache.mkdir()
    (cache / "builtin").symlink_to(default_cache_root(), target_is_directory=True)
    port = port or free_port()
    path = config_copy(tmp, port, models=models)
    if ingress:
        config = yaml.safe_load(path.read_text())
        args = config["applications"][0]["args"]
        args["ingress"] = {**args.get("ingress", {}), **ingress}
        path.write_text(yaml.safe_dump(config))
    ray_tmp = Path(tempfile.mkdtemp(prefix="orp-", dir="/tmp"))
    try:
        with serve_run(path, port, tmp / "serve.log",
                       env={"ORCHARD_CACHE_DIR": str(cache), "RAY_TMPDIR": str(ray_tmp)}
                       ) as serve:
            yield serve
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def listeners(pid: int, port: int) -> list[Any]:
    """The processes (psutil's) under the process `pid` (a `serve run`) listening on `port`."""
    import ray  # noqa: F401  (first: Ray puts the psutil it ships on the path)
    import psutil

    root = psutil.Process(pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in proc.net_connections(kind="tcp")):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
