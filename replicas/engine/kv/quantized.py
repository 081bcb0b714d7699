"""A quantized KV cache for mlx-lm's continuous batching.

mlx-lm's `BatchGenerator` batches rows through `BatchKVCache`, which holds keys and values
in the model's float dtype; its `QuantizedKVCache` packs them to 4 or 8 bits but serves one
sequence and cannot be merged into a batch. This module supplies the two missing pieces:

- `BatchQuantizedKVCache`: `BatchKVCache`'s interface (left padding, right padding rolled
  to the left, filter/extend/extract/merge) over `QuantizedKVCache`'s packed layout, so
  mlx-lm's `scaled_dot_product_attention` takes its quantized path with the batch mask.
- `QuantizedRowKVCache`: a `QuantizedKVCache` whose `merge` builds the batch form, which is
  how `BatchGenerator` (`_merge_caches` asks row 0's class) picks the batch cache class.

`make_quantized_prompt_cache` builds a model's per-row caches with the plain `KVCache`s
(a layer's, or a `CacheList`'s) swapped for `QuantizedRowKVCache`; pass them to
`BatchGenerator.insert(caches=...)` for every row (a row given no cache gets mlx-lm's float
cache, which cannot share a batch).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_reduce
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    QuantizedKVCache,
    _BaseCache,
    dynamic_roll,
    make_prompt_cache,
)

from replicas.engine.model.mla import ABSORBING, has_sparse_indexer, mla_attentions

# One quantized tensor as `mx.quantize` packs it: (uint32 codes, scales, biases), every
# part (batch, kv heads, positions, ...), positions on axis 2.
Packed = tuple[mx.array, ...]

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def _take(x: Packed, fn: Any) -> Packed:
    return tuple(fn(a) for a in x)


def _ints(a: mx.array) -> list[int]:
    return [int(v) for v in cast(list[int], a.tolist())]


class QuantizedRowKVCache(QuantizedKVCache):
    """One sequence's quantized KV, as mlx-lm's `QuantizedKVCache`, that a batch can merge."""

    keys: Any  # mlx-lm leaves these untyped (None until the first write)
    values: Any

    def size(self) -> int:
        # `_BaseCache.size` answers 0; the merge needs the real length.
        return int(self.offset)

    def view(self, length: int) -> QuantizedRowKVCache:
        """A row over the same arrays holding the first `length` positions (no copy): the
        batch merge only reads them, as `prompt_cache.prefix_view` relies on."""
        out = QuantizedRowKVCache(group_size=self.group_size, bits=self.bits)
        out.keys, out.values, out.offset = self.keys, self.values, min(length, self.offset)
        return out

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    # Stored (disk tier, pulls) as the positions it holds, as mlx-lm's `KVCache` does: a
    # row's arrays may run past its offset (a view, or room allocated ahead).
    @property  # type: ignore[override]
    def state(self) -> tuple[Any, ...]:
        keys, values = self.keys, self.values
        if keys is not None and self.offset < keys[0].shape[2]:
            keys, values = (_take(x, lambda a: a[..., :self.offset, :]) for x in (keys, values))
        return keys, values, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.group_size, self.bits = v


def stored_name(layer: Any) -> str:
    """The class a stored cache layer is named by: mlx-lm's own, so its loader reads the
    file (`load_prompt_cache` knows only its module's classes)."""
    if type(layer) is QuantizedRowKVCache:
        return "QuantizedKVCache"
    # A paged batch's fresh row (`replicas.engine.kv.paged`) is mlx-lm's `KVCache` stored.
    return "KVCache" if type(layer).__name__ == "PagedRowKVCache" else type(layer).__name__


def stored_state(layer: Any) -> Any:
    """A cache layer's state as stored: a `CacheList` names its members (in its state) by
    `stored_name` too."""
    if isinstance(layer, CacheList):
        return [(stored_state(c), stored_name(c)) for c in layer.caches]
    return layer.state


def as_rows(cache: list[Any]) -> list[Any]:
    """A loaded cache with mlx-lm's quantized layers (a `CacheList`'s members too) as rows
    a batch can merge."""
    return [_as_row(layer) for layer in cache]


def _as_row(layer: Any) -> Any:
    if isinstance(layer, CacheList):
        return CacheList(*(_as_row(c) for c in layer.caches))
    if type(layer) is not QuantizedKVCache:
        return layer
    row = QuantizedRowKVCache(group_size=layer.group_size, bits=layer.bits)
    row.keys, row.values = tuple(cast(Any, layer.keys)), tuple(cast(Any, layer.values))
    row.offset = layer.offset
    return row


class BatchQuantizedKVCache(_BaseCache):
    """`BatchKVCache` with keys and values packed by `mx.quantize`.

    Rows are left-padded: row `i`'s positions are `[left_padding[i], _idx)` of axis 2, and
    `offset[i]` is its length (RoPE's position of the next token)."""

    step = 256

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8):
        self.keys: Packed | None = None
        self.values: Packed | None = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = group_size  # read by mlx-lm's quantized attention
        self.bits = bits

    def _alloc(self, shape: tuple[int, ...], dim: int, dtype: mx.Dtype) -> Packed:
        per_word = 32 // self.bits
        return (mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype),
                mx.zeros((*shape, dim // self.group_size), dtype=dtype))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Packed, Packed]:
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            B, H = keys.shape[:2]
            grow = (B, H, (self.step + n - 1) // self.step * self.step)
            new_k = self._alloc(grow, keys.shape[3], keys.dtype)
            new_v = self._alloc(grow, values.shape[3], values.dtype)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                # Drop the unused tail before growing, as `BatchKVCache` does.
                old_k = _take(self.keys, lambda a: a[..., :prev, :])
                old_v = _take(self.values, lambda a: a[..., :prev, :])
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old_k, new_k))
                self.values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old_v, new_v))
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for store, new in ((self.keys, qk), (self.values, qv)):
            for a, b in zip(store, new):
                a[..., prev:self._idx, :] = b
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Packed, Packed]:
        assert self.keys is not None and self.values is not None
        idx = self._idx
        return (_take(self.keys, lambda a: a[..., :idx, :]),
                _take(self.values, lambda a: a[..., :idx, :]))

    def prepare(self, *, left_padding: Sequence[int] | None = None,
                lengths: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty cache")
            pad = mx.array(list(left_padding))
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        # `lengths` only matters to recurrent caches; attention masks by left padding.
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(list(right_padding))

    def finalize(self) -> None:
        """Roll each row's right padding (a short prompt's pad tokens, or speculative tokens
        it rejected) round to its left, where the mask hides it; the next write overwrites
        what wrapped past `_idx`."""
        if self._right_padding is None:
            return
        pad = self._right_padding
        if self.keys is not None and self.values is not None:
            self.keys = _take(self.keys, lambda a: dynamic_roll(a, pad[:, None], axis=2))
            self.values = _take(self.values, lambda a: dynamic_roll(a, pad[:, None], axis=2))
        self.offset = self.offset - pad
        self.left_padding = self.left_padding + pad
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return (self.keys, self.values, self.offset, self.left_padding, self._idx,
                self.group_size, self.bits)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (self.keys, self.values, self.offset, self.left_padding, self._idx,
         self.group_size, self.bits) = v
        self._right_padding = None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding,
                                  **kwargs)

    def filter(self, batch_indices: Sequence[int]) -> None:
        idx = mx.array(list(batch_indices))
        if self.keys is not None and self.values is not None:
            self.keys = _take(self.keys, lambda a: a[idx])
            self.values = _take(self.values, lambda a: a[idx])
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        # Drop the columns every remaining row pads, so a long row leaving frees its KV.
        shift = min(_ints(self.left_padding))
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _take(self.keys, lambda a: a[..., shift:, :])
                self.values = _take(self.values, lambda a: a[..., shift:, :])
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if not isinstance(other, BatchQuantizedKVCache) or \
                (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError(f"cannot batch a {type(other).__name__} with these quantized rows")
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self if self.keys is not None else other
        assert ref.keys is not None and ref.values is not None
        top = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        # Right-justify both at `top` and pad them to one length, as `BatchKVCache` does.
        def fit(c: BatchQuantizedKVCache, x: Packed | None, like: Packed) -> Packed:
            if x is None:
                rows = c.offset.shape[0]
                x = tuple(mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype) for a in like)
            left = top - c._idx
            right = size - x[0].shape[2] - left
            if right < 0:
                x = _take(x, lambda a: a[..., :right, :])
                right = 0
            return _take(x, lambda a: mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]))

        (ka, va, a), (kb, vb, b) = [(fit(c, c.keys, ref.keys), fit(c, c.values, ref.values), c)
                                    for c in (self, other)]
        self.keys = tuple(mx.concatenate(list(p)) for p in zip(ka, kb))
        self.values = tuple(mx.concatenate(list(p)) for p in zip(va, vb))
        self.offset = mx.concatenate([a.offset, b.offset])
        self.left_padding = mx.concatenate([a.left_padding + (top - a._idx),
                                            b.left_padding + (top - b._idx)])
        self._idx = top

    def extract(self, idx: int) -> QuantizedRowKVCache:
        row = QuantizedRowKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None or self.values is None:
            return row
        start = _ints(self.left_padding)[idx]
        end = self._idx
        # Contiguous copies: a slice would pin the whole batch's KV.
        row.keys = _take(self.keys, lambda a: mx.contiguous(a[idx:idx + 1, :, start:end]))
        row.values = _take(self.values, lambda a: mx.contiguous(a[idx:idx + 1, :, start:end]))
        row.offset = end - start
        return row

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchQuantizedKVCache:
        """One batch from per-row caches, each left-padded to the longest."""
        first = caches[0]
        for c in caches:
            if not isinstance(c, QuantizedKVCache) or \
                    (c.bits, c.group_size) != (first.bits, first.group_size):
                raise ValueError("a quantized KV batch needs every row quantized alike: "
                                 f"{type(c).__name__} {getattr(c, 'bits', None)} bits, "
                                 f"group {getattr(c, 'group_size', None)}")
        lengths = [int(c.offset) if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size=first.group_size, bits=first.bits)
        ref = next(c for c, n in zip(caches, lengths) if n)
        B, H = len(caches), ref.keys[0].shape[1]
        keys = [mx.zeros((B, H, longest, a.shape[3]), a.dtype) for a in ref.keys]
        values = [mx.zeros((B, H, longest, a.shape[3]), a.dtype) for a in ref.values]
        for i, (n, c) in enumerate(zip(lengths, caches)):
            for store, part in ((keys, c.keys), (values, c.values)):
                for a, b in zip(store, part if n else ()):
                    a[i:i + 1, :, longest - n:] = b[..., :n, :]
        cache = cls([longest - n for n in lengths], group_size=first.group_size, bits=first.bits)
        cache.keys, cache.values = tuple(keys), tuple(values)
        cache.offset = cache.offset + longest
        cache._idx = longest
        return cache

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales and biases of every allocated position."""
        if self.keys is None:
            return 0
        return int(tree_reduce(lambda n, a: n + a.nbytes, (self.keys, self.values), 0))


def cache_maker(bits: int | None, group_size: int) -> Callable[[nn.Module], list[Any]]:
    """What makes a row's fresh cache for the engine: mlx-lm's own, or quantized."""
    if bits is None:
        return make_prompt_cache
    _check(bits, group_size)  # refuse bad values now, not at the first request
    return partial(make_quantized_prompt_cache, bits=bits, group_size=group_size)


def _check(bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"KV cache bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"KV cache group size must be one of {GROUP_SIZES}, got {group_size}")


def _check_latents(model: nn.Module, group_size: int) -> None:
    """MLA caches a latent and a rope key per token: Orchard's attention reads them packed
    (`replicas.engine.model.mla`), mlx-lm's own cannot, and each must split into whole groups."""
    for attention in mla_attentions(model):
        name = type(attention).__name__
        if type(attention) not in ABSORBING.values():
            raise ValueError(f"kv_bits: this model's MLA attention ({name}) reads its KV "
                             "cache unquantized; serve it without kv_bits")
        widths = {"latent": attention.kv_lora_rank, "rope key": attention.qk_rope_head_dim}
        if any(w % group_size for w in widths.values()):
            raise ValueError(
                f"kv_bits: this model's MLA caches a {widths['latent']}-wide latent and a "
                f"{widths['rope key']}-wide rope key per token, and kv_group_size "
                f"{group_size} must divide both: choose a smaller kv_group_size")


def make_quantized_prompt_cache(model: nn.Module, bits: int, group_size: int) -> list[Any]:
    """`make_prompt_cache(model)` with each plain `KVCache` quantized to `bits`, a layer's or
    a `CacheList`'s (LongCat's two attentions a layer); sliding-window and recurrent caches
    stay as mlx-lm makes them."""
    _check(bits, group_size)
    cache = make_prompt_cache(model)
    # A sparse indexer reads its own keys unpacked: only the latent (`[0]`) is packed.
    members = 1 if has_sparse_indexer(model) else None
    quantized = [_quantized(c, bits, group_size, members) for c in cache]
    if all(q is c for q, c in zip(quantized, cache)):
        kinds = sorted({type(c).__name__ for c in cache})
        raise ValueError(f"kv_bits: none of this model's cache layers ({', '.join(kinds)}) "
                         "has a quantized form in the batch; serve it without kv_bits")
    # mlx-lm's quantized attention refuses attention sinks (gpt-oss): fail here, not mid-request.
    params = tree_flatten(model.parameters())
    assert isinstance(params, list)
    if any(name.split(".")[-1] == "sinks" for name, _ in params):
        raise ValueError("mlx-lm's quantized attention does not support attention sinks")
    _check_latents(model, group_size)
    return quantized


def _quantized(layer: Any, bits: int, group_size: int, members: int | None) -> Any:
    """`layer` packed where it is plain attention KV (the first `members` of a `CacheList`,
    all for None: its merge batches member by member), else `layer` itself."""
    if type(layer) is KVCache:
        return QuantizedRowKVCache(group_size=group_size, bits=bits)
    if isinstance(layer, CacheList) and all(type(c) is KVCache for c in layer.caches):
        return CacheList(*(QuantizedRowKVCache(group_size=group_size, bits=bits)
                           if members is None or i < members else c
                           for i, c in enumerate(layer.caches)))
    return layer
