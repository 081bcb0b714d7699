"""The HTTP ingress deployment: the FastAPI app from `ingress/`, wired to model handles."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.handle_client import RayModelClient
from ingress.app import create_app
from ingress.client import ModelCard

fastapi_app = create_app()


@serve.deployment
@serve.ingress(fastapi_app)
class Ingress:
    def __init__(self, cards: list[dict[str, Any]], *handles: DeploymentHandle) -> None:
        model_cards = [ModelCard(**card) for card in cards]
        by_id = {card.id: handle for card, handle in zip(model_cards, handles)}
        fastapi_app.state.client = RayModelClient(model_cards, by_id)
