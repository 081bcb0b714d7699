"""API keys: when any are configured, every route but `/health` requires one.

Clients send a key the way their SDK does: `Authorization: Bearer KEY` (OpenAI) or
`x-api-key: KEY` (Anthropic); either header is accepted on every route. A missing or wrong
key is a 401 in the protocol's own error shape. Keys are never logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from ingress.errors import error_response
from ingress.registry import protocol_for, route_path
from replicas.contract import ErrorKind

# Load balancers and orchestrators probe this without credentials.
OPEN_PATHS = frozenset({"/health"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """A set of accepted keys, held as SHA-256 digests.

    Digests keep the keys out of reprs and memory dumps, and give every comparison the same
    length, so `hmac.compare_digest` takes the same time whatever the presented key is.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(key) for key in keys if key)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._digests)} keys)"

    def accepts(self, presented: str) -> bool:
        digest = _digest(presented)
        accepted = False
        for known in self._digests:  # no early exit: timing does not reveal which key matched
            accepted |= hmac.compare_digest(known, digest)
        return accepted


def presented_keys(headers: Iterable[tuple[bytes, bytes]]) -> list[str]:
    """The keys a request carries, from either header (raw ASGI headers, lower-case names)."""
    keys = []
    for name, value in headers:
        if name == b"x-api-key":
            keys.append(value.decode("latin-1").strip())
        elif name == b"authorization":
            scheme, _, credential = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                keys.append(credential.strip())
    return [key for key in keys if key]


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = presented_keys(scope["headers"])
        if any(self.keys.accepts(key) for key in presented):
            await self.app(scope, receive, send)
            return
        message = (
            "invalid API key" if presented
            else "an API key is required: send `Authorization: Bearer KEY` or `x-api-key: KEY`"
        )
        response = error_response(ErrorKind.UNAUTHORIZED, message,
                                  protocol_for(scope))
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
