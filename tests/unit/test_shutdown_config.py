"""How the app's deployments stop (`deployments.app`): a stopping replica checks for its
in-flight requests every `DRAIN_POLL_S` rather than Serve's 2 s, which it slept before the
first check too (an idle app's Ctrl-C waited 4 s for nothing: the ingress, then the models),
while the drain itself still lasts up to each model's `graceful_shutdown_timeout_s`."""

from __future__ import annotations

from typing import Any

from deployments.app import DRAIN_POLL_S, build_app


def _config(deployment: Any) -> Any:
    return deployment._deployment_config


def test_every_deployment_polls_its_drain_often_and_keeps_its_drain_budget() -> None:
    app = build_app({"models": [
        {"id": "a", "source": "builtin:tiny"},
        {"id": "b", "source": "builtin:tiny", "graceful_shutdown_timeout_s": 30}]})
    ingress = app._bound_deployment
    models = {m._bound_deployment.name: m._bound_deployment for m in ingress.init_args[1:]}
    assert sorted(models) == ["model:a", "model:b"]
    assert DRAIN_POLL_S < 2.0  # Serve's default
    for deployment in (ingress, *models.values()):
        assert _config(deployment).graceful_shutdown_wait_loop_s == DRAIN_POLL_S
    # A replacement still drains what it serves: each model its own budget, the ingress
    # (which relays every model's streams) the longest.
    assert _config(models["model:a"]).graceful_shutdown_timeout_s == 300
    assert _config(models["model:b"]).graceful_shutdown_timeout_s == 30
    assert _config(ingress).graceful_shutdown_timeout_s == 300


def test_a_colocated_model_polls_its_drain_often() -> None:
    app = build_app({"models": [{"id": "a", "source": "builtin:tiny"}]})
    assert app._bound_deployment.name == "model:a"
    assert _config(app._bound_deployment).graceful_shutdown_wait_loop_s == DRAIN_POLL_S
