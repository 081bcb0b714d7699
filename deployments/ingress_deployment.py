"""The HTTP ingress deployment: the FastAPI app from `ingress/`, wired to model handles."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.handle_client import RayModelClient
from ingress.app import create_app
from ingress.client import ModelCard


@serve.deployment
@serve.ingress()
class Ingress:
    def __init__(self, cards: list[dict[str, Any]], *handles: DeploymentHandle) -> None:
        model_cards = [ModelCard(**card) for card in cards]
        by_id = {card.id: handle for card, handle in zip(model_cards, handles)}
        self._client = RayModelClient(model_cards, by_id)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Built in the replica, after __init__, so the app holds this replica's client
        # (an app built at import time would be pickled and served as a copy).
        return create_app(self._client)
