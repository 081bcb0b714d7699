"""A wire protocol as one plug-in of the ingress.

A protocol is its routes (a router whose handlers convert the wire request to a
`GenerationRequest` and render replica events back), the paths it owns, its error shape,
how an error and a keep-alive are written inside an open SSE stream, and how malformed
bodies are phrased. The app, the guard and the error handlers only ever ask the protocol
that owns a request's path (`ingress.registry.protocol_for`); none of them branch on
which protocol it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError

from ingress.errors import ErrorShape
from ingress.sse import data_frame
from ingress.validation import validation_message
from replicas.contract import ErrorKind

# An SSE comment: every SSE parser skips it, and proxies see bytes moving.
COMMENT_PING = ": ping\n\n"

# Top-level response field, in every API, for what the server changed about or left out
# of the request (a lowered max_tokens, a hosted tool it cannot run).
WARNINGS_FIELD = "orchard_warnings"
# The same warnings as one response header, joined by "; ", for clients that read headers.
WARNING_HEADER = "x-orchard-warning"


def _data_error_frame(body: dict[str, Any]) -> str:
    return data_frame(body)


@dataclass(frozen=True)
class WireProtocol:
    name: str
    prefixes: tuple[str, ...]  # the route paths it owns (prefix match)
    router: APIRouter
    errors: ErrorShape
    # The protocol's error body -> the SSE frame that ends an open stream with it.
    error_frame_of: Callable[[dict[str, Any]], str] = _data_error_frame
    # Sent while the replica is silent, so proxies and clients do not time out.
    ping_frame: str = COMMENT_PING
    # Closes a stream that finished cleanly (OpenAI's `[DONE]`); never after an error.
    done_frame: str = ""
    # A malformed body -> (message, offending field or None).
    validation_message: Callable[[RequestValidationError], tuple[str, str | None]] = (
        validation_message
    )

    def owns(self, path: str) -> bool:
        return path.startswith(self.prefixes)

    def error_body(self, kind: ErrorKind, message: str, param: str | None = None, *,
                   code: str | None = None) -> dict[str, Any]:
        return self.errors.error_body(kind, message, param, code=code)

    def status(self, kind: ErrorKind) -> int:
        return self.errors.status(kind)

    def error_frame(self, kind: ErrorKind, message: str, param: str | None = None, *,
                    code: str | None = None) -> str:
        """The SSE frame that reports an error once a stream's status is already sent."""
        return self.error_frame_of(self.error_body(kind, message, param, code=code))
