"""JSON as it leaves the server, in bodies and in SSE frames.

UTF-8 as is, except where text holds a lone UTF-16 surrogate, which JSON may carry in
(`"\\ud800"`) and responses may echo (an unknown id, metadata): UTF-8 cannot encode one, so
that payload is written with ASCII escapes instead of failing the response.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse


def dumps(payload: Any) -> str:
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(payload, separators=(",", ":"))
    return text


class JSONBody(JSONResponse):
    """A JSON response body that any client text survives (see `dumps`)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
