"""API keys: when any are configured, every route but `/health` requires one.

Clients send a key the way their SDK does: `Authorization: Bearer KEY` (OpenAI) or
`x-api-key: KEY` (Anthropic); either header is accepted on every route. A browser opening
`/dashboard` cannot set either, so HTTP Basic's password is a key too (any user name): the
dashboard's 401 asks for it, and the browser then sends it with the page's own requests.
A missing or wrong key is a 401 in the protocol's own error shape. Keys are never logged or
echoed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from ingress.errors import error_response
from ingress.registry import protocol_for, route_path
from replicas.contract import ErrorKind

# Load balancers and orchestrators probe this without credentials.
OPEN_PATHS = frozenset({"/health"})
# Pages a browser opens: their 401 asks for Basic credentials, so the browser prompts.
BROWSER_PATHS = frozenset({"/dashboard"})


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
            elif scheme.lower() == "basic":
                keys.append(_basic_password(credential.strip()))
    return [key for key in keys if key]


def challenge(scope: Scope) -> str:
    """A 401's `WWW-Authenticate`: a page asks a browser for Basic credentials, so it
    prompts; the API asks for a Bearer token, which SDKs send anyway."""
    return 'Basic realm="Orchard", charset="UTF-8"' if route_path(scope) in BROWSER_PATHS \
        else "Bearer"


def _basic_password(credential: str) -> str:
    try:
        decoded = base64.b64decode(credential, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return ""
    return decoded.partition(":")[2]


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
        response.headers["WWW-Authenticate"] = challenge(scope)
        await response(scope, receive, send)
