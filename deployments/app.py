"""`build_app(args)`: the Serve application named by `serve_config.yaml`."""

from __future__ import annotations

import time
from typing import Any

from ray.serve import Application

from deployments.config import AppArgs, ModelSettings
from deployments.ingress_deployment import Ingress
from deployments.model_deployment import ModelDeployment


def build_app(args: dict[str, Any]) -> Application:
    config = AppArgs.model_validate(args)
    created = int(time.time())
    cards = [
        {"id": m.id, "aliases": tuple(m.aliases), "created": created} for m in config.models
    ]
    models = [_model_deployment(m).bind(m.model_dump()) for m in config.models]
    return Ingress.options(
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
    ).bind(cards, *models)


def _model_deployment(settings: ModelSettings) -> Any:
    options: dict[str, Any] = {
        "name": f"model:{settings.id}",
        "max_ongoing_requests": settings.max_ongoing_requests,
        "max_queued_requests": settings.max_queued_requests,
        "ray_actor_options": settings.ray_actor_options or {"num_cpus": 0},
    }
    if settings.autoscaling_config is not None:
        options["autoscaling_config"] = settings.autoscaling_config
    else:
        options["num_replicas"] = settings.num_replicas
    return ModelDeployment.options(**options)
