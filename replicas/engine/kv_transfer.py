"""KV that moves between replicas of one model: a cached prefix as bytes, and back.

Pulling a prompt's prefix from the replica that holds it instead of prefilling it again
(`replicas.kv_pull` decides and asks; the deployments carry the bytes over Ray's object
store). The bytes are mlx-lm's prompt-cache format (`save_prompt_cache`'s layout, what the
disk tier writes), in memory: `snapshot` evaluates the arrays on the engine thread, and
`encode` / `decode` run on a worker thread, so a long prefix stalls no batch step.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache

from replicas.engine.disk_cache import Snapshot


@dataclass(frozen=True)
class PrefixPull:
    """One replica's ask for the KV of the longest prefix of `tokens` another holds."""

    tokens: tuple[int, ...]  # the asker's prompt
    at_least: int  # fewer cached tokens than this is not worth sending: answer None
    holder: str  # the replica asked (Serve's full replica id); the router routes by it


@dataclass(frozen=True)
class PrefixKV:
    """The answer: the KV of `tokens` (a prefix of the asker's prompt), encoded."""

    tokens: tuple[int, ...]
    payload: bytes
    fingerprint: str  # the model's (`disk_cache.model_fingerprint`): KV fits that model only


def encode(snap: Snapshot) -> bytes:
    """A snapshot's arrays as safetensors bytes (off the engine thread)."""
    buffer = io.BytesIO()
    mx.save_safetensors(buffer, snap.arrays, snap.metadata)  # type: ignore[arg-type]
    return buffer.getvalue()


def decode(payload: bytes) -> list[Any]:
    """The per-layer caches `encode`'s bytes hold, through mlx-lm's own loader."""
    buffer = io.BytesIO(payload)
    buffer.name = "prefix.safetensors"  # type: ignore[attr-defined]  # mx.load reads the format off it
    cache: list[Any] = load_prompt_cache(buffer)  # type: ignore[arg-type]
    mx.eval([c.state for c in cache])
    return cache
