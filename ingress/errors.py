"""One error taxonomy, rendered in each API family's own shape and status code.

An `ErrorShape` is how one family writes an error body (OpenAI's `{"error": {...}}` or
Anthropic's `{"type": "error", ...}`) and where its status codes differ from the common
table. Wire protocols (`ingress/protocol.py`) each name the shape they speak; this module
knows none of them, so anything may import it.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ingress.wire_json import JSONBody
from replicas.contract import ErrorKind
from replicas.errors import RateLimitedError, ReplicaError

# The common status codes; a shape overrides some (Anthropic: 529 for overload).
STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.CONTEXT_LENGTH: 400,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.RATE_LIMITED: 429,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.TIMEOUT: 504,
    ErrorKind.INTERNAL: 500,
}

_OPENAI_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.CONTEXT_LENGTH: "invalid_request_error",
    ErrorKind.UNAUTHORIZED: "authentication_error",
    ErrorKind.RATE_LIMITED: "rate_limit_exceeded",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.OVERLOADED: "overloaded_error",
    ErrorKind.TIMEOUT: "timeout_error",
    ErrorKind.INTERNAL: "internal_error",
}

_ANTHROPIC_TYPE = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.CONTEXT_LENGTH: "invalid_request_error",
    ErrorKind.UNAUTHORIZED: "authentication_error",
    ErrorKind.RATE_LIMITED: "rate_limit_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.OVERLOADED: "overloaded_error",
    ErrorKind.TIMEOUT: "timeout_error",
    ErrorKind.INTERNAL: "api_error",
}

RETRY_AFTER_SECONDS = 1
_OPENAI_CODE = {ErrorKind.CONTEXT_LENGTH: "context_length_exceeded",
                ErrorKind.RATE_LIMITED: "rate_limit_exceeded"}

# (kind, message, param, code) -> body. `code` refines the kind where an edge needs a more
# precise name than the taxonomy has (e.g. 413 `request_too_large`).
BodyFn = Callable[[ErrorKind, str, "str | None", "str | None"], dict[str, Any]]


def _openai_body(kind: ErrorKind, message: str, param: str | None,
                 code: str | None) -> dict[str, Any]:
    if code is None:
        code = _OPENAI_CODE.get(kind, kind.value)
    return {"error": {"message": message, "type": _OPENAI_TYPE[kind], "param": param,
                      "code": code}}


def _anthropic_body(kind: ErrorKind, message: str, param: str | None,
                    code: str | None) -> dict[str, Any]:
    # Anthropic has no `code` or `param`: a refining code is its error type.
    return {"type": "error", "error": {"type": code or _ANTHROPIC_TYPE[kind], "message": message}}


@dataclass(frozen=True)
class ErrorShape:
    name: str
    body: BodyFn
    status_overrides: Mapping[ErrorKind, int] = field(default_factory=dict)

    def error_body(self, kind: ErrorKind, message: str, param: str | None = None, *,
                   code: str | None = None) -> dict[str, Any]:
        return self.body(kind, message, param, code)

    def status(self, kind: ErrorKind) -> int:
        return self.status_overrides.get(kind, STATUS[kind])


OPENAI_ERRORS = ErrorShape("openai", _openai_body)
ANTHROPIC_ERRORS = ErrorShape("anthropic", _anthropic_body, {ErrorKind.OVERLOADED: 529})


class ErrorRenderer(typing.Protocol):
    """Anything that renders the taxonomy: an `ErrorShape` or a `WireProtocol`."""

    def error_body(self, kind: ErrorKind, message: str, param: str | None = None, *,
                   code: str | None = None) -> dict[str, Any]: ...

    def status(self, kind: ErrorKind) -> int: ...


def error_response(kind: ErrorKind, message: str, protocol: ErrorRenderer, *,
                   param: str | None = None, code: str | None = None,
                   status: int | None = None, retry_after_s: float | None = None) -> JSONBody:
    headers = None
    if kind in (ErrorKind.OVERLOADED, ErrorKind.RATE_LIMITED):
        # Whole seconds, rounded up: a client that waits less is refused again.
        wait = RETRY_AFTER_SECONDS if retry_after_s is None else max(1, math.ceil(retry_after_s))
        headers = {"Retry-After": str(wait)}
    return JSONBody(
        protocol.error_body(kind, message, param, code=code),
        status_code=status or protocol.status(kind),
        headers=headers,
    )


class CodedError(ReplicaError):
    """A failure the edge names more precisely than its kind (OpenAI's `code`), e.g. 404
    `previous_response_not_found`."""

    def __init__(self, kind: ErrorKind, message: str, *, code: str,
                 param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.kind = kind
        self.code = code


# How long a client waits before it asks a loading model again.
LOADING_RETRY_AFTER_S = 2.0
# ... and a model whose replicas failed to start: Serve retries them, with a growing backoff.
FAILED_RETRY_AFTER_S = 30.0


class ModelLoadingError(ReplicaError):
    """A configured model with no replica serving yet, past the replica wait, or at once
    where its replicas failed to start: the protocol's overloaded answer (OpenAI's 503,
    Anthropic's 529 `overloaded_error`, what every other "no replica now" is) with
    `Retry-After`, which both SDKs honour."""

    kind = ErrorKind.OVERLOADED

    def __init__(self, model: str, *, failed: bool = False) -> None:
        self.retry_after_s = FAILED_RETRY_AFTER_S if failed else LOADING_RETRY_AFTER_S
        why = ("its replicas failed to start (Serve retries them; the replica's log says why)"
               if failed else "it is still loading (or waits for a node to run on)")
        super().__init__(f"no replica of the model '{model}' serves yet: {why}; retry in "
                         f"{math.ceil(self.retry_after_s)} s", param="model")


def replica_error_response(exc: ReplicaError, protocol: ErrorRenderer) -> JSONBody:
    code = exc.code if isinstance(exc, CodedError) else None
    retry = exc.retry_after_s if isinstance(exc, (RateLimitedError, ModelLoadingError)) \
        else None
    return error_response(exc.kind, exc.message, protocol, param=exc.param, code=code,
                          retry_after_s=retry)


# Edge refusals with no status of their own in the taxonomy: status -> (kind, code).
# 413 `request_too_large` is Anthropic's documented type and OpenAI's code.
_EDGE = {413: (ErrorKind.INVALID_REQUEST, "request_too_large")}


def edge_error_response(status: int, message: str, protocol: ErrorRenderer) -> JSONBody:
    kind, code = _EDGE[status]
    return error_response(kind, message, protocol, code=code, status=status)

