"""The request deadline and the last-resort error handler, around every HTTP request.

A request that outlives its deadline is cancelled, which closes its event stream and so
cancels its generation. An exception that escapes the app is logged with an id and answered
with a generic message carrying that id, never the exception's text or a stack trace (both
may quote the prompt). Either way the client gets the protocol's own error: a 504 or 500
when no byte was sent yet, otherwise an error event that ends the open SSE stream, never a
silent cut.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from dataclasses import dataclass

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ingress.errors import error_response
from ingress.protocol import WireProtocol
from ingress.registry import protocol_for
from replicas.contract import ErrorKind

log = logging.getLogger(__name__)


@dataclass
class _Progress:
    started: bool = False  # the status line and headers are sent
    streaming: bool = False  # ... and they opened an SSE stream
    finished: bool = False  # the last body message is sent


class GuardMiddleware:
    def __init__(self, app: ASGIApp, timeout_s: float | None) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        progress = _Progress()

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                progress.started = True
                progress.streaming = _is_event_stream(message)
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                progress.finished = True
            await send(message)

        protocol = protocol_for(scope)
        try:
            with anyio.move_on_after(self.timeout_s) as deadline:
                await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            error_id = uuid.uuid4().hex[:16]
            _log_internal(error_id, scope["path"], exc)
            message = f"internal error (request id {error_id})"
            await _fail(scope, receive, send, progress, protocol, ErrorKind.INTERNAL, message)
            return
        if deadline.cancelled_caught and not progress.finished:
            log.warning("request to %s exceeded its %.0fs deadline", scope["path"],
                        self.timeout_s)
            message = f"the request did not complete within {self.timeout_s:g} seconds"
            await _fail(scope, receive, send, progress, protocol, ErrorKind.TIMEOUT, message)


def _is_event_stream(start: Message) -> bool:
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip() == b"text/event-stream"
    return False


def _log_internal(error_id: str, path: str, exc: BaseException) -> None:
    # Frames (file, line, code) locate the bug; the exception's text may quote a prompt, so
    # it is only logged at DEBUG.
    frames = "".join(traceback.format_tb(exc.__traceback__))
    log.error("internal error %s on %s: %s\n%s", error_id, path, type(exc).__name__, frames)
    log.debug("internal error %s: %r", error_id, exc)


async def _fail(scope: Scope, receive: Receive, send: Send, progress: _Progress,
                protocol: WireProtocol, kind: ErrorKind, message: str) -> None:
    if progress.finished:
        return
    try:
        if not progress.started:
            await error_response(kind, message, protocol)(scope, receive, send)
            return
        body = protocol.error_frame(kind, message).encode() if progress.streaming else b""
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except OSError:
        pass  # the client is gone: there is no one left to tell
