"""What this replica's prefix cache holds, in the router's terms: the cluster prefix
directory's entry for one replica.

The cache (memory and disk tiers) keys KV by token ids; the router sees requests before
they are tokenized, and knows prompts only by their prefix keys (`replicas.routing_keys`).
So the replica translates: each request it serves teaches it which token prefix each of
its prefix keys stands for (`learn`), and it publishes the keys whose token prefix its
tiers still hold (`published`), which Serve's routing stats carry to every router.

"Holds" is counted in blocks of `BLOCK_TOKENS`: every entry of either tier registers the
hash chain of its whole blocks (`HeldBlocks`), and a key counts as held when the block
hash at its length, rounded down to a block, is registered. A prefix shorter than one
block is never published. Thread-safe: the engine thread and the disk tier's writer change
what is held, the replica's event loop learns and publishes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64
# Keys a replica remembers (and at most publishes): 16 bytes each in every stats report.
MAX_KEYS = 4096
DIRECTORY_FILE = "prefix-directory.keys"  # beside the disk tier's files (not a .json sidecar)


def block_hashes(tokens: Sequence[int]) -> list[bytes]:
    """The hash of each whole-block prefix of `tokens`: [h(tokens[:64]), h(tokens[:128]), ...]."""
    hashes: list[bytes] = []
    current = b""
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = _block_bytes(tokens[start:start + BLOCK_TOKENS])
        current = hashlib.blake2b(current + block, digest_size=16).digest()
        hashes.append(current)
    return hashes


def _block_bytes(block: Sequence[int]) -> bytes:
    try:
        return array("q", block).tobytes()
    except OverflowError:  # a vision prompt's cache key numbers image positions past 64 bits
        return repr(tuple(block)).encode()


class HeldBlocks:
    """The block hashes of every entry the cache's tiers hold. An entry in both tiers
    counts once until it has left both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, ...], tuple[int, list[bytes]]] = {}  # key -> (tiers, hashes)
        self._blocks: dict[bytes, int] = {}  # block hash -> entries holding it

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def add(self, key: tuple[int, ...]) -> None:
        with self._lock:
            if self._bump(key, +1):
                return
        hashes = block_hashes(key)  # outside the lock: the longest entry costs a few ms
        with self._lock:
            if self._bump(key, +1):
                return
            self._entries[key] = (1, hashes)
            for block in hashes:
                self._blocks[block] = self._blocks.get(block, 0) + 1

    def remove(self, key: tuple[int, ...]) -> None:
        with self._lock:
            tiers, hashes = self._entries.get(key, (0, []))
            if tiers == 0:
                return
            if tiers > 1:
                self._bump(key, -1)
                return
            del self._entries[key]
            for block in hashes:
                left = self._blocks[block] - 1
                if left:
                    self._blocks[block] = left
                else:
                    del self._blocks[block]

    def _bump(self, key: tuple[int, ...], by: int) -> bool:
        found = self._entries.get(key)
        if found is None:
            return False
        self._entries[key] = (found[0] + by, found[1])
        return True


class PrefixDirectory:
    """Prefix keys this replica served, each with the block hash it stands for (an LRU of
    `max_keys`), and those its cache still holds."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.held = HeldBlocks()
        self.max_keys = max_keys
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, bytes] = OrderedDict()  # prefix key -> block hash

    def learn(self, spans: Iterable[tuple[bytes, int]], tokens: Sequence[int]) -> None:
        """`spans`: prefix keys and the prompt tokens each stands for (`token_spans`), of a
        request whose prompt is `tokens`. A key stands for the block hash at its length,
        rounded down to whole blocks; one under a block is not learnt."""
        spans = [(key, length // BLOCK_TOKENS) for key, length in spans
                 if length >= BLOCK_TOKENS]
        if not spans:
            return
        blocks = block_hashes(tokens[:BLOCK_TOKENS * max(n for _, n in spans)])
        with self._lock:
            for key, n in spans:
                self._keys[key] = blocks[n - 1]
                self._keys.move_to_end(key)
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)

    def published(self) -> frozenset[bytes]:
        """The keys whose prefix either tier holds now."""
        with self._lock:
            known = list(self._keys.items())
        return frozenset(key for key, block in known if block in self.held)

    def save(self, path: Path) -> None:
        """Keep the key table beside the disk tier's files (at shutdown), so a restarted
        replica publishes what that tier holds before any request teaches it again."""
        with self._lock:
            keys = [[key.hex(), block.hex()] for key, block in self._keys.items()]
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"block_tokens": BLOCK_TOKENS, "keys": keys}))
        os.replace(partial, path)

    def load(self, path: Path) -> None:
        """The table a previous run saved, if any; an unreadable one is ignored (it only
        steers routing), with a warning."""
        if not path.exists():
            return
        try:
            data = json.loads(path.read_text())
            if data["block_tokens"] != BLOCK_TOKENS:
                raise ValueError("it counts in other blocks")
            keys = [(bytes.fromhex(k), bytes.fromhex(b)) for k, b in data["keys"]]
        except Exception as exc:  # noqa: BLE001 - whatever is wrong, routing learns again
            log.warning("prefix directory: ignoring %s: %s", path, exc)
            return
        with self._lock:
            for key, block in keys[-self.max_keys:]:
                self._keys.setdefault(key, block)
