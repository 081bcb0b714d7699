"""What one sequence's KV cache costs, measured on the loaded model, per layer kind.

Config arithmetic (`2 * n_kv_heads * head_dim` per layer) is right for plain attention
only: an MLA layer (DeepSeek V3, Kimi K2) caches one compressed latent, a sliding-window
layer (gpt-oss, Gemma) stops growing at its window, and a linear-attention or SSM layer
(Qwen3-Next, Nemotron-H) holds a fixed state whatever the length. So at load each process
runs a two-token probe through the cache mlx-lm's `BatchGenerator` makes for it
(`make_prompt_cache`), and reads off the arrays each layer's cache actually holds. On a
sharded replica every rank probes its own layers (a pipeline stage holds some layers, a
tensor shard a slice of each), together, since the probe's forward pass runs collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

log = logging.getLogger(__name__)

# mlx-lm's KV caches grow in steps of this many tokens (`KVCache.step`), and a batch pads
# every row to the longest, so what a batch holds is rows x the longest, rounded up to it.
CACHE_STEP = 256
_PROBE_TOKENS = 2
UNBOUNDED = 1 << 62  # a cache that never grows: only the context caps a sequence


@dataclass(frozen=True)
class KvLayout:
    """Bytes one sequence's cache holds at a given length, by layer kind."""

    per_token: int  # full-attention and MLA layers: every token adds this
    # Sliding-window layers: (window, bytes per token) for each distinct window; a layer
    # stops growing at its window.
    windows: tuple[tuple[int, int], ...] = ()
    per_sequence: int = 0  # linear-attention and SSM state: fixed, whatever the length
    # Bytes per token of each plain attention layer (`KVCache`, what a paged batch pages),
    # in layer order: a hybrid's full-attention layers need not all be one size.
    plain: tuple[int, ...] = ()

    def bytes_for(self, tokens: int) -> int:
        """What one sequence of `tokens` tokens holds."""
        return (self.per_sequence + self.per_token * tokens
                + sum(per * min(tokens, window) for window, per in self.windows))

    def tokens_within(self, nbytes: int) -> int:
        """The longest sequence whose cache fits in `nbytes` (0 if not even the fixed state
        does; a model whose cache never grows is capped only by its context)."""
        if self.bytes_for(0) > nbytes:
            return 0
        if self.per_token == 0 and self.bytes_for(1 << 40) <= nbytes:
            return UNBOUNDED
        low, high = 0, 1
        while self.bytes_for(high) <= nbytes:
            low, high = high, high * 2
        while high - low > 1:  # bytes_for never falls as tokens grow: bisect
            mid = (low + high) // 2
            low, high = (mid, high) if self.bytes_for(mid) <= nbytes else (low, mid)
        return low

    def plus(self, other: KvLayout) -> KvLayout:
        """Both caches a sequence holds (a target's and its draft model's)."""
        windows = dict(self.windows)
        for window, per in other.windows:
            windows[window] = windows.get(window, 0) + per
        return KvLayout(self.per_token + other.per_token, tuple(sorted(windows.items())),
                        self.per_sequence + other.per_sequence, self.plain + other.plain)

    def describe(self) -> str:
        parts = [f"{self.per_token} bytes per token in full-attention layers"]
        parts += [f"{per} bytes per token up to {window} tokens in sliding-window layers"
                  for window, per in self.windows]
        if self.per_sequence:
            parts.append(f"{self.per_sequence} bytes of fixed state per sequence")
        return ", ".join(parts)


def measure_kv(model: nn.Module,
               make_cache: Callable[[nn.Module], list[Any]] = make_prompt_cache) -> KvLayout:
    """Run a short prompt through a fresh cache of `model` (as the batch makes it: maybe
    quantized) and read what each layer holds."""
    cache = make_cache(model)
    model(mx.array([list(range(_PROBE_TOKENS))]), cache=cache)
    mx.eval([c.state for c in cache])
    per_token, per_sequence = 0, 0
    windows: dict[int, int] = {}
    plain = tuple(_per_position(c) for c in cache if type(c) is KVCache)
    for layer in leaves(cache):
        if isinstance(layer, ArraysCache):
            per_sequence += _nbytes(layer.state)
        elif isinstance(layer, (RotatingKVCache, ChunkedKVCache)):
            window = int(getattr(layer, "max_size", None) or getattr(layer, "chunk_size"))
            windows[window] = windows.get(window, 0) + _per_position(layer)
        elif isinstance(layer, (KVCache, QuantizedKVCache)):
            per_token += _per_position(layer)
        else:  # a kind this code does not know: count it as growing, the safe side
            log.warning("KV cache kind %s is not known; counted as full attention",
                        type(layer).__name__)
            per_token += _per_position(layer)
    return KvLayout(per_token, tuple(sorted(windows.items())), per_sequence, plain)


def leaves(cache: list[Any]) -> Iterator[Any]:
    """Every cache of `cache`'s layers, a `CacheList`'s members each (LongCat's two
    attentions a layer)."""
    for layer in cache:
        if isinstance(layer, CacheList):
            yield from leaves(list(layer.caches))
        else:
            yield layer


def _arrays(state: Any) -> list[mx.array]:
    flat = tree_flatten(state)
    assert isinstance(flat, list)
    return [a for _, a in flat if isinstance(a, mx.array)]


def _nbytes(state: Any) -> int:
    return sum(a.nbytes for a in _arrays(state))


def _per_position(layer: Any) -> int:
    """Bytes per cached position: every array of a KV cache (keys, values, and a quantized
    cache's scales and biases) has the positions on axis -2, allocated ahead in steps."""
    return sum(a.nbytes // a.shape[-2] for a in _arrays(layer.state) if a.ndim >= 3)
