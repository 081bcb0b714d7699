"""Stored responses, for `previous_response_id` and `GET /v1/responses/{id}`.

`ResponseStore` is all the routes need. `MemoryResponseStore` keeps responses in this
process: bounded by count and by bytes (least recently used go first) and by age. With
several ingress replicas a client's next request may land on another one, so deployments
pass a shared store to `create_app` (one over a Ray actor, or Redis); entries are plain
JSON data so they cross process boundaries as they are.

Every store keeps the same text (`encode`), so the byte bound counts the same bytes in each,
and fails the same way (`store_unavailable`): a 503 the client may retry, never a crash.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ingress.errors import CodedError
from replicas.contract import ErrorKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned to the client
    items: tuple[dict[str, Any], ...]  # the whole input that produced it, as wire items

    def conversation(self) -> list[dict[str, Any]]:
        """Input then output: what a follow-up request continues from."""
        return [*self.items, *self.response["output"]]


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def put(self, response_id: str, stored: StoredResponse) -> None: ...


def encode(stored: StoredResponse) -> str:
    """The JSON text a store keeps; its length is what the byte bound counts. ASCII only
    (json's default escaping), so characters and bytes are the same count everywhere."""
    return json.dumps({"response": stored.response, "items": list(stored.items)},
                      separators=(",", ":"))


def decode(text: str | bytes) -> StoredResponse:
    data = json.loads(text)
    return StoredResponse(data["response"], tuple(data["items"]))


def storable_id(response_id: str) -> bool:
    """Whether an id can be a key: stores take UTF-8, and a client's id may carry a lone
    surrogate (the fuzz suite sends one), which names nothing we stored."""
    try:
        response_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def store_unavailable(error: Exception) -> CodedError:
    """A store that cannot be reached or written (Redis down, a disk error): the request
    fails as a 503 with Retry-After, since the store usually comes back (a restart). The
    cause goes to the log only: it names hosts and paths a client has no business seeing."""
    log.warning("response store unavailable: %r", error)
    return CodedError(ErrorKind.OVERLOADED, "the response store is unavailable; retry shortly",
                      code="response_store_unavailable")


class MemoryResponseStore:
    """An LRU of stored responses with a count cap, a byte cap and a time to live.

    Defaults: 1024 responses, 64 MiB of JSON, one hour. A response larger than the byte
    cap is not stored (a later `previous_response_id` naming it is a 404).
    """

    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20,
                 ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[StoredResponse, int, float]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        stored, _, expires = entry
        if self._clock() >= expires:
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        return stored

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        size = len(encode(stored))
        if response_id in self._entries:
            self._drop(response_id)
        if size > self.max_bytes:
            return
        self._entries[response_id] = (stored, size, self._clock() + self.ttl_s)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, response_id: str) -> None:
        _, size, _ = self._entries.pop(response_id)
        self.bytes -= size
