"""The prefix cache's entries (`replicas.engine.kv.prefix_cache.PromptCache` builds its
lookups on them): keeping a prompt's KV (`save`), what the entries count against the byte
bound and what running requests leave (`bound`, `limit`, `nbytes`), and LRU eviction, to
the disk tier where there is one. Used only on the engine thread (it holds MLX arrays).

On a paged replica (`attach`) an entry is block refs in the batch's pool
(`replicas.engine.kv.rows`): one saved from the batch shares the row's blocks, entries with
a common prefix share its blocks, and an entry counts only the blocks no row holds
(`cache_only`: rows count the ones they hold), so a block counts once. Evicting an entry
drops its refs; a block goes back to the pool at zero, and the pool asks for evictions when
a row needs blocks only the cache holds (`_reclaim`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache

from replicas.engine.kv.blocks import BlockPool, PoolExhausted
from replicas.engine.kv.directory import HeldBlocks
from replicas.engine.kv.disk import DiskTier
from replicas.engine.kv.rows import PagedRowKVCache, into_blocks, plain
from replicas.engine.kv.trie import PrefixTrie

log = logging.getLogger("replicas.engine.kv.prefix_cache")  # one logger for the cache


@dataclass
class _Entry:
    cache: list[Any]
    nbytes: int  # its arrays' bytes (scaled); by blocks, only a hybrid's other layers'
    # (its blocks count in `nbytes`, `PromptCache.nbytes`)


class PrefixEntries:
    """The entries, oldest first, under `max_bytes` and what running requests leave."""

    def __init__(self, max_bytes: int, cost_scale: tuple[int, int] = (1, 1),
                 disk: DiskTier | None = None, held: HeldBlocks | None = None) -> None:
        """`cost_scale` (num, den): an entry counts `nbytes * num // den` against
        `max_bytes`. A pipeline stage holding `l` of a model's `L` layers on `n` ranks uses
        (L, l * n): every stage then counts the same bytes for the same tokens, so all
        ranks of a sharded replica keep and evict the same entries (`replicas.engine.sharded.lockstep`)."""
        self.max_bytes = max_bytes
        self._scale = cost_scale
        # Where evicted entries go, and every entry at shutdown; looked up after memory.
        self._disk = disk
        # The prefix directory's view of what this tier holds (`replicas.engine.kv.directory`).
        self._held = held or HeldBlocks()
        self._trie = PrefixTrie()
        self._pool: BlockPool | None = None  # the paged batch's pool, where entries live
        self._lru: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # oldest first
        self._bytes = 0
        # What running requests leave of the replica's KV budget (`bound`); None: no budget.
        self._room: int | None = None
        self._evictions = 0

    @property
    def nbytes(self) -> int:
        """What the entries count against `max_bytes` (scaled by `cost_scale`): their
        arrays, and the pool's blocks that only this cache holds."""
        pool = self._pool
        if pool is None:
            return self._bytes
        pooled = pool.cache_only * pool.block_bytes * self._scale[0] // self._scale[1]
        return self._bytes + pooled

    def attach(self, pool: BlockPool) -> None:
        """Keep entries in `pool` from now on, by block refs (the paged batch's pool); the
        pool asks this cache to evict when a row needs blocks only it holds."""
        self._pool = pool
        pool.reclaim = self._reclaim


    @property
    def limit(self) -> int:
        """The most the entries may count now: `max_bytes`, or less where running requests
        leave less of the KV budget (`bound`)."""
        return self.max_bytes if self._room is None else min(self.max_bytes, self._room)

    def bound(self, room: int) -> None:
        """Hold at most `room` from now on, besides `max_bytes` (KV memory admission: what
        running requests leave of the budget), evicting now as far as that takes. A save
        evicts before it adds, so the entries never pass it, not even inside a step."""
        self._room = max(0, room)
        self.evict_to(self.limit)


    def save(self, tokens: list[int], cache: list[Any], spill: bool = True,
             persist: bool = True) -> None:
        """Keep `cache`, the KV of exactly `tokens`, evicting first to stay within `limit`;
        what is evicted goes to the disk tier (`spill`: also `cache` itself, when it alone
        passes the limit). With `spill` and `persist`, `cache` is also written to the disk
        tier now, in the background: a replica stopped without its shutdown (SIGTERM to
        `serve run`, a kill) loses only what was not written yet."""
        if not tokens or not cache:
            return
        if self._pool is not None:
            self._save_blocks(tokens, cache, spill, persist)
            return
        mx.eval([c.state for c in cache])  # a lazy slice would pin the whole batch's KV
        nbytes = sum(c.nbytes for c in cache) * self._scale[0] // self._scale[1]
        if nbytes > self.limit:
            log.debug("prompt cache: %d tokens (%d bytes) exceed the bound", len(tokens), nbytes)
            if self._disk is not None and spill:
                self._disk.put(tokens, cache)
            return
        # What this entry replaces goes first, then the oldest make room, then it is added:
        # the bytes held never pass the limit in between (`stats` reads them from another
        # thread, and admission counts on them).
        key = tuple(tokens)
        replaced = self._lru.pop(key, None)
        if replaced is not None:
            self._bytes -= replaced.nbytes
        if can_trim_prompt_cache(cache):
            # Entries on this one's path are its prefixes: it serves them by trimming.
            for prefix_key in self._trie.remove_prefixes(key):
                self._bytes -= self._lru.pop(prefix_key).nbytes
                self._held.remove(prefix_key)
        self.evict_to(self.limit - nbytes)
        if replaced is None:
            self._trie.add(key)
            self._held.add(key)
        self._lru[key] = _Entry(cache, nbytes)
        self._bytes += nbytes
        if self._disk is not None and spill and persist:
            self._disk.put(tokens, cache)

    def _save_blocks(self, tokens: list[int], cache: list[Any], spill: bool,
                     persist: bool) -> None:
        """`save` on a paged replica: the entry by block refs (arrays copied into blocks
        first), counting only the blocks this cache held no ref to before."""
        assert self._pool is not None
        pool = self._pool
        try:
            cache = into_blocks(cache, pool)
        except PoolExhausted:
            log.debug("prompt cache: no free blocks for %d tokens", len(tokens))
            return
        mx.eval([c.state for c in cache if not isinstance(c, PagedRowKVCache)])  # no lazy slice
        if self._new_bytes(cache) > self.limit:
            if self._disk is not None and spill:
                self._disk.put(tokens, plain(cache))
            return
        key = tuple(tokens)
        replaced = self._lru.pop(key, None)
        if replaced is not None and any(a is b for a, b in zip(replaced.cache, cache)):
            self._lru[key] = replaced  # the same rows kept again: nothing changes
            return
        if replaced is not None:
            self._drop(replaced)
        if can_trim_prompt_cache(cache):  # it serves them by trimming (a hybrid's cannot)
            for prefix_key in self._trie.remove_prefixes(key):
                self._drop(self._lru.pop(prefix_key))
                self._held.remove(prefix_key)
        fixed = self._fixed(cache)
        self.evict_to(self.limit - self._new_bytes(cache))
        if replaced is None:
            self._trie.add(key)
            self._held.add(key)
        for layer in cache:
            if isinstance(layer, PagedRowKVCache) and layer.blocks:
                pool.layer(layer.layer).hold(layer.blocks)
        self._lru[key] = _Entry(cache, fixed)
        self._bytes += fixed
        if self._disk is not None and spill and persist:
            self._disk.put(tokens, plain(cache))

    def _new_bytes(self, cache: list[Any]) -> int:
        """What an entry by blocks would add: its blocks this cache holds no ref to yet,
        and a hybrid's layers that do not page (its own arrays: `_fixed`)."""
        assert self._pool is not None
        layers = [c for c in cache if isinstance(c, PagedRowKVCache) and c.blocks]
        fresh = max((self._pool.layer(c.layer).uncached(c.blocks or []) for c in layers),
                    default=0)
        return fresh * self._pool.block_bytes * self._scale[0] // self._scale[1] + \
            self._fixed(cache)

    def _fixed(self, cache: list[Any]) -> int:
        """An entry's bytes outside the pool (scaled): a hybrid's sliding-window and
        recurrent layers, which it holds as arrays of its own."""
        own = sum(c.nbytes for c in cache if not isinstance(c, PagedRowKVCache))
        return own * self._scale[0] // self._scale[1]

    def _drop(self, entry: _Entry) -> None:
        """An entry leaves: its arrays' bytes, or its block refs, go back."""
        self._bytes -= entry.nbytes
        for layer in entry.cache:
            if isinstance(layer, PagedRowKVCache) and layer.blocks is not None:
                if layer.blocks:
                    layer.pool.layer(layer.layer).unhold(layer.blocks)
                layer.release()

    def evict_to(self, limit: int) -> None:
        """Drop the least recently used entries until at most `limit` bytes remain."""
        while self.nbytes > max(0, limit) and self._lru:
            self._evict_oldest()

    def _reclaim(self, blocks: int) -> None:
        """The pool is `blocks` short: evict the oldest entries until as many blocks that
        only this cache held are free (or none is left)."""
        assert self._pool is not None
        start = self._pool.cache_only
        while self._lru and start - self._pool.cache_only < blocks:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        old_key, old = self._lru.popitem(last=False)
        self._trie.remove(old_key)
        self._held.remove(old_key)
        self._evictions += 1
        if self._disk is not None:
            self._disk.put(old_key, plain(old.cache))
        self._drop(old)
        log.debug("prompt cache eviction: %d tokens (now %d of %d bytes)", len(old_key),
                  self.nbytes, self.limit)
