"""One error taxonomy, rendered in each protocol's own shape and status code."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Mapping

from fastapi.responses import JSONResponse

from replicas.contract import ErrorKind


class Protocol(str, Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"


# OpenAI-style status codes; Anthropic differs only for overload (529, "overloaded_error").
_STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.CONTEXT_LENGTH: 400,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.INTERNAL: 500,
}

_OPENAI_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.CONTEXT_LENGTH: "invalid_request_error",
    ErrorKind.UNAUTHORIZED: "authentication_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.OVERLOADED: "overloaded_error",
    ErrorKind.INTERNAL: "internal_error",
}

_ANTHROPIC_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.CONTEXT_LENGTH: "invalid_request_error",
    ErrorKind.UNAUTHORIZED: "authentication_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.OVERLOADED: "overloaded_error",
    ErrorKind.INTERNAL: "api_error",
}

RETRY_AFTER_SECONDS = 1


def route_path(scope: Mapping[str, Any]) -> str:
    """The path the app routes on: Serve mounts an app under its route prefix, which the
    ASGI scope carries as `root_path` and leaves in `path`."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def protocol_for(scope: Mapping[str, Any]) -> Protocol:
    """Which API's error shape a request gets, by its route (`/v1/messages*`: Anthropic)."""
    return Protocol.ANTHROPIC if route_path(scope).startswith("/v1/messages") else Protocol.OPENAI


def status_for(kind: ErrorKind, protocol: Protocol) -> int:
    if kind is ErrorKind.OVERLOADED and protocol is Protocol.ANTHROPIC:
        return 529
    return _STATUS[kind]


def error_body(
    kind: ErrorKind, message: str, protocol: Protocol, *, param: str | None = None
) -> dict[str, Any]:
    if protocol is Protocol.ANTHROPIC:
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPE[kind], "message": message}}
    code = "context_length_exceeded" if kind is ErrorKind.CONTEXT_LENGTH else kind.value
    return {
        "error": {"message": message, "type": _OPENAI_TYPE[kind], "param": param, "code": code}
    }


def error_response(
    kind: ErrorKind, message: str, protocol: Protocol, *, param: str | None = None
) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if kind is ErrorKind.OVERLOADED else None
    return JSONResponse(
        error_body(kind, message, protocol, param=param),
        status_code=status_for(kind, protocol),
        headers=headers,
    )


# Edge failures outside the replica taxonomy: status -> (OpenAI type, OpenAI code, Anthropic
# type). 413 `request_too_large` is Anthropic's documented type; a request that outlives
# its deadline is a gateway timeout, as from any proxy in front of a slow upstream.
_EDGE = {
    413: ("invalid_request_error", "request_too_large", "request_too_large"),
    504: ("timeout_error", "timeout", "timeout_error"),
}


def edge_error_body(status: int, message: str, protocol: Protocol) -> dict[str, Any]:
    openai_type, code, anthropic_type = _EDGE[status]
    if protocol is Protocol.ANTHROPIC:
        return {"type": "error", "error": {"type": anthropic_type, "message": message}}
    return {"error": {"message": message, "type": openai_type, "param": None, "code": code}}


def edge_error_response(status: int, message: str, protocol: Protocol) -> JSONResponse:
    return JSONResponse(edge_error_body(status, message, protocol), status_code=status)


def error_json(kind: ErrorKind, message: str, protocol: Protocol) -> str:
    """The error body as compact JSON, for an error sent inside an already-open stream."""
    return json.dumps(error_body(kind, message, protocol), separators=(",", ":"))
