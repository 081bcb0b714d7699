"""The prefix cache's disk tier: KV of cached prompts kept in a bounded directory on the
Mac's SSD, so a restart of the replica (or of `serve run`) keeps them, and a prefix the
memory tier evicted is loaded instead of prefilled again.

Each entry is two files under `<directory>/<model fingerprint>/`: the KV in mlx-lm's prompt
cache format (`mlx_lm.models.cache.load_prompt_cache` reads it), and a JSON sidecar with the
tokens it holds, its size and its SHA-256. A file is used only when its sidecar parses, names
this model's fingerprint (`replicas.engine.kv.fingerprint`: config, tokenizer, weights,
dtype) and the sum matches; anything else is dropped with a warning, never loaded. The
directory is bounded by bytes, least recently used first (a hit touches the file, so the
order survives restarts), and held by one process at a time (a lock file).

Entries are written as the memory tier saves them (a replica stopped without its shutdown
keeps what was written), and looked at again at eviction and shutdown. Writes go through
one writer thread: writing a long prefix's gigabytes must not stall the batch. What waits
for it is bounded by bytes (`QUEUE_BYTES`): a spill past that is dropped. Reads are the
caller's, off the engine thread (`replicas.disk_reads`). The engine thread hands the writer
arrays it has already evaluated (`snapshot`), so the
writer only copies bytes (MLX evaluation stays on the engine thread). mlx-lm's own
`save_prompt_cache` is not called for that reason: it builds the state's slices lazily,
which the writer would then evaluate on its own thread.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, load_prompt_cache

from replicas.engine.kv.directory import HeldBlocks
from replicas.engine.kv.trie import PrefixTrie
from replicas.engine.kv.quantized import as_rows, stored_name, stored_state
from replicas.os_thread import name_os_thread

log = logging.getLogger(__name__)

FORMAT = 1  # the sidecar's layout; another value is a foreign file


@dataclass(frozen=True)
class Snapshot:
    """A cache's state as mlx-lm's file format holds it, evaluated on the engine thread."""

    arrays: dict[str, mx.array]
    metadata: dict[str, str]
    trimmable: bool


def snapshot(cache: Sequence[Any]) -> Snapshot:
    """On the engine thread: `cache`'s arrays, evaluated, under mlx-lm's names."""
    scalars: list[Any] = [""]  # mlx-lm's layout: a leading "" keeps the list non-empty
    arrays: dict[str, mx.array] = {}
    state: dict[str, Any] = dict(tree_flatten([stored_state(c) for c in cache]))
    for name, value in state.items():
        if isinstance(value, mx.array):
            arrays[name] = value
        elif isinstance(value, (bool, int, float)):
            scalars.append((name, "scalar"))
            arrays[name] = mx.array(value)
        elif isinstance(value, str):  # a `CacheList`'s member classes
            scalars.append((name, "string"))
            arrays[name] = mx.array([ord(c) for c in value])
        elif value is None:
            scalars.append((name, "none"))
            arrays[name] = mx.array([])
        else:
            raise ValueError(f"a cache state of type {type(value).__name__} cannot be stored")
    mx.eval(list(arrays.values()))
    metadata = dict(tree_flatten([{}, [stored_name(c) for c in cache], scalars]))
    return Snapshot(arrays, metadata, can_trim_prompt_cache(list(cache)))


def load_cache(file: Any) -> list[Any]:
    """The per-layer caches of a file in mlx-lm's format (a path, or a readable file)."""
    return as_rows(load_prompt_cache(file))  # type: ignore[arg-type]


@dataclass(frozen=True)
class _OnDisk:
    stem: str
    nbytes: int
    sha256: str
    trimmable: bool


@dataclass(frozen=True)
class DiskHit:
    key: tuple[int, ...]  # the entry's tokens
    length: int  # the prompt tokens it serves


# What spills may wait to be written: an evicted entry's KV stays in memory until its write
# ends, after admission gave its room to the batch, so the queue is bounded and a spill
# that would pass the bound is dropped (it costs a prefill later, never memory now).
QUEUE_BYTES = 1 << 30


_RECLAIM_S = 10.0  # how often a replica waiting for a directory in use tries it again
# The directories this process holds, with their locked files: a process may open its own
# directory again (a test's restart), another may not while this one lives.
_HELD: dict[Path, int] = {}


def _claim(directory: Path) -> bool:
    """Lock `directory` for this process (released when it exits, however it exits)."""
    key = directory.resolve()
    if key in _HELD:
        return True
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _HELD[key] = fd
    return True


class DiskTier:
    def __init__(self, root: Path, max_bytes: int, fingerprint: str,
                 held: HeldBlocks | None = None, queue_bytes: int = QUEUE_BYTES) -> None:
        self.directory = Path(root) / fingerprint
        # The prefix directory's view of what this tier holds (`replicas.engine.kv.directory`).
        self.held = held or HeldBlocks()
        self.directory.mkdir(parents=True, exist_ok=True)
        # One process per directory (another would delete this one's partial writes at its
        # start and bound only its own bytes): a second replica of the model on this Mac
        # (a replacement starting before the old one stopped) waits until it is free.
        self._claimed = _claim(self.directory)
        self._next_claim = time.monotonic() + _RECLAIM_S
        self.max_bytes = max_bytes
        self._fingerprint = fingerprint
        self._lock = threading.Lock()  # the writer adds entries while the engine looks up
        self._trie = PrefixTrie()
        self._entries: OrderedDict[tuple[int, ...], _OnDisk] = OrderedDict()  # oldest first
        self._bytes = 0
        self.hits = 0
        self.writes = 0
        self.dropped = 0
        self.queue_bytes = queue_bytes
        self.skipped = 0  # spills dropped because the queue was full
        # The KV bytes waiting in the queue; `_space` wakes a `put` that waits for room.
        self._queued = 0
        self._space = threading.Condition()
        # Keys waiting to be written; True once a longer entry that serves them is queued
        # (the writer then skips them: one conversation's turns write its latest only).
        self._waiting: dict[tuple[int, ...], bool] = {}
        # Entries to write (with their bytes), or an event the writer sets once everything
        # before it is written.
        self._queue: queue.Queue[tuple[tuple[int, ...], Snapshot, int] | threading.Event] = \
            queue.Queue()
        if self._claimed:
            self._scan()
        else:
            log.warning("disk KV cache: %s is in use by another process; this replica uses "
                        "it once that one stops", self.directory)
        self._writer = threading.Thread(target=self._write_loop, name="orchard-kv-disk",
                                        daemon=True)
        self._writer.start()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    # ---- the engine thread --------------------------------------------------------------

    @property
    def queued_bytes(self) -> int:
        """The KV bytes waiting to be written (at most `queue_bytes`)."""
        return self._queued

    def put(self, tokens: Sequence[int], cache: Sequence[Any], wait_s: float = 0.0) -> bool:
        """Keep `cache`, the KV of exactly `tokens`; written in the background. Where the
        queue has no room for it within `wait_s` (0: a spill, which must not stall the
        batch), it is dropped: False. An entry larger than the whole queue goes alone, and
        only for a caller that waits (shutdown)."""
        key = tuple(tokens)
        if not self._ready():
            return False
        with self._lock:
            if key in self._entries:
                self._touch(key)
                return True
        nbytes = sum(int(c.nbytes) for c in cache)
        trimmable = can_trim_prompt_cache(list(cache))
        with self._space:
            if key in self._waiting:  # written soon already
                return True
            if not self._space.wait_for(lambda: self._fits(nbytes, wait_s > 0), wait_s):
                self.skipped += 1
                log.debug("disk KV cache: queue full (%d of %d bytes), a %d-byte spill dropped",
                          self._queued, self.queue_bytes, nbytes)
                return False
            self._queued += nbytes
            if trimmable:  # it serves the queued entries on its path: they need no write
                for other in self._waiting:
                    if len(other) < len(key) and key[:len(other)] == other:
                        self._waiting[other] = True
            self._waiting[key] = False
        self._queue.put((key, snapshot(cache), nbytes))
        return True

    def _ready(self) -> bool:
        """Whether this process holds the directory: tried again every `_RECLAIM_S`, and
        its entries read once it does. On the engine thread."""
        if self._claimed or time.monotonic() < self._next_claim:
            return self._claimed
        self._next_claim = time.monotonic() + _RECLAIM_S
        if _claim(self.directory):
            with self._lock:
                self._scan()
                self._claimed = True
        return self._claimed

    def _fits(self, nbytes: int, alone: bool) -> bool:
        return self._queued + nbytes <= self.queue_bytes or (alone and self._queued == 0)

    def lookup(self, tokens: Sequence[int]) -> DiskHit | None:
        """The entry serving the longest prefix of `tokens` (at least one token is left out,
        as in memory), or None."""
        if not self._ready():
            return None
        with self._lock:
            found = self._trie.longest_prefix(tokens[:-1],
                                              lambda key: self._entries[key].trimmable)
        return None if found is None else DiskHit(*found)

    def load(self, hit: DiskHit) -> list[Any] | None:
        """The entry's KV, checked against its sum and evaluated; None (and the entry
        dropped) when it is missing, altered or unreadable. Reads the whole file: call it
        off the engine thread (`replicas.disk_reads`)."""
        with self._lock:
            entry = self._entries.get(hit.key)
        if entry is None:
            return None
        path = self.directory / f"{entry.stem}.safetensors"
        try:
            if _sha256(path) != entry.sha256:
                raise ValueError("its SHA-256 does not match its sidecar")
            cache = load_cache(str(path))
            mx.eval([c.state for c in cache])  # read here, not where it is first used
        except Exception as exc:  # noqa: BLE001 - a bad file costs the hit, never the request
            log.warning("disk KV cache: dropping %s: %s", path.name, exc)
            self._drop(hit.key)
            return None
        with self._lock:
            self._touch(hit.key)
        self.hits += 1
        return cache

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait for the writes queued so far (tests, shutdown); False if they outlast
        `timeout_s`."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def close(self) -> None:
        self.flush()

    # ---- the writer thread --------------------------------------------------------------

    def _write_loop(self) -> None:
        name_os_thread(self._writer.name)
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            key, snap, nbytes = item
            with self._space:
                superseded = self._waiting[key]
            try:
                if not superseded:
                    self._write(key, snap)
            except Exception:  # noqa: BLE001 - a full disk costs the entry, not the replica
                log.exception("disk KV cache: writing an entry failed")
            del snap, item  # its arrays go before the room they held is given back
            with self._space:
                del self._waiting[key]
                self._queued -= nbytes
                self._space.notify_all()

    def _write(self, key: tuple[int, ...], snap: Snapshot) -> None:
        stem = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
        path = self.directory / f"{stem}.safetensors"
        partial = self.directory / f"{stem}.partial.safetensors"
        mx.save_safetensors(str(partial), snap.arrays, snap.metadata)
        os.replace(partial, path)  # a crash mid-write leaves no file that looks whole
        entry = _OnDisk(stem, path.stat().st_size, _sha256(path), snap.trimmable)
        sidecar = {"format": FORMAT, "fingerprint": self._fingerprint, "tokens": list(key),
                   "nbytes": entry.nbytes, "sha256": entry.sha256, "trimmable": entry.trimmable}
        (self.directory / f"{stem}.json").write_text(json.dumps(sidecar))
        with self._lock:
            self._add(key, entry)
        self.writes += 1

    # ---- the index ----------------------------------------------------------------------

    def _scan(self) -> None:
        """The entries a previous run left, oldest use first; bad or foreign ones dropped."""
        found: list[tuple[float, tuple[int, ...], _OnDisk]] = []
        for sidecar in self.directory.glob("*.json"):
            stem = sidecar.name[:-len(".json")]
            data = self.directory / f"{stem}.safetensors"
            try:
                meta = json.loads(sidecar.read_text())
                if meta.get("format") != FORMAT or meta.get("fingerprint") != self._fingerprint:
                    raise ValueError("it was written for another model or format")
                entry = _OnDisk(stem, int(meta["nbytes"]), str(meta["sha256"]),
                                bool(meta["trimmable"]))
                if data.stat().st_size != entry.nbytes:
                    raise ValueError("its size does not match its sidecar")
                found.append((data.stat().st_mtime, tuple(int(t) for t in meta["tokens"]),
                              entry))
            except Exception as exc:  # noqa: BLE001 - whatever is wrong, it is not loaded
                log.warning("disk KV cache: dropping %s: %s", sidecar.name, exc)
                self.dropped += 1
                _remove(sidecar, data)
        for partial in self.directory.glob("*.partial.safetensors"):
            partial.unlink(missing_ok=True)  # a write a crash cut short
        for _, key, entry in sorted(found, key=lambda f: f[0]):
            self._add(key, entry)
        if found:
            log.info("disk KV cache: %d entries, %d bytes in %s", len(self._entries),
                     self._bytes, self.directory)

    def _add(self, key: tuple[int, ...], entry: _OnDisk) -> None:
        if self._trie.add(key) and key in self._entries:
            self._bytes -= self._entries.pop(key).nbytes
        else:
            self.held.add(key)
        self._entries[key] = entry
        self._bytes += entry.nbytes
        if entry.trimmable:  # entries on its path are its prefixes: it serves them by trimming
            for prefix in self._trie.remove_prefixes(key):
                old = self._entries.pop(prefix)
                self.held.remove(prefix)
                self._bytes -= old.nbytes
                _remove(*self._paths(old))
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            oldest, old = next(iter(self._entries.items()))
            self._forget(oldest)
            _remove(*self._paths(old))

    def _touch(self, key: tuple[int, ...]) -> None:
        self._entries.move_to_end(key)
        entry = self._entries[key]
        os.utime(self.directory / f"{entry.stem}.safetensors")

    def _drop(self, key: tuple[int, ...]) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            self._forget(key)
        self.dropped += 1
        _remove(*self._paths(entry))

    def _forget(self, key: tuple[int, ...]) -> None:
        self._trie.remove(key)
        self.held.remove(key)
        self._bytes -= self._entries.pop(key).nbytes

    def _paths(self, entry: _OnDisk) -> tuple[Path, Path]:
        return (self.directory / f"{entry.stem}.json",
                self.directory / f"{entry.stem}.safetensors")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _remove(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
