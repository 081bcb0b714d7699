"""One sequence's KV on a paged replica: the row class a paged batch merges, which holds
either arrays (a fresh row, a prefill outside the batch) or references to blocks of the
pool (a row extracted from the batch, a prefix cache entry, a hit on one).

A row by blocks holds one ref to each block of `blocks` (positions `[0, offset)`, the
last block maybe partial) and gives them back when dropped (`release`, or its finalizer):
extracting a row from the batch, keeping it in the prefix cache, and a hit on that entry
joining the batch again copy no KV. Whoever writes next into a partial block another
holder shares copies that block first (`LayerBlocks.copy_on_write`). `plain` turns rows
into mlx-lm's `KVCache` (a copy) for what leaves the process: the disk tier, a pull.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from replicas.engine.kv.attention import install
from replicas.engine.kv.blocks import BlockPool


class PagedRowKVCache(KVCache):
    """One sequence's KV, mlx-lm's `KVCache`, that merges into a `PagedBatchKVCache` on
    `pool`'s layer `layer`; by blocks where `blocks` is not None (refs this row holds)."""

    # What rows merge into: `PagedBatchKVCache`, set by `replicas.engine.kv.paged`, which
    # imports this module (so this one cannot import it back).
    batch_type: ClassVar[Any] = None

    def __init__(self, pool: BlockPool, layer: int, blocks: list[int] | None = None,
                 length: int = 0) -> None:
        super().__init__()
        self.pool, self.layer = pool, layer
        self.blocks = blocks
        if blocks is not None:
            self.offset = length

    @classmethod
    def shared(cls, pool: BlockPool, layer: int, table: Sequence[int],
               length: int) -> PagedRowKVCache:
        """A row by the first blocks of `table` that `length` positions need, a ref each
        taken for it."""
        blocks = list(table[:pool.blocks_for(length)])
        pool.layer(layer).share(blocks)
        return cls(pool, layer, blocks, length)

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedRowKVCache:
        if self.blocks is not None:  # another holder of the same blocks
            return PagedRowKVCache.shared(self.pool, self.layer, self.blocks, self.offset)
        out = PagedRowKVCache(self.pool, self.layer)  # the pool is the replica's: shared
        out.keys = copy.deepcopy(self.keys, memo)
        out.values = copy.deepcopy(self.values, memo)
        out.offset = self.offset
        return out

    def merge(self, caches: Sequence[Any]) -> Any:  # type: ignore[override]
        # mlx-lm calls `caches[0][i].merge(...)` on the instance: the pool comes with it.
        return self.batch_type.merge(caches, self.pool, self.layer)

    @property
    def state(self) -> Any:
        """mlx-lm's (keys, values, offset); a row by blocks gathers a copy (`plain`)."""
        if self.blocks is None:
            return self.keys, self.values, self.offset
        if self.offset == 0:
            return None, None, 0
        k, v = self.pool.layer(self.layer).read(self.blocks, self.offset)
        return k, v, self.offset

    @state.setter
    def state(self, v: Any) -> None:
        self.release()
        self.keys, self.values, self.offset = v

    def empty(self) -> bool:
        return self.offset == 0 if self.blocks is not None else self.keys is None

    @property
    def nbytes(self) -> int:
        if self.blocks is None:
            return super().nbytes  # type: ignore[no-any-return]
        layer = self.pool.layer(self.layer)
        return len(self.blocks) * layer.nbytes // (layer.capacity + 1)

    def release(self) -> None:
        """Give this row's block refs back (a row by arrays holds none)."""
        blocks, self.blocks = self.blocks, None
        if blocks:
            self.pool.layer(self.layer).release(blocks)

    def __del__(self) -> None:
        try:  # a hit that never joined, an ended row nobody kept: its refs go back
            self.release()
        except Exception:  # noqa: BLE001 - nothing may raise out of a finalizer
            pass


def by_blocks(cache: Sequence[Any]) -> bool:
    """Whether any layer of a row's cache is held by blocks of a pool."""
    return any(isinstance(c, PagedRowKVCache) and c.blocks is not None for c in cache)


def plain(cache: Sequence[Any]) -> list[Any]:
    """A row's cache with its layers by blocks as mlx-lm's `KVCache`s (their KV gathered
    and evaluated: a copy that outlives the blocks); other layers as they are."""
    out: list[Any] = []
    for layer in cache:
        if isinstance(layer, PagedRowKVCache) and layer.blocks is not None:
            row = KVCache()
            k, v, n = layer.state
            if n:
                mx.eval(k, v)
                row.keys, row.values, row.offset = k, v, n
            out.append(row)
        else:
            out.append(layer)
    return out


def into_blocks(cache: Sequence[Any], pool: BlockPool) -> list[Any]:
    """A row's cache with its plain attention layers (arrays) copied into fresh blocks of
    `pool`, as rows by blocks; layers by blocks already, and other kinds, as they are."""
    out: list[Any] = []
    for i, layer in enumerate(cache):
        if type(layer) in (KVCache, PagedRowKVCache) and getattr(layer, "blocks", None) is None:
            n = int(layer.offset) if layer.keys is not None else 0
            blocks = pool.layer(i).allocate(pool.blocks_for(n))
            if n:
                pool.layer(i).write(blocks, layer.keys[..., :n, :], layer.values[..., :n, :])
            out.append(PagedRowKVCache(pool, i, blocks, n))
        else:
            out.append(layer)
    return out


def paged_layers(cache: list[Any]) -> bool:
    """Whether a model's fresh cache (`make_prompt_cache`) pages: at least one layer plain
    attention (`KVCache`, what pages) and every other layer a kind that keeps mlx-lm's own
    batch form beside the pool (`beside_pool`). Quantized KV, `CacheList`s and chunked
    attention keep mlx-lm's padded batch for the whole model for now."""
    return any(type(c) is KVCache for c in cache) and \
        all(type(c) is KVCache or beside_pool(c) for c in cache)


def beside_pool(layer: Any) -> bool:
    """A layer kind whose cost per row is fixed, which a paged batch leaves in mlx-lm's
    batch form (one slot per row): a sliding window (`RotatingKVCache`, its batch
    `BatchRotatingKVCache` keeps at most the window a row), recurrent or SSM state
    (`ArraysCache`)."""
    return type(layer) is RotatingKVCache or isinstance(layer, ArraysCache)


def kinds(cache: list[Any]) -> str:
    """The cache kinds of a model's layers, named once each."""
    return ", ".join(sorted({type(c).__name__ for c in cache}))


def make_paged_prompt_cache(model: nn.Module, pool: BlockPool) -> list[Any]:
    """`make_prompt_cache(model)` with every plain attention layer a `PagedRowKVCache` on
    `pool` (by its layer index); sliding-window and recurrent layers as mlx-lm makes them."""
    cache = make_prompt_cache(model)
    if not paged_layers(cache):
        raise ValueError(f"paged KV: this model's cache layers ({kinds(cache)}) do not page; "
                         "serve it with memory.paged_kv off or auto")
    install(model)  # attention by groups of like length (`replicas.engine.kv.attention`)
    return [PagedRowKVCache(pool, i) if type(c) is KVCache else c for i, c in enumerate(cache)]


def as_paged_rows(cache: list[Any], pool: BlockPool) -> list[Any]:
    """A row's cache (a prefix cache hit) as rows the paged batch merges: rows by blocks
    as they are (the merge shares their blocks), mlx-lm's `KVCache`s sharing their arrays
    (the merge copies what it reads into blocks)."""
    out: list[Any] = []
    for i, layer in enumerate(cache):
        if type(layer) is not KVCache:
            out.append(layer)
            continue
        row = PagedRowKVCache(pool, i)
        row.keys, row.values, row.offset = layer.keys, layer.values, layer.offset
        out.append(row)
    return out
