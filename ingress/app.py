"""The FastAPI application: every wire protocol's routes, the edge's protections, and one
error handler per failure type, each rendering in the protocol that owns the path."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ingress.auth import ApiKeyMiddleware, ApiKeys
from ingress.client import ModelCard, ModelClient, ModelState, ModelStates, require_model
from ingress.cluster import ClusterView, router as cluster_router
from ingress.errors import error_response, replica_error_response
from ingress.guard import GuardMiddleware
from ingress.limits import BodyLimitMiddleware, LimitedClient
from ingress.lora_admin import AdapterControl, router as adapters_router
from ingress.observe import ObservedClient, ObserveMiddleware, RequestObserver
from ingress.options import EdgeOptions
from ingress.registry import PROTOCOLS, protocol_for
from ingress.responses.store import MemoryResponseStore, ResponseStore
from ingress.tenancy.door import TenantMiddleware, tenanted_client
from ingress.tenancy.shared import SharedCounts
from ingress.tenancy.usage import UsageStore, router as usage_router
from replicas.contract import ErrorKind
from replicas.errors import ReplicaError

_HTTP_KIND = {401: ErrorKind.UNAUTHORIZED, 404: ErrorKind.NOT_FOUND, 503: ErrorKind.OVERLOADED}
# How long `/v1/models` waits for a replica to say what context it serves.
_SERVED_LENGTH_WAIT_S = 2.0

log = logging.getLogger(__name__)


def create_app(client: ModelClient, options: EdgeOptions = EdgeOptions(),
               response_store: ResponseStore | None = None,
               observer: RequestObserver | None = None,
               cluster: ClusterView | None = None,
               usage: UsageStore | None = None,
               model_states: ModelStates | None = None,
               adapter_control: AdapterControl | None = None,
               tenant_counts: SharedCounts | None = None) -> FastAPI:
    """The app. `response_store` keeps stored Responses API responses; the default lives in
    this process only, so deployments with several ingress replicas pass a shared one.
    `observer` gets one record per finished generation request (metrics, request logs);
    without one, nothing is traced. `cluster`: the snapshot `GET /v1/cluster` and
    `/dashboard` show (`ingress/cluster.py`); without one they are a 404. `model_states`:
    which models are still loading, for `/v1/models` (without one, all are ready).
    `adapter_control`: LoRA adapters loaded at run time (`ingress/lora_admin.py`).
    `tenant_counts`: where tenant limits are counted across HTTP replicas (none: here)."""
    app = FastAPI(title="Orchard", version="0.1.0")
    # Each key's tenant, its limits and usage (`ingress/tenancy/`; `usage`: where it is kept).
    limited = tenanted_client(app, LimitedClient(client, options), options.tenants, usage,
                              tenant_counts)
    app.state.client = limited if observer is None else ObservedClient(limited)
    app.state.served_lengths = {}  # model id -> the context its replica serves
    app.state.image_limits = options.images  # for the routes' `MediaParts.for_model`
    app.state.cluster = cluster
    app.state.model_states = model_states
    app.state.adapter_control = adapter_control
    # `is None`, not `or`: a store with `__len__` is falsy while empty, and `or` would
    # swap a fresh durable store for one in memory (issue 32).
    app.state.response_store = MemoryResponseStore() if response_store is None \
        else response_store
    _install_error_handlers(app)
    _install_routes(app)
    _install_middleware(app, options, observer)
    return app


def _install_middleware(app: FastAPI, options: EdgeOptions,
                        observer: RequestObserver | None) -> None:
    # Added innermost first. From the outside in: CORS answers preflights without a key;
    # the guard's deadline and error handling cover everything after it; auth rejects on
    # headers alone, before a possibly large body is read; then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_body_bytes)
    keys = ApiKeys(options.api_keys)
    if options.tenants:  # the key's tenant: auth, limits' headers, priority
        app.add_middleware(TenantMiddleware, tenants=app.state.tenants, ledger=app.state.ledger)
    elif keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(GuardMiddleware, timeout_s=options.request_timeout_s)
    if observer is not None:  # outside the guard: it sees the guard's 500s and 504s
        app.add_middleware(ObserveMiddleware, observer=observer, client=app.state.client)
    if options.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.cors_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=["Retry-After"])


def _install_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        client: ModelClient = request.app.state.client
        cards = client.models()
        lengths = await _served_lengths(request.app, cards)
        states = await _states(request.app)
        data = [_model_entry(card, name, lengths[card.id], states.get(card.id, "ready"))
                for card in cards
                for name in (card.id, *card.aliases, *card.adapter_names())]
        return {"object": "list", "data": data}

    # `:path`: Hub ids hold a slash (`mlx-community/Qwen3-4B`), which the OpenAI SDK sends
    # percent-encoded and older clients raw; both arrive here decoded.
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        card = require_model(request.app.state.client, model_id)  # unknown: the 404
        lengths = await _served_lengths(request.app, [card])
        state = (await _states(request.app)).get(card.id, "ready")
        return _model_entry(card, model_id, lengths[card.id], state)

    for protocol in PROTOCOLS:
        app.include_router(protocol.router)
    app.include_router(usage_router)
    app.include_router(cluster_router)
    app.include_router(adapters_router)


async def _served_lengths(app: FastAPI, cards: Sequence[ModelCard]) -> dict[str, int | None]:
    """Each model's context as its replica serves it: the model's, under `max_model_len`,
    under what KV memory holds for one sequence, which only the loaded replica knows. Asked
    once per model and remembered; the configured value while no replica answers."""
    known: dict[str, int] = app.state.served_lengths

    async def ask(card: ModelCard) -> None:
        try:
            info = await asyncio.wait_for(app.state.client.tokenizer_info(card.id),
                                          _SERVED_LENGTH_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - a listing must not fail for a loading model
            log.debug("model %s did not say its served context: %r", card.id, exc)
            return
        known[card.id] = info.model_max_length

    await asyncio.gather(*(ask(card) for card in cards if card.id not in known))
    return {card.id: known.get(card.id, card.context_length) for card in cards}


async def _states(app: FastAPI) -> Mapping[str, ModelState]:
    states: ModelStates | None = app.state.model_states
    return {} if states is None else await states.states()


def _model_entry(card: ModelCard, name: str, context_length: int | None,
                 state: ModelState) -> dict[str, Any]:
    """One model object in OpenAI's shape, for the card's id or one of its aliases (`root`
    is the served id): what `GET /v1/models` lists and `GET /v1/models/{id}` returns.
    `state`: `loading` while no replica serves it yet (its requests wait for one, then are
    refused as overloaded), `ready`."""
    return {"id": name, "object": "model", "created": card.created, "owned_by": card.owned_by,
            "root": card.id, "max_model_len": context_length,
            "capabilities": list(card.capabilities), "state": state}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ReplicaError)
    async def replica_error(request: Request, exc: ReplicaError) -> Response:
        return replica_error_response(exc, protocol_for(request.scope))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        protocol = protocol_for(request.scope)
        message, param = protocol.validation_message(exc)
        return error_response(ErrorKind.INVALID_REQUEST, message, protocol, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = _HTTP_KIND.get(exc.status_code, ErrorKind.INVALID_REQUEST)
        return error_response(kind, str(exc.detail), protocol_for(request.scope),
                              status=exc.status_code)


__all__ = ["create_app"]
