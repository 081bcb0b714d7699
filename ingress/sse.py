"""Server-sent events framing."""

from __future__ import annotations

import json
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def data_frame(payload: Any) -> str:
    """An unnamed event (OpenAI style): `data: {...}`."""
    return f"data: {dumps(payload)}\n\n"


def event_frame(event: str, payload: Any) -> str:
    """A named event (Anthropic style): `event: NAME` then `data: {...}`."""
    return f"event: {event}\ndata: {dumps(payload)}\n\n"


DONE_FRAME = "data: [DONE]\n\n"
