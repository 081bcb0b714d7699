"""Server-sent events framing."""

from __future__ import annotations

from typing import Any

from ingress.wire_json import dumps

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_frame(payload: Any) -> str:
    """An unnamed event (OpenAI style): `data: {...}`."""
    return f"data: {dumps(payload)}\n\n"


def event_frame(event: str, payload: Any) -> str:
    """A named event (Anthropic style): `event: NAME` then `data: {...}`."""
    return f"event: {event}\ndata: {dumps(payload)}\n\n"


DONE_FRAME = "data: [DONE]\n\n"
