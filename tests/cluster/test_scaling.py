"""Scaling as docs/cluster.md section 6 promises it: a `deployments:` override changes one
model's replica count in place (down and up) without restarting any other replica and
without a failed request, and `autoscaling_config` scales a model up under load and back
down after it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.cluster.conftest import LocalCluster
from tests.cluster.test_two_node import StreamLoad, app_args, model_replicas

pytestmark = pytest.mark.cluster
TINY = "model:orchard-tiny"
STOPS = "model:orchard-tiny-stops"


def replica_ids(app: dict[str, Any]) -> dict[str, set[str]]:
    return {name: {r["replica_id"] for r in d["replicas"]}
            for name, d in app["deployments"].items()}


def wait_running_count(cluster: LocalCluster, deployment: str, count: int,
                       timeout_s: float = 240) -> dict[str, Any]:
    """The app once `deployment` has exactly `count` replicas, all running. (Right after a
    deploy the app may still report the old state as RUNNING, so the count is the proof.)"""
    deadline = time.monotonic() + timeout_s
    app: dict[str, Any] = {}
    while time.monotonic() < deadline:
        app = cluster.app()
        replicas = app.get("deployments", {}).get(deployment, {}).get("replicas", [])
        if len(replicas) == count and all(r["state"] == "RUNNING" for r in replicas):
            return app
        time.sleep(0.5)
    raise AssertionError(f"{deployment} never had {count} running replicas: {app}")


def wait_for(load: StreamLoad, ok: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while load.ok < ok and not load.failures and time.monotonic() < deadline:
        time.sleep(0.2)
    assert load.ok >= ok, (load.ok, load.failures)


def test_a_deployments_override_rescales_in_place_under_load(cluster: LocalCluster) -> None:
    cluster.ensure_worker()
    cluster.deploy(app_args(2))
    start = replica_ids(wait_running_count(cluster, TINY, 2))
    with StreamLoad(threads=4) as load:
        wait_for(load, 4)
        cluster.deploy(app_args(2), deployments=[{"name": TINY, "num_replicas": 1}])
        down = replica_ids(wait_running_count(cluster, TINY, 1))
        # Scaled down: one of the two kept, nothing else replaced (no rolling update).
        assert down[TINY] < start[TINY]
        assert down[STOPS] == start[STOPS] and down["Ingress"] == start["Ingress"]
        wait_for(load, load.ok + 4)

        cluster.deploy(app_args(2), deployments=[{"name": TINY, "num_replicas": 2}])
        up = replica_ids(wait_running_count(cluster, TINY, 2))
        assert down[TINY] < up[TINY]  # the kept replica is still serving
        assert up[STOPS] == start[STOPS] and up["Ingress"] == start["Ingress"]
        wait_for(load, load.ok + 4)
    assert load.failures == []


def test_autoscaling_config_scales_up_under_load_and_back_down(cluster: LocalCluster) -> None:
    cluster.ensure_worker()
    args = app_args(1)
    tiny = args["models"][0]
    del tiny["num_replicas"]
    # Fast, small windows so a test can watch both directions; the keys are Ray's own.
    tiny["autoscaling_config"] = {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
        "upscale_delay_s": 0.5, "downscale_delay_s": 3, "metrics_interval_s": 0.5,
        "look_back_period_s": 1,
    }
    cluster.deploy(args)
    wait_running_count(cluster, TINY, 1)
    with StreamLoad(threads=4) as load:
        wait_for(load, 4)
        wait_running_count(cluster, TINY, 2, timeout_s=180)  # 4 streams, target 1 each
        wait_for(load, load.ok + 4)
    wait_running_count(cluster, TINY, 1, timeout_s=180)  # idle again: back to the minimum
    assert load.failures == []
