"""One log line per finished request: ids, sizes and timings, never prompt or output text.

`key=value` text by default; one JSON object per line when `json_lines` is on, for log
shippers (Loki, Elasticsearch, CloudWatch) that parse fields without a pattern.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ingress.observe import RequestRecord

log = logging.getLogger("orchard.requests")


def request_fields(record: RequestRecord) -> dict[str, Any]:
    usage = record.usage
    return {
        "request_id": record.request_id,
        "model": record.model,
        "protocol": record.protocol,
        "endpoint": record.endpoint,
        "status": record.status,
        "stream": record.streaming,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": usage.cached_tokens if usage else None,
        "output_tokens": usage.completion_tokens if usage else None,
        "reasoning_tokens": usage.reasoning_tokens if usage else None,
        "ttft_ms": _ms(record.ttft_s),
        "itl_ms": _ms(record.itl_s),
        "duration_ms": _ms(record.duration_s),
        "finish_reason": record.finish_reason.value if record.finish_reason else None,
        "error": record.error.value if record.error else None,
        "cancelled": record.cancelled,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def format_line(record: RequestRecord, json_lines: bool) -> str:
    fields = request_fields(record)
    if json_lines:
        return json.dumps({"event": "request", **fields}, separators=(",", ":"))
    return "request " + " ".join(f"{key}={'-' if value is None else value}"
                                 for key, value in fields.items())


class RequestLogger:
    """A `RequestObserver` that logs each record at INFO on `orchard.requests`."""

    def __init__(self, json_lines: bool = False) -> None:
        self._json = json_lines

    def request_finished(self, record: RequestRecord) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info("%s", format_line(record, self._json))
