"""Colocated serving (`ingress.colocate`): the model's own replicas serve HTTP.

The default app relays every chunk proxy -> ingress replica -> model replica, two Ray hops
and three processes per token. With one model, the ingress adapters can run in the model
replica's process over the engine directly: the proxy is the only hop left. On a small
machine that CPU goes back to decoding (load/RESULTS.md, issue 2).
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI
from ray import serve

from deployments.adapter_admin import ServedAdapters, StoreCalls
from deployments.adapter_store import StoreRef
from deployments.board import BoardView
from deployments.config import ModelSettings
from deployments.ingress_deployment import EdgeArgs
from deployments.model_clients import LocalModelClient
from deployments.model_deployment import ReplicaOwner
from deployments.observability import request_observer
from deployments.responses.store import response_store
from deployments.responses.usage import usage_store
from deployments.tenant_counts import shared_counts
from deployments.serve_options import bind_like_serves_proxy
from ingress.app import create_app
from ingress.client import ModelCard


@serve.deployment
@serve.ingress()
class ColocatedModel(ReplicaOwner):
    def __init__(self, settings: dict[str, Any], card: dict[str, Any],
                 edge: EdgeArgs = EdgeArgs()) -> None:
        bind_like_serves_proxy()  # this replica may hold the port (serve_options.py)
        config = ModelSettings.model_validate(settings)
        super().__init__(config, edge.ingress.max_stops, edge.observability)
        self._client = LocalModelClient(self._replica, ModelCard(**card),
                                        config.max_ongoing_requests)
        self._options = edge.options(os.environ)
        scaled = config.autoscaling_config is not None
        self._store = response_store("auto" if scaled else config.num_replicas, edge.responses)
        self._observer = request_observer(edge.observability)
        self._usage = usage_store(edge.responses, serve.get_replica_context().app_name) \
            if edge.tenants else None  # usage per tenant, beside the stored responses
        # Tenant limits counted across the replicas serving HTTP, where there are several.
        self._tenant_counts = shared_counts("auto" if scaled else config.num_replicas,
                                            edge.limited, serve.get_replica_context().app_name)
        self._cluster = BoardView(serve.get_replica_context().app_name)
        # LoRA adapters loaded at run time: checked here, then every replica follows.
        self._adapter_control = ServedAdapters(
            [ModelCard(**card)], self._client.set_cards,
            StoreCalls(StoreRef(serve.get_replica_context().app_name)),
            lambda model, name, path: self.load_adapter(name, path))
        self._adapter_control.watch()

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Built in the replica, after __init__, so the app holds this replica's engine.
        return create_app(self._client, self._options, response_store=self._store,
                          observer=self._observer, usage=self._usage, cluster=self._cluster,
                          adapter_control=self._adapter_control,
                          tenant_counts=self._tenant_counts)
