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
arrays are allocated once, at its first write (only then are its heads and dtype known).

Every layer has its own free list: mlx-lm calls each layer's cache on its own, and all
layers of a batch grow alike, so their tables stay in step without a shared row object.
Refcounts let a block be held by more than one owner (a batch and its `split` copy today,
the prefix cache later); a block returns to its free list when its count reaches zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

# Tokens per block: 32 measured no slower than 16 on the CPU here and halves the tables
# (load/results/paged_kv.md); a row wastes under one block per layer.
BLOCK_SIZE = 32


class PoolExhausted(RuntimeError):
    """No free block left: admission let more KV in than the pool holds."""


@dataclass(frozen=True)
class PoolStats:
    block_size: int
    total: int  # blocks per layer
    used: int  # blocks held (in the layer that holds the most)
    free: int
    shared: int  # blocks held by more than one owner (0 until the prefix cache shares)


class LayerBlocks:
    """One layer's blocks: its storage, its free list and each block's refcount."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Lowest ids first: a fresh pool hands out 0, 1, 2, ... (tests read tables easily).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.heads = 0
        self.slots = (num_blocks + 1) * block_size  # and one scratch block, last

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def shared(self) -> int:
        return sum(1 for r in self._refs if r > 1)

    def allocate(self, n: int) -> list[int]:
        """`n` free blocks, lowest first from a fresh pool (a row growing alone takes one
        run of blocks, which its view slices without a gather)."""
        if n > len(self._free):
            raise PoolExhausted(f"the KV block pool has {len(self._free)} free blocks of "
                                f"{self.num_blocks}, {n} asked for")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} is free"
            self._refs[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} released twice"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def storage(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The layer's arrays, allocated at the first write, shaped as `keys`/`values`
        (`[B, H, n, D]`) say."""
        if self.keys is None or self.values is None:
            self.heads = keys.shape[1]
            rows = self.heads * self.slots
            self.keys = mx.zeros((rows, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((rows, values.shape[3]), values.dtype)
            mx.eval(self.keys, self.values)
        return self.keys, self.values

    def by_block(self) -> tuple[mx.array, mx.array]:
        """The layer's arrays as `[H * (blocks + 1), block_size, D]` (a free reshape)."""
        assert self.keys is not None and self.values is not None
        rows = self.heads * (self.num_blocks + 1)
        return (self.keys.reshape(rows, self.block_size, self.keys.shape[1]),
                self.values.reshape(rows, self.block_size, self.values.shape[1]))

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class BlockPool:
    """A replica's blocks: `num_blocks` per paged layer, `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs blocks: {num_blocks} of {block_size} tokens")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._layers: dict[int, LayerBlocks] = {}
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
            self._layers[index] = LayerBlocks(self.num_blocks, self.block_size)
        return self._layers[index]

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers.values())

    def stats(self) -> PoolStats:
        layers = list(self._layers.values())
        used = max((layer.used for layer in layers), default=0)
        shared = max((layer.shared for layer in layers), default=0)
        return PoolStats(self.block_size, self.num_blocks, used, self.num_blocks - used, shared)
