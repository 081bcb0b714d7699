"""The FastAPI application: routes, auth, and one error handler for every protocol."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ingress.client import ModelClient
from ingress.anthropic import anthropic_validation_message
from ingress.errors import Protocol, error_response, protocol_for_path
from ingress.validation import validation_message
from replicas.contract import ErrorKind
from replicas.errors import ReplicaError

log = logging.getLogger(__name__)

_HTTP_KIND = {401: ErrorKind.UNAUTHORIZED, 404: ErrorKind.NOT_FOUND, 503: ErrorKind.OVERLOADED}


def create_app(client: ModelClient | None = None) -> FastAPI:
    app = FastAPI(title="Orchard", version="0.1.0")
    app.state.client = client
    _install_error_handlers(app)
    _install_routes(app)
    return app


def _install_routes(app: FastAPI) -> None:
    from ingress.anthropic.routes import router as anthropic_router
    from ingress.openai.routes import router as openai_router

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        client: ModelClient = request.app.state.client
        data = []
        for card in client.models():
            for name in (card.id, *card.aliases):
                data.append({"id": name, "object": "model", "created": card.created,
                             "owned_by": card.owned_by, "root": card.id,
                             "max_model_len": card.context_length})
        return {"object": "list", "data": data}

    app.include_router(openai_router)
    app.include_router(anthropic_router)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ReplicaError)
    async def replica_error(request: Request, exc: ReplicaError) -> Response:
        return error_response(exc.kind, exc.message, protocol_for_path(request.url.path),
                              param=exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> Response:
        protocol = protocol_for_path(request.url.path)
        if protocol is Protocol.ANTHROPIC:
            message, param = anthropic_validation_message(exc), None
        else:
            message, param = validation_message(exc)
        return error_response(ErrorKind.INVALID_REQUEST, message, protocol, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = _HTTP_KIND.get(exc.status_code, ErrorKind.INVALID_REQUEST)
        response = error_response(kind, str(exc.detail), protocol_for_path(request.url.path))
        response.status_code = exc.status_code
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        # Never echo internals: a generic message plus an id to find the log line.
        error_id = uuid.uuid4().hex[:16]
        log.error("internal error %s on %s: %s", error_id, request.url.path, type(exc).__name__,
                  exc_info=exc)
        return error_response(ErrorKind.INTERNAL, f"internal error (request id {error_id})",
                              protocol_for_path(request.url.path))


__all__ = ["create_app"]
