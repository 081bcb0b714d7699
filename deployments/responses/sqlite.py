"""Stored responses in a SQLite file: what clients keep on the server (`store: true`,
`previous_response_id`) survives a replica restart, a deploy or the store actor's restart.

The same bounds as `MemoryResponseStore` (count, bytes, age; least recently used go first),
kept in the file itself so a restarted process inherits them. Ages use the wall clock, since
entries outlive the process. SQLite serializes writers itself, so replicas on one node may
share one file; calls run in a worker thread so the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable

from ingress.responses.store import (StoredResponse, decode, encode, storable_id,
                                     store_unavailable)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    body TEXT NOT NULL,      -- {"response": ..., "items": [...]}
    size INTEGER NOT NULL,   -- len(body), what the byte bound counts
    expires REAL NOT NULL,   -- wall-clock seconds
    used INTEGER NOT NULL    -- recency: a sequence bumped by every put and get
);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used);
"""
_NEXT = "(SELECT COALESCE(MAX(used), 0) + 1 FROM responses)"


class SqliteResponseStore:
    def __init__(self, path: Path, max_entries: int = 1024, max_bytes: int = 64 << 20,
                 ttl_s: float = 3600.0, clock: Callable[[], float] = time.time) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()  # one connection, used from worker threads in turn
        # WAL: readers do not block the writer, and a crash mid-write loses nothing stored.
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    @property
    def bytes(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(SUM(size), 0) FROM responses")
                       .fetchone()[0])

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            return await asyncio.to_thread(self._get, response_id)
        except sqlite3.OperationalError as error:  # locked past the timeout, disk full, I/O
            raise store_unavailable(error) from error

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        try:
            await asyncio.to_thread(self._put, response_id, stored)
        except sqlite3.OperationalError as error:
            raise store_unavailable(error) from error

    def _get(self, response_id: str) -> StoredResponse | None:
        if not storable_id(response_id):
            return None
        now = self._clock()
        with self._lock:
            row = self._db.execute("SELECT body, expires FROM responses WHERE id = ?",
                                   (response_id,)).fetchone()
            if row is None:
                return None
            if now >= row[1]:
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                return None
            self._db.execute(f"UPDATE responses SET used = {_NEXT} WHERE id = ?", (response_id,))
        return decode(row[0])

    def _put(self, response_id: str, stored: StoredResponse) -> None:
        body = encode(stored)
        now = self._clock()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM responses WHERE id = ? OR expires <= ?",
                                 (response_id, now))
                if len(body) <= self.max_bytes:
                    self._db.execute(f"INSERT INTO responses VALUES (?, ?, ?, ?, {_NEXT})",
                                     (response_id, body, len(body), now + self.ttl_s))
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _evict(self) -> None:
        count, size = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        while count > self.max_entries or size > self.max_bytes:
            oldest = self._db.execute(
                "SELECT id, size FROM responses ORDER BY used LIMIT 1").fetchone()
            self._db.execute("DELETE FROM responses WHERE id = ?", (oldest[0],))
            count, size = count - 1, size - oldest[1]

    def close(self) -> None:
        with self._lock:
            self._db.close()

