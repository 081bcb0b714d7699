"""Each e2e layout is what it claims to be, so the suite's three runs test three layouts.

Serve's own status (`serve.status()`, asked by a short driver process connected to this
server's Ray cluster) lists the application's deployments: a colocated app is the model
deployment alone (its replica serves HTTP), the two-hop app has an `Ingress` in front of
it. Which process holds the HTTP port says who is in front: HAProxy where claimed, else
the replica that serves HTTP itself (Serve's direct ingress, as `serve_config.yaml` sets it),
with Serve's proxy one port above. The processes are found among the `serve run` process's descendants,
so another server on this machine never answers for ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import ray  # noqa: F401  (first: Ray puts the psutil it ships on the path)
import psutil  # noqa: E402

from deployments.serve_options import SERVE_ENV, direct_ingress_env  # noqa: E402
from tests.e2e.conftest import ROOT, Layout  # noqa: E402
from tests.serve_process import listeners  # noqa: E402

pytestmark = pytest.mark.e2e

APP = "orchard"  # serve_config.yaml's application
MODEL_DEPLOYMENT = "model:orchard-tiny"  # deployments/app.py names each model's deployment
INGRESS_DEPLOYMENT = "Ingress"  # the two-hop app's HTTP deployment (its class name)

# A driver of its own, not this process: a Ray connection here would outlive the layout's
# cluster. It prints what the assertions need, as JSON.
STATUS_DRIVER = """
import json, sys
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
status = serve.status()
print(json.dumps({
    "applications": {name: {"status": app.status.value,
                            "deployments": {d: s.status.value for d, s in app.deployments.items()}}
                     for name, app in status.applications.items()},
    "proxies": {node: s.value for node, s in status.proxies.items()},
}))
"""


def family(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cluster_of(pid: int) -> tuple[str, dict[str, str]]:
    """The address of the Ray cluster `serve run` started (its raylet's `--gcs-address`),
    and the environment a driver needs to join it: a new local cluster turns Ray's token
    auth on in its own environment (the token is in Ray's default place), so the driver
    takes the raylet's RAY_AUTH_MODE."""
    for proc in family(pid):
        try:
            address = next((a.split("=", 1)[1] for a in proc.cmdline()
                            if a.startswith("--gcs-address=")), None)
            if address is not None:
                mode = proc.environ().get("RAY_AUTH_MODE")
                return address, {**os.environ, **({"RAY_AUTH_MODE": mode} if mode else {})}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no Ray process under serve run (pid {pid})")


def serve_status(pid: int) -> dict[str, Any]:
    address, env = cluster_of(pid)
    done = subprocess.run([sys.executable, "-c", STATUS_DRIVER, address], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    status: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return status


def names(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(" ".join(proc.cmdline())[:120] or proc.name())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def test_the_layout_is_the_one_claimed(layout: Layout) -> None:
    status = serve_status(layout.pid)
    app = status["applications"][APP]
    assert app["status"] == "RUNNING", status
    deployments = app["deployments"]
    assert all(s == "HEALTHY" for s in deployments.values()), status
    if layout.name == "two-hop":
        assert set(deployments) == {INGRESS_DEPLOYMENT, MODEL_DEPLOYMENT}, status
    else:  # colocated: the model's replica serves HTTP itself, nothing in front of it
        assert set(deployments) == {MODEL_DEPLOYMENT}, status

    holders = listeners(layout.pid, layout.port)
    assert holders, f"nothing under serve run listens on {layout.port}"
    haproxy = [p for p in family(layout.pid) if p.name() == "haproxy"]
    if layout.name.endswith("-haproxy"):
        # HAProxy in front: it holds the HTTP port, and Serve's proxy actor does not.
        assert haproxy, names(family(layout.pid))
        assert {p.name() for p in holders} == {"haproxy"}, names(holders)
    else:  # the replica that serves HTTP holds the port; Serve's proxy is one above it
        assert not haproxy, names(haproxy)
        http = "ServeReplica:orchard:" + (INGRESS_DEPLOYMENT if layout.name == "two-hop"
                                          else MODEL_DEPLOYMENT)
        assert all(http in " ".join(p.cmdline()) for p in holders), names(holders)
        proxies = listeners(layout.pid, layout.port + 1)
        assert proxies and all("ProxyActor" in " ".join(p.cmdline()) for p in proxies), \
            names(proxies)


def test_serve_runs_with_the_configs_serve_settings(layout: Layout) -> None:
    # serve_config.yaml's `controller_options` reach the controller, and through it every
    # proxy and replica it starts (so the replica serves the port itself and gRPC carries the
    # proxy's traffic, deployments/serve_options.py): checked in the processes' own
    # environments. Behind HAProxy the direct-ingress port settings are left to Serve.
    serve_procs = []
    for proc in family(layout.pid):
        try:
            line = " ".join(proc.cmdline())
            if "ServeController" in line or "ProxyActor" in line or "ServeReplica" in line:
                serve_procs.append((line[:80], proc.environ()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    kinds = {k for k in ("ServeController", "ProxyActor", "ServeReplica")
             if any(k in line for line, _ in serve_procs)}
    expected = {"ServeController", "ServeReplica"} | (
        set() if layout.name.endswith("-haproxy") else {"ProxyActor"})
    assert expected <= kinds, [line for line, _ in serve_procs]
    expected_env = {**SERVE_ENV, **({} if layout.name.endswith("-haproxy")
                                    else direct_ingress_env(layout.port))}
    for line, env in serve_procs:
        assert {k: env.get(k) for k in expected_env} == expected_env, line
