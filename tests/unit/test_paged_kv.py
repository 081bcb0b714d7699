"""The block pool and the paged batch cache (`replicas.engine.kv.blocks`, `.paged`), against
mlx-lm's own `BatchKVCache` on random arrays: every operation the batch calls leaves the
two with the same view on the positions the mask lets attention see."""

from __future__ import annotations

import copy
from typing import cast

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from replicas.engine.kv import attention
from replicas.engine.kv.attention import plan_groups
from replicas.engine.kv.blocks import BlockPool, PoolExhausted
from replicas.engine.kv.paged import PagedBatchKVCache, PagedRowKVCache
from replicas.engine.kv.prefix_cache import PromptCache
from replicas.engine.kv.rows import plain

H, D = 2, 8


def test_pool_allocates_shares_and_frees() -> None:
    pool = BlockPool(4, block_size=16)
    layer = pool.layer(0)
    a = layer.allocate(3)
    assert a == [0, 1, 2] and layer.free == 1
    with pytest.raises(PoolExhausted):
        layer.allocate(2)
    layer.share(a[:1])
    assert layer.refs(0) == 2 and layer.multi == 1 and pool.stats().shared == 0
    layer.hold(a[:1])  # its second ref is the prefix cache's: "shared" counts it
    assert pool.stats().shared == 1 and layer.cache_only == 0
    layer.release(a)
    assert layer.free == 3 and layer.refs(0) == 1  # block 0 still held by its second owner
    assert layer.cache_only == 1 and layer.multi == 0
    with pytest.raises(AssertionError):
        layer.release([0])  # the prefix cache's ref goes back by `unhold` first
    layer.unhold([0])
    layer.release([0])
    assert layer.free == 4 and pool.stats().used == 0 and pool.stats().shared == 0
    assert layer.cached == layer.cache_only == 0
    with pytest.raises(AssertionError):
        layer.release([0])


def test_pool_sized_from_bytes() -> None:
    pool = BlockPool.sized(10 * 1024, bytes_per_token=64, block_size=16)
    assert pool.num_blocks == 10
    assert BlockPool.sized(10 * 1024, 64, 16, most_tokens=40).num_blocks == 3


def _row(n: int, seed: int) -> KVCache:
    c = KVCache()
    if n:
        k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
        v = mx.random.normal((1, H, n, D), key=mx.random.key(seed + 1000))
        c.update_and_fetch(k, v)
    return c


def _pair(lengths: list[int], pool: BlockPool, seed: int = 0
          ) -> tuple[BatchKVCache, PagedBatchKVCache]:
    rows = [_row(n, seed + i) for i, n in enumerate(lengths)]
    return BatchKVCache.merge(rows), PagedRowKVCache(pool, 0).merge(rows)


def _same(ref: BatchKVCache, paged: PagedBatchKVCache, got: tuple[mx.array, mx.array] | None
          = None, want: tuple[mx.array, mx.array] | None = None,
          ends: list[int] | None = None) -> None:
    """Same shape of batch, and the same KV at every position a row holds (`ends`: where
    each row's real columns end, in a right-padded prefill). The padded batch holds row i's
    position p in column p + left_padding[i]; the paged view in column p."""
    assert paged._idx == ref._idx
    assert paged.left_padding.tolist() == ref.left_padding.tolist()
    assert paged.offset.tolist() == ref.offset.tolist()
    if got is None or want is None:
        if ref.keys is None:
            return
        want = ref.keys[..., :ref._idx, :], ref.values[..., :ref._idx, :]
        got = paged.view()
    pads = cast(list[int], ref.left_padding.tolist())
    for g, w in zip(got, want):
        assert g.shape[:2] == w.shape[:2] and g.shape[3] == w.shape[3]
        assert g.shape[2] % paged.pool.block_size == 0
        for i, p in enumerate(pads):
            e = w.shape[2] if ends is None else ends[i]
            assert g.shape[2] >= e - p
            assert np.array_equal(np.array(g[i, :, :e - p]), np.array(w[i, :, p:e]))


def _seen(mask: mx.array, pads: list[int], N: int) -> list[list[set[int]]]:
    """Per row and query, the positions a mask lets it see (column c of row i is position
    c - pads[i])."""
    m = np.broadcast_to(np.array(mask), (len(pads), 1, N, mask.shape[-1]))
    return [[{int(c) - p for c in np.nonzero(m[i, 0, j])[0]} for j in range(N)]
            for i, p in enumerate(pads)]


def _step(ref: BatchKVCache, paged: PagedBatchKVCache, n: int, seed: int,
          ends: list[int] | None = None) -> None:
    B = ref.offset.shape[0]
    k = mx.random.normal((B, H, n, D), key=mx.random.key(seed))
    v = mx.random.normal((B, H, n, D), key=mx.random.key(seed + 1))
    pads = cast(list[int], ref.left_padding.tolist())
    want = _seen(ref.make_mask(n), pads, n)
    got = _seen(paged.make_mask(n), [0] * B, n)
    for i in range(B):  # real queries see what the padded batch lets them (pad queries: garbage)
        for j in range(n):
            if ends is None or pads[i] <= ref._idx + j < ends[i]:
                assert got[i][j] == {p for p in want[i][j] if ends is None or p + pads[i] < ends[i]}
    _same(ref, paged, paged.update_and_fetch(k, v), ref.update_and_fetch(k, v), ends)
    if ends is None:
        _same(ref, paged)


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(64, block_size=4)


def test_update_and_fetch_matches(pool: BlockPool) -> None:
    ref, paged = _pair([5, 0, 11], pool)
    _same(ref, paged)
    for s in range(6):
        _step(ref, paged, 1 if s % 2 else 3, 10 + s)
    lengths = paged.lengths()
    assert [len(t) for t in paged.tables] == [pool.blocks_for(n) for n in lengths]
    assert pool.stats().used == sum(pool.blocks_for(n) for n in lengths)


def test_right_padded_prefill_matches(pool: BlockPool) -> None:
    ref, paged = _pair([0, 0, 0], pool)
    for c in (ref, paged):
        c.prepare(lengths=[7, 3, 5], right_padding=[0, 4, 2])
    _step(ref, paged, 7, 1, ends=[7, 3, 5])
    assert pool.stats().used == 5  # the pad columns took no blocks
    ref.finalize()
    paged.finalize()
    _same(ref, paged)
    assert [len(t) for t in paged.tables] == [2, 1, 2]
    _step(ref, paged, 1, 2)


def test_filter_extend_extract_trim_match(pool: BlockPool) -> None:
    ref, paged = _pair([9, 2, 6], pool)
    _step(ref, paged, 1, 1)
    held = pool.stats().used
    ref.filter([1, 2])
    paged.filter([1, 2])
    _same(ref, paged)
    assert pool.stats().used == held - pool.blocks_for(10)  # the long row's blocks came back

    ref2, paged2 = _pair([13, 4], pool, seed=50)
    before = paged.tables[0][:]
    ref.extend(ref2)
    paged.extend(paged2)
    _same(ref, paged)
    assert paged.tables[0] == before and paged2.tables == []  # nothing moved
    _step(ref, paged, 1, 3)

    used = pool.stats().used
    extracted = []
    for i in range(4):
        r, p = ref.extract(i), paged.extract(i)
        assert r.offset == p.offset and p.blocks is not None  # by its blocks: no copy
        extracted.append(p)
        [got] = plain([p])
        assert np.array_equal(np.array(r.keys), np.array(got.keys))
        assert np.array_equal(np.array(r.values), np.array(got.values))
    assert pool.stats().used == used

    assert ref.trim(2) == paged.trim(2)
    _same(ref, paged)
    _step(ref, paged, 1, 4)


def test_extend_adopts_a_padded_batch(pool: BlockPool) -> None:
    ref, paged = _pair([3, 8], pool)
    other_ref = BatchKVCache.merge([_row(5, 70)])
    other = BatchKVCache.merge([_row(5, 70)])
    ref.extend(other_ref)
    paged.extend(other)
    _same(ref, paged)


def test_blocks_come_back(pool: BlockPool) -> None:
    _, paged = _pair([9, 20], pool)
    assert pool.stats().used == pool.blocks_for(9) + pool.blocks_for(20)
    twin = copy.deepcopy(paged)  # mlx-lm's `split`
    paged.filter([0])
    twin.filter([1])
    assert pool.stats().used == pool.blocks_for(9) + pool.blocks_for(20)
    del paged
    assert pool.stats().used == pool.blocks_for(20)
    twin.filter([])
    assert pool.stats().used == 0


def test_exhaustion_raises() -> None:
    pool = BlockPool(3, block_size=4)
    _, paged = _pair([8], pool)
    with pytest.raises(PoolExhausted):
        paged.update_and_fetch(mx.zeros((1, H, 5, D)), mx.zeros((1, H, 5, D)))


def test_a_step_writes_in_place() -> None:
    """A decode step scatters into the pool's arrays where they lie (MLX donates them):
    its peak is the step's view, not another copy of the pool."""
    pool = BlockPool(2048, block_size=32)
    held = pool.layer(0).allocate(1024)  # a pool grown large: a copy of it would show
    _, paged = _pair([100, 200], pool)
    mx.eval(paged.state)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for s in range(4):
        k, v = paged.update_and_fetch(mx.ones((2, H, 1, D)), mx.ones((2, H, 1, D)))
        mx.eval(k, v)
        del k, v
    assert mx.get_peak_memory() - base < pool.nbytes // 10, (mx.get_peak_memory() - base,
                                                             pool.nbytes)
    assert len(held) == 1024 and pool.stats().allocated == 2048


def test_groups_split_rows_by_width() -> None:
    assert plan_groups([17] * 32) == [list(range(32))]  # uniform: one group, the whole view
    long_and_short = [137] + [9] * 15
    assert plan_groups(long_and_short) == [[0], list(range(1, 16))]
    assert plan_groups([3, 1, 2, 1], cost=0) == [[0], [2], [1, 3]]  # like widths together
    assert plan_groups([3, 2, 3, 2], cost=1000) == [[0, 2, 1, 3]]  # a group costs too much


def test_grouped_attention_is_the_whole_views(pool: BlockPool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step whose rows split by length attends by group, each over its own
    blocks: the same output as attention over the whole view and its mask."""
    monkeypatch.setattr(attention, "GROUP_COST", 0)
    _, paged = _pair([70, 5, 33, 70, 9, 1], pool)
    for s in range(3):
        B, Hq = 6, 4  # two queries a KV head (GQA)
        q = mx.random.normal((B, Hq, 1, D), key=mx.random.key(100 + s))
        k = mx.random.normal((B, H, 1, D), key=mx.random.key(200 + s))
        mask = paged.make_mask(1)
        keys, values = paged.update_and_fetch(k, k * 2)
        step = paged._step
        assert step is not None and step.groups is not None and len(step.groups) == 5
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3, mask=mask)
        got = paged.attend_paged(q, keys, values, 0.3, mask)
        assert np.allclose(np.array(got), np.array(want), atol=1e-6)


def test_one_row_in_one_run_is_sliced() -> None:
    """A row alone whose blocks are one run reads its view as a slice of the pool (no
    gather); once its blocks are not a run, by gather; the same KV either way."""
    pool = BlockPool(64, block_size=4)
    ref, paged = _pair([10], pool)
    _step(ref, paged, 1, 1)
    assert isinstance(paged._step.view, int)  # type: ignore[union-attr]
    _, other = _pair([3], pool, seed=9)  # takes the next block: the row's next is elsewhere
    for s in range(3):
        _step(ref, paged, 1, 2 + s)
    assert not isinstance(paged._step.view, int)  # type: ignore[union-attr]
    del other


def test_rows_sharing_a_partial_block_copy_it_on_write(pool: BlockPool) -> None:
    """Two rows join by one entry's blocks (6 positions: the second block partial, as a
    prefix hit) and write different KV: each copies the shared block first, both match
    mlx-lm's batch of two copies, and the entry still holds what it held."""
    source = _row(6, 3)
    _, batch = _pair([6], pool, seed=3)
    entry = batch.extract(0)  # by blocks: the prefix cache's entry
    batch.filter([])
    assert entry.blocks is not None and pool.stats().used == 2
    before = plain([entry])[0]
    hits = [copy.deepcopy(entry), copy.deepcopy(entry)]
    paged = PagedRowKVCache(pool, 0).merge(hits)
    assert paged.tables == [entry.blocks, entry.blocks] and pool.stats().used == 2
    ref = BatchKVCache.merge([source, copy.deepcopy(source)])
    for s in range(3):
        _step(ref, paged, 1 if s else 3, 70 + s)
    assert paged.tables[0][0] == paged.tables[1][0] == entry.blocks[0]  # full: still shared
    assert len({paged.tables[0][1], paged.tables[1][1], entry.blocks[1]}) == 3  # copied
    after = plain([entry])[0]
    assert np.array_equal(np.array(before.keys), np.array(after.keys))
    assert np.array_equal(np.array(before.values), np.array(after.values))
    del hits
    paged.release()
    entry.release()
    assert pool.stats().used == 0 and pool.layer(0).multi == 0


def test_the_prefix_cache_counts_a_shared_prefix_once() -> None:
    """Entries by blocks: two rows that hit one 8-token entry and went on are kept as two
    entries holding its two blocks once (the cache's bytes are its distinct blocks); a
    layer short of blocks makes the cache evict; eviction frees every block."""
    pool = BlockPool(16, block_size=4)
    cache = PromptCache(1 << 20)
    cache.attach(pool)
    _, first = _pair([8], pool)
    cache.save(list(range(8)), [first.extract(0)])
    first.release()
    per_block = pool.block_bytes
    assert cache.nbytes == 2 * per_block and pool.stats().shared == 2
    hits = [cache.fetch(list(range(8)) + [100 + i]) for i in range(2)]
    assert all(h is not None and h.length == 8 for h in hits)
    paged = PagedRowKVCache(pool, 0).merge([h.cache[0] for h in hits if h is not None])
    paged.update_and_fetch(mx.random.normal((2, H, 3, D)), mx.random.normal((2, H, 3, D)))
    assert cache.nbytes == 0  # rows hold every block the cache holds: theirs to count
    for i in range(2):
        cache.save(list(range(8)) + [i] * 3, [paged.extract(i)])
    del hits
    paged.release()
    assert cache.stats().entries == 2 and pool.stats().shared == 4
    assert cache.nbytes == 4 * per_block  # not 6: the shared prefix counts once
    taken = pool.layer(0).allocate(13)  # 12 free: the oldest entry gives its own block back
    assert cache.stats().entries == 1 and cache.stats().evictions == 1
    pool.layer(0).release(taken)
    cache.evict_to(0)
    assert pool.stats().used == 0 and pool.stats().shared == 0 and cache.nbytes == 0
