"""The HTTP ingress deployment: the FastAPI app from `ingress/`, wired to model handles."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from fastapi import FastAPI
from pydantic import SecretStr
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.adapter_admin import ServedAdapters, StoreCalls
from deployments.adapter_store import StoreRef
from deployments.board import BoardView
from deployments.config import AppArgs, IngressSettings, ObservabilitySettings, ResponsesSettings
from deployments.metrics import stream_resumes
from deployments.model_clients import RayModelClient, ResumePolicy
from deployments.model_states import ServeModelStates
from deployments.observability import request_observer
from deployments.responses.store import response_store
from deployments.responses.usage import usage_store
from deployments.tenant_counts import shared_counts
from deployments.tenants import TenantSettings, tenant_policies
from deployments.serve_options import bind_like_serves_proxy
from ingress.app import create_app
from ingress.client import ModelCard
from ingress.options import EdgeOptions, ImageLimits


@dataclass(frozen=True)
class EdgeArgs:
    """The ingress's share of the config. Keys stay `SecretStr` on their way to the replica,
    so printing the deployment's arguments never shows one."""

    ingress: IngressSettings = IngressSettings.model_validate({})  # frozen: safely shared
    api_keys: tuple[SecretStr, ...] = ()
    api_keys_env: str | None = None
    observability: ObservabilitySettings = ObservabilitySettings()
    responses: ResponsesSettings = ResponsesSettings()
    tenants: tuple[tuple[str, TenantSettings], ...] = ()  # names key env variables, not keys

    @property
    def limited(self) -> bool:
        """Whether some tenant has a limit to count."""
        return any(t.max_concurrent is not None or t.tokens_per_minute is not None
                   for _, t in self.tenants)

    @classmethod
    def from_config(cls, config: AppArgs) -> "EdgeArgs":
        return cls(config.ingress, tuple(config.api_keys), config.api_keys_env,
                   config.observability, config.responses, tuple(config.tenants.items()))

    def options(self, environ: Mapping[str, str]) -> EdgeOptions:
        """Resolved where the ingress runs, since that is where the key variable is set."""
        keys = [key.get_secret_value().strip() for key in self.api_keys]
        if self.api_keys_env is not None:
            listed = [k.strip() for k in environ.get(self.api_keys_env, "").split(",")]
            if not any(listed):  # named but empty: refuse to start rather than run open
                raise ValueError(f"api_keys_env is {self.api_keys_env}, but that variable is "
                                 "unset or empty where the ingress runs")
            keys.extend(k for k in listed if k)
        settings = self.ingress
        return EdgeOptions(
            api_keys=frozenset(keys),
            cors_origins=tuple(settings.cors_origins),
            max_body_bytes=settings.max_body_bytes,
            request_timeout_s=settings.request_timeout_s,
            max_stops=settings.max_stops,
            max_stop_chars=settings.max_stop_chars,
            images=ImageLimits(**settings.images.model_dump()),
            tenants=tenant_policies(dict(self.tenants), environ),
        )


@serve.deployment
@serve.ingress()
class Ingress:
    def __init__(self, cards: list[dict[str, Any]], *handles: DeploymentHandle,
                 edge: EdgeArgs = EdgeArgs()) -> None:
        bind_like_serves_proxy()  # this replica may hold the port (serve_options.py)
        model_cards = [ModelCard(**card) for card in cards]
        by_id = {card.id: handle for card, handle in zip(model_cards, handles)}
        settings = edge.ingress
        self._cluster = BoardView(serve.get_replica_context().app_name)
        counted = stream_resumes() if edge.observability.metrics else None
        cluster = self._cluster

        def resumed(model: str) -> None:
            cluster.resumed(model)  # the fault timeline
            if counted is not None:
                counted(model)

        # Which models have no replica running yet (`build_app` names each `model:ID`).
        self._states = ServeModelStates(serve.get_replica_context().app_name,
                                        {card.id: f"model:{card.id}" for card in model_cards})
        self._client = RayModelClient(
            model_cards, by_id, replica_wait_s=settings.replica_wait_s,
            resume=ResumePolicy(settings.resume_attempts, settings.resume_wait_s),
            on_resume=resumed, states=self._states)
        # LoRA adapters loaded at run time: checked on one replica, then every one follows.
        async def validate(model: str, name: str, path: str) -> str | None:
            why: str | None = await by_id[model].load_adapter.remote(name, path)
            return why

        self._adapters = ServedAdapters(
            model_cards, self._client.set_cards,
            StoreCalls(StoreRef(serve.get_replica_context().app_name)), validate)
        self._adapters.watch()
        self._options = edge.options(os.environ)
        self._store = response_store(edge.ingress.num_replicas, edge.responses)
        self._observer = request_observer(edge.observability)
        # Usage per tenant, beside the stored responses (only with tenants: it is per tenant).
        self._usage = usage_store(edge.responses, serve.get_replica_context().app_name) \
            if edge.tenants else None
        # Tenant limits counted across the HTTP replicas, where there are several.
        self._tenant_counts = shared_counts(settings.num_replicas, edge.limited,
                                            serve.get_replica_context().app_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Built in the replica, after __init__, so the app holds this replica's client
        # (an app built at import time would be pickled and served as a copy).
        return create_app(self._client, self._options, response_store=self._store,
                          observer=self._observer, usage=self._usage, cluster=self._cluster,
                          model_states=self._states, adapter_control=self._adapters,
                          tenant_counts=self._tenant_counts)
