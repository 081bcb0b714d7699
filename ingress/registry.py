"""The one table of wire protocols the ingress speaks, and lookup by request path.

Adding a protocol is a package with its routes and a `WireProtocol`, and one entry here.
Only the app and its middleware read this table; the protocols themselves never do.
"""

from __future__ import annotations

from typing import Any, Mapping

from ingress.anthropic.routes import ANTHROPIC
from ingress.openai.routes import OPENAI
from ingress.protocol import WireProtocol
from ingress.responses.routes import RESPONSES

PROTOCOLS: tuple[WireProtocol, ...] = (OPENAI, ANTHROPIC, RESPONSES)

# Paths no protocol owns (`/v1/models`, `/health`, unknown routes) answer in OpenAI's shape,
# the one most clients expect.
DEFAULT = OPENAI


def route_path(scope: Mapping[str, Any]) -> str:
    """The path the app routes on: Serve mounts an app under its route prefix, which the
    ASGI scope carries as `root_path` and leaves in `path`."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def protocol_for(scope: Mapping[str, Any]) -> WireProtocol:
    """The protocol owning the request's route: its error shape and stream frames apply."""
    path = route_path(scope)
    return next((protocol for protocol in PROTOCOLS if protocol.owns(path)), DEFAULT)
