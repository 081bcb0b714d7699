"""The block pool: a replica's full-attention KV in fixed-size blocks, one free list per layer.

Each paged layer keeps its keys and values in one array apiece, head-major over slots
(`[n_kv_heads * slots, head_dim]`, row `h * slots + s` is head h's slot s): block b holds
slots `[b * block_size, (b + 1) * block_size)`, and the last block is scratch (padding
reads it, pad columns write it). Writing a step is one scatter; reading the batch's view
is one gather of whole blocks (`by_block`: `[n_kv_heads * (blocks + 1), block_size,
head_dim]`, head h's block b at `h * (blocks + 1) + b`), whose result comes out as the
`[B, H, L, D]` attention reads, contiguous: a transposed view would make attention copy
it (2x the view's bytes more at the peak, measured on this CPU), and a gather of whole
blocks is 2-3x faster than one by position here (load/results/paged_kv.md). A layer's
arrays are made at its first write (only then are its heads and dtype known) and hold only
the blocks in use plus headroom (`capacity`), never more than the budget's `num_blocks`.

Why the arrays grow by reallocation (doubling) and not in fixed-size segments: a segmented
pool never copies, but every step's gather of a row's view (and each group's) would span
segments: a gather per segment and a merge, every step of every layer, for ever. Doubling
copies a layer's blocks once per doubling (log2(budget / 16 blocks) times in a replica's
life, amortized under one copy of what is held) and keeps the one gather from one array.
Block ids stay stable (block b is slots `[b * block_size, ...)` at any capacity; only the
scratch block, always last, moves), so rows and the prefix cache keep their tables. The
cost is a transient: a growth holds one layer's old and new arrays for a moment (layers
grow one at a time, each in its own `update_and_fetch`), i.e. one layer's old arrays above
the grown pool, at most 1/layers of the pool. It comes while a step's graph is built, when
the step before may still be running (`batch/decode.py` queues one ahead) and hold its
gathered view: a growth (or a shrink) waits for it first (a stall log2(blocks) times in
a replica's life), so the gather reserve holds the view or the transient in turn, and the
plan sizes the pool so the transient fits what its arrays leave plus that reserve
(`kv/pool_plan.py`; test_paged_growth.py checks it by MLX's peak memory). Free ids are
handed out lowest first (a heap), so held blocks stay packed at the bottom, and
once blocks were freed and the highest held one lies in the bottom quarter, the next write
halves the capacity (`_shrink`), or `trim` does when the batch empties
(`LocalBatch.finish`): a replica that served a long burst gives the memory back, idle too.

Every layer has its own free list: mlx-lm calls each layer's cache on its own, and all
layers of a batch grow alike, so their tables stay in step without a shared row object.
Refcounts let a block be held by more than one owner (a batch and its `split` copy, rows
that share a prefix, the prefix cache's entries); a block returns to its free list when its
count reaches zero. A holder never writes a block another holds (`copy_on_write`). Of each
block's refs, those the prefix cache holds are counted apart (`hold`/`unhold`), so the pool
knows which blocks the cache holds (`cached`) and which only the cache holds (`cache_only`:
what evicting the cache would free), without a walk.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

# Tokens per block: 32 measured no slower than 16 on the CPU here and halves the tables
# (load/results/paged_kv.md); a row wastes under one block per layer.
BLOCK_SIZE = 32
# A layer's first capacity in blocks (it doubles from there): 512 tokens at 32 a block.
MIN_BLOCKS = 16


class PoolExhausted(RuntimeError):
    """No free block left: admission let more KV in than the pool holds."""


@dataclass(frozen=True)
class PoolStats:
    block_size: int
    total: int  # blocks per layer
    used: int  # blocks held (in the layer that holds the most)
    free: int
    shared: int  # blocks the prefix cache holds (a hit reads them in place, uncopied)
    allocated: int = 0  # blocks the arrays hold now (the layer that holds the most)


class LayerBlocks:
    """One layer's blocks: its storage, its free list and each block's refcount."""

    def __init__(self, num_blocks: int, block_size: int,
                 reclaim: Callable[[int], None] | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks  # the most blocks this layer may hold (the budget's)
        self.capacity = 0  # block ids [0, capacity) exist: the arrays hold them + scratch
        self._free: list[int] = []  # a heap of free ids below `capacity`: lowest first
        self._refs: list[int] = []
        self._cache_refs: list[int] = []  # of `_refs`, those the prefix cache holds
        self._used = 0
        self._packed = True  # no block freed since the last look for a shrink
        self.cached = 0  # blocks the prefix cache holds
        self.cache_only = 0  # blocks only the prefix cache holds
        self.multi = 0  # blocks more than one holder holds (a write copies them first)
        self._reclaim = reclaim  # asked to free blocks (the prefix cache evicts) when short
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.heads = 0

    @property
    def slots(self) -> int:
        """Slots per head in the arrays: `capacity` blocks and the scratch block, last."""
        return (self.capacity + 1) * self.block_size

    @property
    def free(self) -> int:
        return self.num_blocks - self._used

    @property
    def used(self) -> int:
        return self._used

    def allocate(self, n: int) -> list[int]:
        """`n` free blocks, lowest first (a row growing alone takes one run of blocks,
        which its view slices without a gather). Where the budget's blocks run short, the
        prefix cache is asked to give back blocks only it holds first; where only the
        capacity does, the arrays grow (doubling)."""
        if n > self.free and self._reclaim is not None:
            self._reclaim(n - self.free)
        if n > self.free:
            raise PoolExhausted(f"the KV block pool has {self.free} free blocks of "
                                f"{self.num_blocks}, {n} asked for")
        if n > len(self._free):
            want = max(MIN_BLOCKS, self.capacity)
            while want < self._used + n:
                want *= 2
            self._resize(min(want, self.num_blocks))
        out = [heapq.heappop(self._free) for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        self._used += n
        return out

    def _resize(self, capacity: int) -> None:
        """Block ids `[0, capacity)`, the arrays copied to match (ids above it are free)."""
        old = self.capacity
        if capacity > old:
            self._refs += [0] * (capacity - old)
            self._cache_refs += [0] * (capacity - old)
            for b in range(old, capacity):
                heapq.heappush(self._free, b)
        else:
            del self._refs[capacity:], self._cache_refs[capacity:]
            self._free = [b for b in self._free if b < capacity]
            heapq.heapify(self._free)
        self.capacity = capacity
        if self.keys is None or self.values is None:
            return
        # The step before (queued one ahead) ends first: its gathered view is gone before old
        # and new arrays stand side by side (a growth's, or a shrink's), so the two share one
        # reserve (pool_plan). Rare: log2(blocks) growths in a replica's life.
        mx.synchronize()
        keep = min(old, capacity) * self.block_size
        arrays = []
        for a in (self.keys, self.values):
            grown = mx.zeros((self.heads, self.slots, a.shape[1]), a.dtype)
            if keep:
                grown[:, :keep] = a.reshape(self.heads, -1, a.shape[1])[:, :keep]
            arrays.append(grown.reshape(-1, a.shape[1]))
        self.keys, self.values = arrays
        mx.eval(self.keys, self.values)  # the old arrays go now, not with a later step

    def _shrink(self) -> None:
        """Halve the capacity while at most a quarter of it lies at or below the highest
        held block (hysteresis: a shrunk pool is at most half full, so it does not grow
        back at once)."""
        self._packed = True
        if self._used * 4 > self.capacity or self.capacity <= MIN_BLOCKS:
            return
        top = self.capacity
        while top > 0 and self._refs[top - 1] == 0:
            top -= 1
        want = self.capacity
        while want > MIN_BLOCKS and max(top, self._used) * 4 <= want:
            want //= 2
        if want < self.capacity:
            self._resize(max(want, MIN_BLOCKS))

    def trim(self) -> None:
        """Give trailing free capacity back now, not at the next write (the batch is
        empty: the next write may be long in coming)."""
        if not self._packed:
            self._shrink()

    def share(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} is free"
            self._change(b, 1, 0)

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            assert self._refs[b] > self._cache_refs[b], f"block {b} released twice"
            self._change(b, -1, 0)
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)
                self._used -= 1
                self._packed = False

    def hold(self, blocks: Sequence[int]) -> None:
        """One ref each of `blocks` (already held) is the prefix cache's from now on."""
        for b in blocks:
            assert self._refs[b] > self._cache_refs[b], f"block {b} is not held"
            self._change(b, 0, 1)

    def unhold(self, blocks: Sequence[int]) -> None:
        """The prefix cache gives its ref back: a plain ref again (then `release`d)."""
        for b in blocks:
            assert self._cache_refs[b] > 0, f"block {b} is not the prefix cache's"
            self._change(b, 0, -1)

    def _change(self, b: int, refs: int, cache: int) -> None:
        c, r = self._cache_refs[b], self._refs[b]
        was_cached, was_only = c > 0, c > 0 and c == r
        self.multi -= r > 1
        c, r = c + cache, r + refs
        self._cache_refs[b], self._refs[b] = c, r
        self.multi += r > 1
        self.cached += (c > 0) - was_cached
        self.cache_only += (c > 0 and c == r) - was_only

    def refs(self, block: int) -> int:
        return self._refs[block]

    def uncached(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` the prefix cache holds no ref to yet."""
        return sum(1 for b in set(blocks) if self._cache_refs[b] == 0)

    def copy_on_write(self, block: int) -> int:
        """A fresh block holding `block`'s KV, for a holder about to write into `block`
        while others hold it too: it drops its ref to `block` and writes the copy."""
        [fresh] = self.allocate(1)
        if self.keys is not None and self.values is not None:
            bs = self.block_size
            heads = mx.array((self.slots * np.arange(self.heads)[:, None] +
                              np.arange(bs)).astype(np.int32))
            src, dst = heads + block * bs, heads + fresh * bs
            k, v = self.keys[src], self.values[src]
            mx.eval(k, v)  # read before the write: the pool's arrays stay donatable
            self.keys[dst] = k
            self.values[dst] = v
        self.release([block])
        return fresh

    def write(self, table: Sequence[int], keys: mx.array, values: mx.array) -> None:
        """One sequence's KV (`[1, H, n, D]`) into the blocks of `table`, position p in
        slot p of the table."""
        n = keys.shape[2]
        store_k, store_v = self.storage(keys, values)
        at = mx.array(self.rows_of(table, np.arange(n)).reshape(-1))
        store_k[at] = keys[0].reshape(-1, keys.shape[3])
        store_v[at] = values[0].reshape(-1, values.shape[3])

    def read(self, table: Sequence[int], length: int) -> tuple[mx.array, mx.array]:
        """Positions `[0, length)` of the sequence in `table`, gathered (`[1, H, n, D]`)."""
        assert self.keys is not None and self.values is not None
        at = mx.array(self.rows_of(table, np.arange(length)))
        return self.keys[at][None], self.values[at][None]

    def rows_of(self, table: Sequence[int], positions: np.ndarray) -> np.ndarray:
        """The storage rows of a sequence's `positions` (`[n]`), every head's: `[H, n]`."""
        bs = self.block_size
        slots = np.asarray(table, dtype=np.int64)[positions // bs] * bs + positions % bs
        heads = np.arange(self.heads)[:, None] * self.slots
        return (heads + slots[None, :]).astype(np.int32)

    def storage(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The layer's arrays, allocated at the first write, shaped as `keys`/`values`
        (`[B, H, n, D]`) say."""
        if self.keys is None or self.values is None:
            self.heads = keys.shape[1]
            rows = self.heads * self.slots
            self.keys = mx.zeros((rows, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((rows, values.shape[3]), values.dtype)
            mx.eval(self.keys, self.values)
        elif not self._packed:  # blocks were freed: maybe give trailing capacity back
            self._shrink()
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def by_block(self) -> tuple[mx.array, mx.array]:
        """The layer's arrays as `[H * (capacity + 1), block_size, D]` (a free reshape)."""
        assert self.keys is not None and self.values is not None
        rows = self.heads * (self.capacity + 1)
        return (self.keys.reshape(rows, self.block_size, self.keys.shape[1]),
                self.values.reshape(rows, self.block_size, self.values.shape[1]))

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class BlockPool:
    """A replica's blocks: at most `num_blocks` per paged layer (the arrays hold what is
    used plus headroom), `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs blocks: {num_blocks} of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._layers: dict[int, LayerBlocks] = {}
        # Frees blocks only the prefix cache holds when a layer runs short (set by the
        # prefix cache that keeps its entries in this pool: `PromptCache.attach`).
        self.reclaim: Callable[[int], None] | None = None
        # The last index arrays a paged batch built, by kind, with the shape they are for
        # (`PagedBatchKVCache._shared`): the other layers of the step reuse them.
        self.memo: dict[str, tuple[tuple[Any, ...], Any]] = {}

    @classmethod
    def sized(cls, nbytes: int, bytes_per_token: int, block_size: int = BLOCK_SIZE,
              most_tokens: int | None = None) -> BlockPool:
        """As many blocks as `nbytes` holds at `bytes_per_token` (every paged layer's KV
        for one token), never more than `most_tokens` need (all the batch could hold)."""
        blocks = nbytes // max(1, bytes_per_token * block_size)
        if most_tokens is not None:
            blocks = min(blocks, math.ceil(most_tokens / block_size))
        return cls(max(1, blocks), block_size)

    def layer(self, index: int) -> LayerBlocks:
        if index not in self._layers:
            self._layers[index] = LayerBlocks(self.num_blocks, self.block_size,
                                              self._reclaimed)
        return self._layers[index]

    def _reclaimed(self, n: int) -> None:
        if self.reclaim is not None:
            self.reclaim(n)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def trim(self) -> None:
        """Every layer's trailing free capacity back (`LayerBlocks.trim`), and the index
        arrays kept for the last batch shape: the batch went idle."""
        self.memo.clear()
        for layer in self._layers.values():
            layer.trim()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers.values())

    @property
    def block_bytes(self) -> int:
        """One block's KV in every layer that has written (0 before the first write)."""
        return sum(layer.nbytes // (layer.capacity + 1)  # the scratch block is held too
                   for layer in self._layers.values())

    @property
    def cache_only(self) -> int:
        """Blocks only the prefix cache holds, in the layer that holds the most."""
        return max((layer.cache_only for layer in self._layers.values()), default=0)

    def stats(self) -> PoolStats:
        layers = list(self._layers.values())
        used = max((layer.used for layer in layers), default=0)
        shared = max((layer.cached for layer in layers), default=0)
        allocated = max((layer.capacity for layer in layers if layer.keys is not None),
                        default=0)
        return PoolStats(self.block_size, self.num_blocks, used, self.num_blocks - used, shared,
                         allocated)
