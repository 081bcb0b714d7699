"""A two-node Ray cluster on this machine: a head without the Apple Silicon resource and a
worker that advertises it (joined with `python -m deployments.cluster worker`).

Both nodes use token auth (a fresh token in a temp dir) and ports of their own, so the
cluster neither sees nor disturbs other Ray instances here, e.g. a concurrent `serve run`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import httpx
import pytest
import yaml

from deployments.serve_options import controller_options
from replicas.builtin import ensure_builtin

ROOT = Path(__file__).resolve().parents[2]


def _shift() -> int:
    """Each pytest-xdist worker ("gwN") gives its nodes ports of their own, so this folder
    and tests/sharded, both on `LocalCluster`, may run at once."""
    return 20 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


SHIFT = _shift()
HTTP_PORT = int(os.environ.get("ORCHARD_CLUSTER_HTTP_PORT", str(8300 + SHIFT)))
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
GCS_PORT = 6400 + SHIFT
DASHBOARD_PORT = 8365 + SHIFT
DASHBOARD = f"http://127.0.0.1:{DASHBOARD_PORT}"
DASHBOARD_PATIENCE_S = 180  # how long a dashboard call retries before it counts as down


def _ports(node_manager: int, agent: int, workers: int) -> list[str]:
    return ["--node-manager-port", str(node_manager + SHIFT),
            "--object-manager-port", str(node_manager + 1 + SHIFT),
            "--dashboard-agent-listen-port", str(agent + SHIFT),
            "--dashboard-agent-grpc-port", str(agent + 1 + SHIFT),
            "--metrics-export-port", str(agent + 2 + SHIFT),
            "--runtime-env-agent-port", str(agent + 3 + SHIFT),
            # Worker port ranges 100 wide, two per xdist worker: 20100-20499 for two.
            "--min-worker-port", str(workers + 10 * SHIFT),
            "--max-worker-port", str(workers + 99 + 10 * SHIFT)]


# Ports Ray would otherwise pick by default (and clash on with another instance or node).
HEAD_PORTS = ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(DASHBOARD_PORT),
              "--ray-client-server-port", str(10400 + SHIFT), *_ports(6401, 52400, 20100)]
WORKER_PORTS = _ports(6411, 52410, 20200)
# Units of apple_silicon on the worker: every replica the tests run, plus a rolling
# update's new replicas while the old ones drain.
WORKER_SLOTS = 8
START_TIMEOUT_S = 120
MARKER = "ORCHARD_CLUSTER_NODE"  # on every process of a node (actors too), to sweep them up


def _exe(name: str) -> str:
    sibling = Path(sys.executable).with_name(name)
    return str(sibling) if sibling.exists() else shutil.which(name) or name


class LocalCluster:
    def __init__(self, root: Path, head_slots: int = 0,
                 env: Mapping[str, str] | None = None, worker_slots: int = WORKER_SLOTS
                 ) -> None:
        """`head_slots`: units of apple_silicon the head advertises too (none by default, so
        pinned models land on the worker; a sharded replica spreads over both);
        `worker_slots`: the worker's. `env`: more variables for both nodes, which every Ray
        process of theirs inherits (actors too)."""
        self.root = root
        self.head_slots = head_slots
        self.worker_slots = worker_slots
        self.logs = root / "logs"
        self.logs.mkdir()
        self.token = secrets.token_hex(32)
        (root / "token").write_text(self.token)
        self.env = dict(
            os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(root / "token"),
            RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT)) | dict(env or {})
        self.head: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None

    # ---- nodes --------------------------------------------------------------------------

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        env = dict(self.env, **{MARKER: self._tag(name)})
        with (self.logs / f"{name}.log").open("ab") as log:  # the child keeps its own copy
            return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def _tag(self, name: str) -> str:
        return f"{self.root.name}/{name}"

    def start(self) -> None:
        # Short temp dir: Ray's unix socket paths must fit in 107 bytes.
        models = ["--with-models", "--allow-no-metal", "--amount", str(self.head_slots)] \
            if self.head_slots else []
        self.head = self._spawn("head", [
            sys.executable, "-m", "deployments.cluster", "head", "--port", str(GCS_PORT),
            *models, "--", "--block", "--num-cpus", "2", "--object-store-memory", str(256 << 20),
            "--temp-dir", str(self.root / "ray"), *HEAD_PORTS])
        self._wait_nodes(1)
        self.ensure_worker()

    def ensure_worker(self) -> None:
        if self.worker is not None:
            return
        for attempt in (1, 2):
            # The helper's default of no CPUs keeps the ingress on the head, so it outlives
            # the worker in test_requests_get_fast_503_when_no_node_can_run_the_model.
            self.worker = self._spawn("worker", [
                sys.executable, "-m", "deployments.cluster", "worker", "--allow-no-metal",
                "--address", f"127.0.0.1:{GCS_PORT}", "--amount", str(self.worker_slots),
                "--", "--block", "--object-store-memory", str(256 << 20), *WORKER_PORTS])
            try:
                self._wait_nodes(2)
                return
            except RuntimeError:
                # Ray gives a joining raylet a fixed 30 s to register with the GCS, which a
                # busy two-core box can pass: the node exits. Start it once more.
                if attempt == 2 or self.worker.poll() is None:
                    raise
                self._sweep("worker")

    def stop_worker(self) -> None:
        """Like `ray stop` on that machine: the node and all its processes end."""
        assert self.worker is not None
        _stop(self.worker)
        self.worker = None
        self._sweep("worker")

    def stop(self) -> None:
        for name, proc in (("worker", self.worker), ("head", self.head)):
            if proc is not None:
                _stop(proc)
            self._sweep(name)

    def _sweep(self, name: str) -> None:
        # Actor workers run in sessions of their own: end this node's, found by marker.
        for pid in _pids_with(f"{MARKER}={self._tag(name)}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue

    def _wait_nodes(self, count: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in (self.head, self.worker):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"a ray node exited:\n{self._log_tails()}")
            try:
                if len(self.alive_nodes()) >= count:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the cluster did not reach {count} nodes:\n{self._log_tails()}")

    def _log_tails(self) -> str:
        # The temp dir is removed at teardown, so the failure message carries the logs.
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                         for log in sorted(self.logs.glob("*.log")))

    # ---- dashboard REST API (token auth) ------------------------------------------------

    def _get(self, path: str) -> Any:
        # On CI's loaded 2-core box the dashboard once took over 30 s to answer during a
        # redeploy: a slow answer is retried (what callers poll for has its own deadline).
        deadline = time.monotonic() + DASHBOARD_PATIENCE_S
        while True:
            try:
                r = httpx.get(f"{DASHBOARD}{path}", timeout=30,
                              headers={"Authorization": f"Bearer {self.token}"})
                break
            except httpx.TimeoutException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        r.raise_for_status()
        return r.json()

    def alive_nodes(self) -> list[dict[str, Any]]:
        nodes = self._get("/api/v0/nodes?limit=100")["data"]["result"]["result"]
        return [n for n in nodes if n["state"] == "ALIVE"]

    def node_ids(self) -> dict[str, str]:
        """'head' and 'worker' to node id."""
        return {("head" if n["is_head_node"] else "worker"): n["node_id"]
                for n in self.alive_nodes()}

    def app(self, name: str = "orchard") -> dict[str, Any]:
        return self._get("/api/serve/applications/")["applications"].get(name, {})

    def session_logs(self) -> Path:
        return self.root / "ray" / "session_latest" / "logs"

    # ---- serve ------------------------------------------------------------------------

    def deploy(self, args: dict[str, Any], *, name: str = "orchard",
               deployments: list[dict[str, Any]] | None = None) -> None:
        """`serve deploy` one application serving `args` on HTTP_PORT, head-only proxy;
        `deployments` is the config's per-deployment override section."""
        application: dict[str, Any] = {"name": name, "route_prefix": "/",
                                       "import_path": "deployments.app:build_app", "args": args}
        if deployments:
            application["deployments"] = deployments
        config = {
            "proxy_location": "HeadOnly",  # one proxy, so the two nodes share no HTTP port
            "http_options": {"host": "127.0.0.1", "port": HTTP_PORT},
            "controller_options": controller_options(),  # as serve_config.cluster.yaml
            "applications": [application],
        }
        path = self.root / f"deploy-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(config))
        subprocess.run([_exe("serve"), "deploy", "--address", DASHBOARD, str(path)],
                       env=self.env, check=True, capture_output=True, timeout=120)

    def wait_status(self, status: str, *, name: str = "orchard",
                    timeout_s: float = 240) -> dict[str, Any]:
        """The app once it has `status` and no replica is starting or stopping."""
        deadline = time.monotonic() + timeout_s
        app: dict[str, Any] = {}
        while time.monotonic() < deadline:
            app = self.app(name)
            states = {r["state"] for d in app.get("deployments", {}).values()
                      for r in d["replicas"]}
            if app.get("status") == status and states <= {"RUNNING"}:
                return app
            time.sleep(1)
        raise AssertionError(f"app {name} not {status}: {json.dumps(app)[:3000]}")


def _pids_with(variable: str) -> list[int]:
    """Processes whose environment holds `variable` (NAME=value), read from /proc.

    Without /proc (macOS) this finds none; actors there exit by themselves, within a minute
    of their raylet."""
    wanted = variable.encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return pids


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a node's process group: SIGTERM (how `ray stop` ends a node), then SIGKILL
    (`ray start --block` can take most of a minute to finish on SIGTERM alone)."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="package")
def cluster() -> Iterator[LocalCluster]:
    ensure_builtin("tiny")  # once here, not in every replica's constructor
    root = Path(tempfile.mkdtemp(prefix="orc-", dir="/tmp"))
    local = LocalCluster(root)
    try:
        local.start()
        yield local
    finally:
        local.stop()
        shutil.rmtree(root, ignore_errors=True)
