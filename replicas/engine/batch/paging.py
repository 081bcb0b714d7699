"""Paging a batch's KV: whether a model's batch may page (`unpaged`), its block pool sized
from the budget (`make_pool`), and what admission learns of the prefix cache's blocks the
rows share (`PrefixShares`, `KvBudget.shares`): a hit's full blocks, counted once however
many rows hold them. Split from `local.py`, which calls it from `LocalBatch.page`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from replicas.engine.config import EngineConfig
from replicas.engine.kv.blocks import BLOCK_SIZE, BlockPool
from replicas.engine.kv.budget import KvBudget
from replicas.engine.kv.paged import paged_layers
from replicas.engine.kv.pool_plan import Paging, paging_plan
from replicas.engine.kv.prefix_cache import PromptCache
from replicas.engine.kv.rows import PagedRowKVCache, kinds
from replicas.engine.kv.shared_blocks import NO_BLOCKS
from replicas.engine.model.mrope import row_positions

log = logging.getLogger(__name__)


def unpaged(config: EngineConfig, speculative: bool, model: nn.Module) -> str | None:
    """Why this batch cannot page its KV yet, or None."""
    if config.kv_bits is not None:
        return "kv_bits quantizes the KV (quantized blocks are not built yet)"
    if speculative:
        return "speculation rolls rows back in the padded cache (not on blocks yet)"
    cache = make_prompt_cache(model)
    if not paged_layers(cache):
        return (f"this model's cache layers ({kinds(cache)}) are not plain attention beside "
                "sliding windows and recurrent state only")
    if row_positions(model) is not None and any(type(c) is not KVCache for c in cache):
        return (f"this model's cache layers ({kinds(cache)}) are not all plain attention, and "
                "a hybrid with 3-D (M-RoPE) positions, Qwen3.5 with images, is not checked "
                "paged yet")
    return None


def make_pool(config: EngineConfig, kv: KvBudget, context_length: int) -> tuple[BlockPool, Paging]:
    """The pool for `kv`'s budget: the rows' blocks and the prefix cache's share of the
    same pool (its entries are block refs, `PromptCache.attach`: a hit joins the batch
    without a copy)."""
    layout = kv.layout
    sizes = layout.plain  # the layers that page; a hybrid's others hold a fixed cost
    layers = len(sizes)
    fixed = layout.bytes_for(0) + sum(per * window for window, per in layout.windows)
    plan = paging_plan(kv.budget_bytes, sum(sizes), layers, config.prompt_cache_bytes,
                       BLOCK_SIZE, config.max_batch_size * context_length, max(sizes),
                       fixed, config.max_batch_size)
    pool = BlockPool(plan.blocks + plan.cache_bytes // max(1, plan.block_bytes),
                     plan.block_size)
    log.info("paged KV: %d blocks of %d tokens (%d bytes each, %d layers), a %d-byte "
             "gather reserve, %d bytes for the prefix cache, %d beside the blocks (scratch, a "
             "growth's transient)", plan.blocks, plan.block_size, plan.block_bytes, layers,
             plan.gather_bytes, plan.cache_bytes, plan.growth_bytes)
    if plan.row_bytes:
        log.info("paged KV: the layers that do not page (sliding windows, recurrent state) "
                 "keep mlx-lm's batch form, %d bytes a row, room for %d rows", plan.row_bytes,
                 plan.rows)
    return pool, plan


def hit_blocks(cache: Sequence[Any], length: int) -> frozenset[int]:
    """The full blocks of a hit of `length` tokens held by blocks (its first paged layer's
    ids; every layer's count alike): what a row joining with it shares and never writes.
    The partial last block is not among them: the row copies it before its first write."""
    for layer in cache:
        if isinstance(layer, PagedRowKVCache) and layer.blocks:
            return frozenset(layer.blocks[:length // layer.pool.block_size])
    return NO_BLOCKS


class PrefixShares:
    """`KvBudget.shares` for a paged batch with a prefix cache: the blocks a prompt would
    share (`would_share`, a lookup with no side effect) and those each row in the batch
    shares (`shared_by`, recorded when it joined)."""

    def __init__(self, cache: PromptCache, key: Callable[[Sequence[int], str | None],
                                                          list[int]]) -> None:
        self._cache = cache
        self._key = key  # prompt ids as the prefix cache keys them
        self.by_uid: dict[int, frozenset[int]] = {}

    def would_share(self, tokens: Sequence[int], adapter: str | None) -> frozenset[int]:
        hit = self._cache.peek(self._key(tokens, adapter))
        return hit_blocks(hit.cache, hit.length) if hit is not None else NO_BLOCKS

    def shared_by(self, uid: int) -> frozenset[int] | None:
        return self.by_uid.get(uid)
