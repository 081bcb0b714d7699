"""The block pool holds what its rows use (`replicas.engine.kv.blocks`): a layer's arrays start
small, grow (doubling) as rows need blocks, never past the budget's block count, keep every
block's KV and id through a growth, give trailing free capacity back; greedy text with
growths mid-generation is mlx-lm's; and an idle paged replica with no budget set holds far
less than its budget (MLX's own memory, `mx.get_active_memory`)."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from replicas.contract import GenerationRequest, SamplingParams, TokenPrompt
from replicas.engine.config import EngineConfig
from replicas.engine.kv import blocks as blocks_module
from replicas.engine.kv.blocks import MIN_BLOCKS, BlockPool, LayerBlocks, PoolExhausted
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.test_paged_kv import _greedy_text_is_mlx_lms
from tests.streams import collect

H, D, BS = 2, 8, 4


def _kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    return (mx.random.normal((1, H, n, D), key=mx.random.key(seed)),
            mx.random.normal((1, H, n, D), key=mx.random.key(seed + 1)))


def test_the_pool_starts_small_grows_under_demand_and_never_past_the_budget() -> None:
    pool = BlockPool(100, block_size=BS)
    layer = pool.layer(0)
    first = layer.allocate(2)
    k, v = _kv(2 * BS, 0)
    layer.write(first, k, v)
    assert layer.capacity == MIN_BLOCKS and first == [0, 1]
    assert layer.nbytes == 2 * H * (MIN_BLOCKS + 1) * BS * D * 4  # K and V, float32
    assert pool.stats() == blocks_module.PoolStats(BS, 100, 2, 98, 0, MIN_BLOCKS)
    more = layer.allocate(MIN_BLOCKS)  # past the capacity: it doubles
    assert layer.capacity == 2 * MIN_BLOCKS and more == list(range(2, MIN_BLOCKS + 2))
    got = layer.read(first, 2 * BS)  # the grown arrays kept block 0 and 1's KV, same ids
    assert np.array_equal(np.array(got[0]), np.array(k))
    assert np.array_equal(np.array(got[1]), np.array(v))
    rest = layer.allocate(100 - layer.used)  # all the budget's blocks: capped, not 128
    assert layer.capacity == 100 and layer.free == 0
    assert layer.nbytes == 2 * H * 101 * BS * D * 4
    with pytest.raises(PoolExhausted):
        layer.allocate(1)
    assert pool.stats().allocated == 100 == pool.stats().total
    layer.release(more + rest)


def test_trailing_free_capacity_goes_back_and_held_blocks_keep_their_kv() -> None:
    pool = BlockPool(1000, block_size=BS)
    layer = pool.layer(0)
    held = layer.allocate(3)
    k, v = _kv(3 * BS, 7)
    layer.write(held, k, v)
    burst = layer.allocate(200)
    assert layer.capacity == 256
    layer.release(burst)
    assert layer.capacity == 256  # given back at the next write, not in a finalizer
    layer.write(held[:1], *_kv(BS, 9))  # a write: the capacity halves while a quarter is used
    assert layer.capacity == MIN_BLOCKS
    assert layer.nbytes == 2 * H * (MIN_BLOCKS + 1) * BS * D * 4
    got = layer.read(held, 3 * BS)
    assert np.array_equal(np.array(got[0][:, :, BS:]), np.array(k[:, :, BS:]))
    assert layer.allocate(1) == [3]  # the lowest free id: held blocks stay packed


def test_greedy_text_with_growths_mid_generation_is_mlx_lms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows joining and leaving with the pool starting at one block a layer: it grows
    (and shrinks) while rows decode, and the text is still mlx-lm's token for token."""
    monkeypatch.setattr(blocks_module, "MIN_BLOCKS", 1)
    sizes: list[int] = []
    real = LayerBlocks._resize

    def resize(self: LayerBlocks, capacity: int) -> None:
        if self.keys is not None:
            sizes.append(capacity)
        real(self, capacity)

    monkeypatch.setattr(LayerBlocks, "_resize", resize)
    _greedy_text_is_mlx_lms("builtin:tiny")
    assert len(sizes) >= 4 and max(sizes) >= 8, sizes  # arrays regrown while rows held KV


def test_an_idle_paged_replica_with_no_budget_holds_what_it_used() -> None:
    """No `kv_budget_bytes`: the budget is most of the machine (and the pool's cap is its
    blocks, about 1 GiB here for builtin:tiny); after a request the replica holds a few
    blocks' arrays, not the pool's cap."""
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny", engine=EngineConfig(
        paged_kv="on", prompt_cache_bytes=0)))
    rep.start()
    try:
        gc.collect()
        base = mx.get_active_memory()  # the weights loaded, no KV yet
        request = GenerationRequest(request_id="r", model="tiny",
                                    prompt=TokenPrompt(tuple(range(3, 60))),
                                    sampling=SamplingParams(temperature=0.0, max_tokens=8))
        events: list[Any] = asyncio.run(collect(rep.stream(request)))
        assert events
        stats = rep.stats().memory
        deadline = time.monotonic() + 60  # the engine thread frees the row after its last event
        while stats is not None and stats.blocks is not None and stats.blocks.used \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = rep.stats().memory
        assert stats is not None and stats.blocks is not None
        cap = stats.blocks.total * stats.blocks.block_size * stats.layout.per_token
        # What the first round added: the pool's arrays (the whole cap before they grew
        # with use), with room left for whatever else this test process allocates.
        held = mx.get_active_memory() - base
        assert stats.blocks.used == 0 and 0 < stats.blocks.allocated <= 2 * MIN_BLOCKS
        assert cap > 512 * 1024**2 and held < cap // 4, (held, cap)
    finally:
        rep.shutdown()
