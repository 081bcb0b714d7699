"""Paged KV for mlx-lm's continuous batching: `BatchKVCache`'s interface over a block pool.

mlx-lm's `BatchKVCache` holds a batch as one `[B, H, longest, D]` array per layer, every
row left-padded to the longest, and copies all of it when a row joins (`extend`) or leaves
(`filter`). `PagedBatchKVCache` keeps the same bookkeeping of the batch (the same
`left_padding`, `offset` and write index `_idx`, so RoPE positions and mlx-lm's batch
logic are unchanged), but a row's positions live in blocks of the pool
(`replicas.engine.kv.blocks`), listed in its block table. `update_and_fetch` writes the
step into the rows' blocks and returns the view attention reads, gathered by whole blocks,
row i's position p in column p (its own mask, `make_mask`, hides the rest); a decode step
whose rows differ in length attends by groups of like width instead
(`replicas.engine.kv.attention`), and MLX never computes the unused whole view. A join
appends block tables, a leave returns the leaving rows' blocks: no other row's KV moves.

`PagedRowKVCache` (`replicas.engine.kv.rows`) is one sequence's cache that a batch merges
into the paged form (mlx-lm's `_merge_caches` asks row 0's class), as
`quantized.QuantizedRowKVCache` does for the quantized batch; a row by blocks (a prefix
cache hit) joins by sharing its blocks, and `extract` hands a row out the same way, so
neither copies KV. A row never writes a block it shares: a step copies a shared block
before writing into it (`_own`). Only plain attention layers page (`paged_layers` says
which models qualify): a hybrid's sliding-window and recurrent layers keep mlx-lm's batch
forms beside them, and a model with any other cache kind stays on mlx-lm's padded batch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, _BaseCache

from replicas.engine.kv.attention import Step, attend_groups, plan_step
from replicas.engine.kv.blocks import BlockPool, LayerBlocks
# The row class lives beside the other ways a row is held (`replicas.engine.kv.rows`).
from replicas.engine.kv.rows import (  # noqa: F401 - re-exported
    PagedRowKVCache, as_paged_rows, make_paged_prompt_cache, paged_layers)


class PagedBatchKVCache(_BaseCache):
    """One layer's KV for a batch, rows in blocks of `pool`.

    Row i is left-padded by `left_padding[i]` in the batch's columns: column c is its
    position c - left_padding[i] for c in [left_padding[i], _idx) (what RoPE and mlx-lm
    see). Its positions live in the slots its block table names; the block past the last is
    scratch, which the view reads past a row's table and a right-padded prefill's pad
    columns write to."""

    def __init__(self, pool: BlockPool, layer: int, left_padding: Sequence[int]) -> None:
        self.pool, self.layer = pool, layer
        self._blocks: LayerBlocks = pool.layer(layer)
        self._pads = [int(p) for p in left_padding]
        self.tables: list[list[int]] = [[] for _ in self._pads]
        self.offset = mx.array([-p for p in self._pads])
        self._idx = 0
        self._right: list[int] | None = None
        # While a right-padded prefill runs: where each row's real tokens end (its pad
        # columns write to the scratch slot, so they take no blocks).
        self._ends: list[int] | None = None
        self._step: Step | None = None  # the last step's plan (`attend_paged` reads it)

    # ---- the batch's shape ------------------------------------------------------------

    @property
    def left_padding(self) -> mx.array:
        return mx.array(self._pads)

    def lengths(self) -> list[int]:
        return [max(0, self._idx - p) for p in self._pads]

    def _stored(self) -> list[int]:
        """Positions each row holds in its blocks (a right-padded prefill's pad columns
        not among them)."""
        if self._ends is None:
            return self.lengths()
        return [min(n, e) for n, e in zip(self.lengths(), self._ends)]

    def _fit(self, i: int, tokens: int) -> None:
        """Row i's table holds exactly the blocks `tokens` positions need."""
        need, table = self.pool.blocks_for(max(0, tokens)), self.tables[i]
        if need > len(table):
            table += self._blocks.allocate(need - len(table))
        elif need < len(table):
            self._blocks.release(table[need:])
            del table[need:]

    # ---- what the model calls ---------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, H, n, _ = keys.shape
        prev, end = self._idx, self._idx + n
        if self._blocks.multi:
            self._own(prev, end)
        self._grow(end)
        store_k, store_v = self._blocks.storage(keys, values)
        step = self._shared("step", self._key(prev, n), lambda: self._plan(prev, n))
        store_k[step.write] = keys.reshape(B * H * n, keys.shape[3])
        store_v[step.write] = values.reshape(B * H * n, values.shape[3])
        self._idx = end
        self.offset = self.offset + n
        self._step = step
        return self._gather(step.view, step.width)

    def view(self) -> tuple[mx.array, mx.array]:
        """The batch's keys and values as attention reads them, `[B, H, W * block, D]`:
        row i's position p in column p (its blocks in table order, gathered whole), the
        columns past its length padding (the scratch block, or the tail of its last
        block), which `make_mask` hides."""
        step = self._plan(self._idx, 0)
        return self._gather(step.view, step.width)

    def _own(self, prev: int, end: int) -> None:
        """Copy on write: each block a step writing view columns `[prev, end)` writes into
        that another holder shares (a prefix cache entry, a row with the same prefix) is
        copied first, into a block the row alone holds."""
        bs, blocks = self.pool.block_size, self._blocks
        for i, (table, pad) in enumerate(zip(self.tables, self._pads)):
            first, stop = max(0, prev - pad), self._stop(i, end) - pad
            for j in range(first // bs, min(len(table), -(-stop // bs))):
                if blocks.refs(table[j]) > 1:
                    table[j] = blocks.copy_on_write(table[j])

    def _grow(self, end: int) -> None:
        """Each row's table holds the blocks its positions up to view column `end` need."""
        bs, blocks, ends = self.pool.block_size, self._blocks, self._ends
        for i, (table, pad) in enumerate(zip(self.tables, self._pads)):
            want = (end if ends is None else min(end, pad + ends[i])) - pad
            if want > len(table) * bs:
                table += blocks.allocate(-(-want // bs) - len(table))

    def _plan(self, prev: int, n: int) -> Step:
        """Where a step writing view columns `[prev, prev + n)` writes and what its view
        reads; every layer's is alike (their tables grow in step): built once a step."""
        return plan_step(self.tables, self._pads, self._ends, prev, n, self._blocks.capacity,
                         self.pool.block_size, self._blocks.heads)

    def _gather(self, view: mx.array | int, width: int) -> tuple[mx.array, mx.array]:
        keys, values = self._blocks.by_block()
        cols = width * self.pool.block_size
        if isinstance(view, int):  # one row in one run of blocks: a slice, no copy
            H, start = self._blocks.heads, view * self.pool.block_size
            k, v = (a.reshape(H, -1, a.shape[2]) for a in (keys, values))
            return k[None, :, start:start + cols], v[None, :, start:start + cols]
        B, H = view.shape[:2]
        return (keys[view].reshape(B, H, cols, keys.shape[2]),
                values[view].reshape(B, H, cols, values.shape[2]))

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """Which view columns each of the next `N` queries sees, `[B, 1, N, W * block]`
        (made before the layers write the step): row i's query j is its position
        `_idx + j - left_padding[i]`, and sees the columns up to it that it holds."""
        end = self._idx + N
        stored = [max(0, self._stop(i, end) - p) for i, p in enumerate(self._pads)]
        width = max(1, self.pool.blocks_for(max(stored, default=0)))
        if N == 1 and self._ends is None:  # decoding: each row sees all it holds
            cols = mx.arange(width * self.pool.block_size)
            return cols[None, None, None, :] < mx.array(stored)[:, None, None, None]
        cols = mx.arange(width * self.pool.block_size)[None, None, :]
        query = (self._idx + mx.arange(N))[None, :] - mx.array(self._pads)[:, None]
        mask = (cols <= query[:, :, None]) & (cols < mx.array(stored)[:, None, None])
        return mask[:, None]

    def attend_paged(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     mask: Any) -> mx.array:
        """This layer's attention (`replicas.engine.kv.attention`'s hook): a decode step
        whose rows split into groups of like width attends by group, each over its own
        rows' blocks; otherwise over the whole view (`keys`, `values`)."""
        step = self._step
        if step is None or step.groups is None or queries.shape[2] != 1 or \
                step.order is None or step.order.shape[0] != queries.shape[0]:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                        mask=mask)
        store_k, store_v = self._blocks.by_block()
        return attend_groups(queries, store_k, store_v, step.groups, step.order, scale)

    def _stop(self, i: int, end: int) -> int:
        """The view column row i's real positions end at, writing up to `end`."""
        return end if self._ends is None else min(end, self._pads[i] + self._ends[i])

    def _key(self, *at: int) -> tuple[Any, ...]:
        return (*at, self._blocks.heads, self._blocks.slots, self._pads, self._ends,
                self.tables)

    def _shared(self, kind: str, key: tuple[Any, ...], make: Callable[[], Step]) -> Step:
        """A step's plan, which every layer of the batch would build alike: the first
        layer builds it, the others reuse it while the batch's shape is equal by value,
        so a step builds it once, not once a layer."""
        memo = self.pool.memo
        got = memo.get(kind)
        if got is not None and got[0] == key:
            return cast(Step, got[1])
        value = make()
        *at, heads, slots, pads, ends, tables = key
        memo[kind] = ((*at, heads, slots, list(pads), None if ends is None else list(ends),
                       [list(t) for t in tables]), value)
        return value

    # ---- the prefill's padding ----------------------------------------------------------

    def prepare(self, *, left_padding: Sequence[int] | None = None,
                lengths: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:
        if left_padding is not None:
            if self._idx:
                raise ValueError("Left padding can only be added to an empty cache")
            self._pads = [p + int(q) for p, q in zip(self._pads, left_padding)]
            self.offset = self.offset - mx.array(list(left_padding))
        if right_padding is not None and max(right_padding) > 0:
            self._right = [int(r) for r in right_padding]
            if lengths is not None:
                self._ends = [n + int(m) for n, m in zip(self.lengths(), lengths)]

    def finalize(self) -> None:
        """A right-padded prefill's pad columns become left padding (what `BatchKVCache`
        rolls round): the row's length shrinks, its spare blocks go back."""
        if self._right is None:
            return
        right, self._right, self._ends = self._right, None, None
        self._pads = [p + r for p, r in zip(self._pads, right)]
        self.offset = self.offset - mx.array(right)
        for i, length in enumerate(self.lengths()):
            self._fit(i, length)

    # ---- joins, leaves, speculation's rollback ------------------------------------------

    def filter(self, batch_indices: Sequence[int]) -> None:
        keep = [int(i) for i in batch_indices]
        kept = set(keep)
        for i, table in enumerate(self.tables):
            if i not in kept:
                self._blocks.release(table)
        seen: set[int] = set()
        for i in keep:  # a row kept twice holds its blocks twice
            if i in seen:
                self._blocks.share(self.tables[i])
            seen.add(i)
        self.tables = [list(self.tables[i]) for i in keep]
        self._pads = [self._pads[i] for i in keep]
        self.offset = self.offset[mx.array(keep)] if keep else mx.array([], dtype=mx.int32)
        shift = min(self._pads, default=0)
        if shift > 0:  # columns every row pads: gone from the view
            self._pads = [p - shift for p in self._pads]
            self._idx -= shift

    def extend(self, other: Any) -> None:
        """Append `other`'s rows: their block tables join, no KV moves (another kind of
        batch cache is copied into blocks first)."""
        if not isinstance(other, PagedBatchKVCache) or other.pool is not self.pool \
                or other.layer != self.layer:
            other = self._adopt(other)
        top = max(self._idx, other._idx)
        self._pads = [p + top - self._idx for p in self._pads] + \
            [p + top - other._idx for p in other._pads]
        self.tables += other.tables
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = top
        other.tables, other._pads = [], []  # its blocks are this batch's now
        other.offset = mx.array([], dtype=mx.int32)

    def _adopt(self, other: Any) -> PagedBatchKVCache:
        rows = int(other.offset.shape[0]) if isinstance(other.offset, mx.array) else 1
        if isinstance(other, BatchKVCache) and other.keys is None:
            pads = cast(list[int], other.left_padding.tolist())
            return PagedBatchKVCache(self.pool, self.layer, pads)
        return PagedBatchKVCache.merge([other.extract(i) for i in range(rows)],
                                       self.pool, self.layer)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        for i, length in enumerate(self.lengths()):
            self._fit(i, length)
        return n

    # ---- rows in and out ----------------------------------------------------------------

    def extract(self, idx: int) -> PagedRowKVCache:
        """Row `idx` as a one-sequence cache by its blocks (no copy: the prefix cache keeps
        it, a ref each; the batch's later writes copy a block it shares first)."""
        length = self.lengths()[idx]
        if self._ends is not None:
            length = self._stored()[idx]
        return PagedRowKVCache.shared(self.pool, self.layer, self.tables[idx], length)

    @classmethod
    def merge(cls, caches: Sequence[Any], pool: BlockPool | None = None,  # type: ignore[override]
              layer: int | None = None) -> PagedBatchKVCache:
        """One batch from per-row caches: a row by blocks (a prefix hit) shares them, a
        `KVCache`'s arrays are copied into blocks of its own."""
        if pool is None or layer is None:
            first = caches[0]
            pool, layer = first.pool, first.layer
        assert pool is not None and layer is not None
        held = [getattr(c, "blocks", None) if getattr(c, "pool", None) is pool
                and getattr(c, "layer", None) == layer else None for c in caches]
        lengths = [int(c.offset) if c.keys is not None or b is not None else 0
                   for c, b in zip(caches, held)]
        longest = max(lengths, default=0)
        out = cls(pool, layer, [longest - n for n in lengths])
        out._idx = longest
        out.offset = mx.array(lengths)
        for i, (n, c, blocks) in enumerate(zip(lengths, caches, held)):
            if n == 0:
                continue
            if blocks is not None:  # the row's own refs: the hit keeps its own
                out.tables[i] = list(blocks[:pool.blocks_for(n)])
                out._blocks.share(out.tables[i])
                continue
            out._fit(i, n)
            out._blocks.write(out.tables[i], c.keys[..., :n, :], c.values[..., :n, :])
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedBatchKVCache:
        """mlx-lm's `split` copies a prefilling batch and filters both: the copy holds the
        same blocks once more (each filter returns what its side drops)."""
        out = PagedBatchKVCache(self.pool, self.layer, self._pads)
        out.tables = [list(t) for t in self.tables]
        for t in out.tables:
            self._blocks.share(t)
        out.offset, out._idx = self.offset, self._idx
        out._right = None if self._right is None else list(self._right)
        out._ends = None if self._ends is None else list(self._ends)
        return out

    def release(self) -> None:
        """Return every row's blocks (the batch is dropped)."""
        tables, self.tables = self.tables, []
        for t in tables:
            self._blocks.release(t)

    def __del__(self) -> None:
        # mlx-lm drops a batch's caches without a word when its last row leaves
        # (`prompt_cache.clear()`): their blocks go back here.
        try:
            self.release()
        except Exception:  # noqa: BLE001 - nothing may raise out of a finalizer
            pass

    # ---- what the engine reads ----------------------------------------------------------

    @property  # type: ignore[misc]  # read-only: a paged batch is not stored whole
    def state(self) -> tuple[Any, ...]:
        # What `mx.eval([c.state ...])` must compute: the pool's arrays, the offsets.
        arrays = [a for a in (self._blocks.keys, self._blocks.values) if a is not None]
        return (*arrays, self.offset)

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self._idx == 0

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks the rows hold."""
        if self._blocks.keys is None or self._blocks.values is None:
            return 0
        per_slot = (self._blocks.keys.nbytes + self._blocks.values.nbytes) // \
            self._blocks.slots
        return sum(len(t) for t in self.tables) * self.pool.block_size * per_slot


PagedRowKVCache.batch_type = PagedBatchKVCache
