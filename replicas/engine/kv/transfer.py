"""KV that moves between replicas of one model: a cached prefix as bytes, and back.

Pulling a prompt's prefix from the replica that holds it instead of prefilling it again
(`replicas.kv_pull` decides and asks; the deployments carry the bytes over Ray's object
store). The bytes are mlx-lm's prompt-cache format (`save_prompt_cache`'s layout, what the
disk tier writes), in memory: `snapshot` evaluates the arrays on the engine thread, and
`encode` / `decode` run on a worker thread, so a long prefix stalls no batch step.

The bytes travel as a numpy array viewing the encoder's buffer, not as `bytes`: Ray moves
a numpy array out of band (no pickling copy) and hands the receiver a view of its object
store, which `decode` reads in place. Two copies of the whole KV fewer than `bytes` would
cost (about 60 ms of 95 for 28 MiB on the test box); at a big model's gigabytes of KV,
those copies are most of a pull.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from replicas.engine.kv.disk import Snapshot, load_cache


@dataclass(frozen=True)
class PrefixPull:
    """One replica's ask for the KV of the longest prefix of `tokens` another holds."""

    tokens: tuple[int, ...]  # the asker's prompt
    at_least: int  # fewer cached tokens than this is not worth sending: answer None
    holder: str  # the replica asked (Serve's full replica id); the router routes by it


Payload = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class PrefixKV:
    """The answer: the KV of `tokens` (a prefix of the asker's prompt), encoded."""

    tokens: tuple[int, ...]
    payload: Payload  # safetensors bytes (rank 0's part on a sharded replica)
    fingerprint: str  # the model's (`kv.fingerprint.model_fingerprint`): KV fits that model only
    # A sharded holder's: the id its other ranks keep their parts under, and the
    # transport's handles to those parts, by rank (`replicas.engine.sharded.kv_parts`).
    export_id: str = ""
    ranks: tuple[Any, ...] = ()


def encode(snap: Snapshot) -> Payload:
    """A snapshot's arrays as safetensors bytes (off the engine thread), viewed in place."""
    buffer = io.BytesIO()
    mx.save_safetensors(buffer, snap.arrays, snap.metadata)  # type: ignore[arg-type]
    return np.frombuffer(buffer.getbuffer(), dtype=np.uint8)


def decode(payload: Payload) -> list[Any]:
    """The per-layer caches `encode`'s bytes hold, through mlx-lm's own loader."""
    cache = load_cache(_Reader(memoryview(payload)))  # type: ignore[arg-type]
    mx.eval([c.state for c in cache])
    return cache


class _Reader(io.RawIOBase):
    """A read-only file over a buffer, without copying it (`io.BytesIO` would)."""

    name = "prefix.safetensors"  # mx.load takes the format from the name

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view.cast("B")
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, into: Any) -> int:
        n = max(0, min(len(into), len(self._view) - self._at))
        into[:n] = self._view[self._at:self._at + n]
        self._at += n
        return n
