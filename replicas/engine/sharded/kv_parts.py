"""A sharded replica's KV moves rank to rank: what ranks 1..N-1 hold between the lockstep
op that snapshots or adopts a prefix and the transport that carries it.

Each rank of a sharded replica holds its own part of every layer's KV (its heads under
tensor parallelism, its layers under pipeline), so a prefix moves between two replicas
sharded alike as N parts, rank r to rank r, never through rank 0. Rank 0 decides (it
owns the prefix cache's decisions, `replicas.engine.sharded.lockstep`); each other rank:

- on `_Export`, snapshots its part on its engine thread and encodes it on a worker
  thread, kept here until the transport takes it (`take_export`);
- before `_Adopt`, is handed its part of a pulled prefix by the transport (`stage`),
  decoded and checked off the engine thread, which the op then adopts (`take_import`).

The transport is the deployment's (Ray, `deployments.shards`); this module only keeps
parts, bounded in time, so a pull abandoned halfway leaves nothing behind for long.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from replicas.engine.kv.transfer import Payload

# A part nobody came for within this long is dropped (the pull that wanted it failed).
PART_TTL_S = 120.0


class KvParts:
    """One rank's exported and staged parts, by the id rank 0 gave them. Thread-safe:
    the engine thread, encoders and the transport's threads all call it."""

    def __init__(self, ttl_s: float = PART_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._exports: dict[str, tuple[float, Future[Payload]]] = {}
        self._imports: dict[str, tuple[float, list[Any]]] = {}
        self._arrived = threading.Condition(self._lock)

    def export(self, export_id: str, encoded: Future[Payload]) -> None:
        """The engine thread: this rank's part of export `export_id`, being encoded."""
        with self._lock:
            self._expire()
            self._exports[export_id] = (time.monotonic(), encoded)
            self._arrived.notify_all()

    def take_export(self, export_id: str, timeout_s: float) -> Payload:
        """The transport: the encoded part, once the op reached this rank and the encoder
        finished (the transport may ask before the op arrives)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while export_id not in self._exports:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"export {export_id} never reached this rank")
                self._arrived.wait(left)
            _, encoded = self._exports.pop(export_id)
        return encoded.result(timeout=max(0.0, deadline - time.monotonic()))

    def stage(self, import_id: str, layers: list[Any]) -> None:
        """The transport: this rank's decoded part of a pulled prefix, for `_Adopt`."""
        with self._lock:
            self._expire()
            self._imports[import_id] = (time.monotonic(), layers)

    def take_import(self, import_id: str) -> list[Any] | None:
        """The engine thread, at `_Adopt`: the staged part (None: never staged)."""
        with self._lock:
            found = self._imports.pop(import_id, None)
        return found[1] if found else None

    def discard(self, import_id: str) -> None:
        """A pull given up after staging some ranks' parts: free them now."""
        with self._lock:
            self._imports.pop(import_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._exports) + len(self._imports)

    def _expire(self) -> None:
        old = time.monotonic() - self._ttl_s
        for store in (self._exports, self._imports):
            for key in [k for k, (at, _) in store.items() if at < old]:
                del store[key]
