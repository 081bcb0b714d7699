"""The block pool holds what its rows use (`replicas.engine.kv.blocks`): a layer's arrays start
small, grow (doubling) as rows need blocks, never past the budget's block count, keep every
block's KV and id through a growth, give trailing free capacity back (at the next write, or
when the batch empties); a growth's transient stays within the budget's share for the pool
(`kv/pool_plan.py`, by MLX's peak memory); greedy text with growths mid-generation is
mlx-lm's; and an idle paged replica with no budget set holds far less than its budget (MLX's
own memory, `mx.get_active_memory`)."""

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
from replicas.engine.batch.rows import Done, Row
from replicas.engine.kv.blocks import (BLOCK_SIZE, MIN_BLOCKS, BlockPool, LayerBlocks,
                                       PoolExhausted)
from replicas.engine.kv import pool_plan
from replicas.engine.kv.pool_plan import GATHER_SHARE, paging_plan
from replicas.engine.sampling.samplers import make_request_sampler
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.test_paged_kv import GREEDY, _greedy_text_is_mlx_lms, model, paged_batch
from tests.streams import collect

H, D, BS = 2, 8, 4
MIB = 1024**2


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


@pytest.mark.parametrize("layers", [1, 2, 6, 7, 48])
@pytest.mark.parametrize("budget", [64 * MIB, 1024 * MIB, 16 * 1024 * MIB])
def test_the_plan_keeps_a_growths_transient_within_the_reserve(layers: int, budget: int) -> None:
    """The pool's arrays (its blocks, a scratch block a layer) fit the budget less the
    gather share, and with one layer's old arrays mid-growth beside them still fit it plus
    the reserve (the view's, which a growth has to itself), for any number of layers."""
    plan = paging_plan(budget, layers * 4096, layers, budget // 4, BLOCK_SIZE, 1 << 40)
    pool = plan.blocks + plan.cache_bytes // plan.block_bytes
    arrays = (pool + 1) * plan.block_bytes
    room = budget - budget // GATHER_SHARE  # the pool's, beside the reserve
    assert plan.growth_bytes >= pool * plan.block_bytes // layers
    assert arrays <= room and arrays + plan.growth_bytes <= room + plan.gather_bytes
    assert pool * plan.block_bytes > room * layers // (layers + 1) - 2 * plan.block_bytes


@pytest.mark.parametrize("layers", [2, 3])
def test_a_growth_stays_within_the_budget_by_mlxs_peak(
        layers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few layers, so one layer's old arrays beside the new ones mid-growth are a large
    share of the pool (half of it for two), and no gather floor (the reserve is the
    budget's eighth, as for a budget of a few GiB): a pool of `paging_plan`'s blocks, grown
    by doubling to all of them (the last growth from 256 blocks a layer) the way a batch's
    steps grow it (every layer in turn, each step evaluated), holds its arrays within the
    budget less the reserve and never more than the budget by MLX's peak memory: the
    transient fits the reserve, which a growth has to itself (it waits for the step before,
    and so for its gathered view, to end)."""
    monkeypatch.setattr(pool_plan, "GATHER_FLOOR", 0)
    heads, dim = 4, 64
    per_token = layers * 2 * heads * dim * 4  # K and V, float32
    budget = 64 * MIB if layers == 2 else 80 * MIB
    plan = paging_plan(budget, per_token, layers, 0, BLOCK_SIZE, 1 << 30)
    assert plan.gather_bytes == budget // GATHER_SHARE
    assert (plan.blocks + 1) * plan.block_bytes + plan.growth_bytes <= budget
    assert 256 < plan.blocks < 512, plan.blocks  # the last growth copies 256 blocks a layer
    pool = BlockPool(plan.blocks)
    token = [mx.ones((1, heads, 1, dim)) for _ in range(2)]
    mx.eval(token)
    gc.collect()
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    while pool.layer(0).used < plan.blocks:
        for i in range(layers):  # a step: each layer takes its blocks and writes in turn
            layer = pool.layer(i)
            table = layer.allocate(min(8, plan.blocks - layer.used))
            layer.write(table[-1:], *token)
            assert layer.keys is not None and layer.values is not None
            mx.eval(layer.keys, layer.values)
    mx.synchronize()
    peak = mx.get_peak_memory() - base
    assert pool.layer(0).capacity == plan.blocks == pool.stats().allocated
    # The transient was there to measure (the arrays alone are less), and within the budget.
    assert pool.nbytes <= budget - plan.gather_bytes
    assert pool.nbytes < peak <= budget, (pool.nbytes, peak, budget)


def test_the_pool_gives_its_capacity_back_when_the_batch_empties() -> None:
    """Rows that grew the pool to 128 blocks a layer end together: when the engine takes
    the last of them out of the batch (`finish`), the pool's trailing capacity goes back at
    once, by MLX's own active memory, not at a next write that an idle replica never sees."""
    batch, kv = paged_batch(model("builtin:tiny"), 64 * MIB)
    assert kv.blocks is not None
    rows = [Row(tuple((7 * i + 3 * j) % 400 + 3 for j in range(700)), 0, 3, frozenset(),
                make_request_sampler(GREEDY)) for i in range(4)]
    batch.insert(rows)
    ended: list[int] = []
    for _ in range(100):
        # Held across `finish`, as the engine's step holds them: they must not pin the KV.
        responses = batch.step()
        ended += [r.uid for r in responses if r.finish_reason is not None]
        if len(ended) == len(rows):
            break
    grown = kv.blocks()
    assert len(ended) == len(rows) and grown.allocated >= 4 * MIN_BLOCKS, grown
    gc.collect()
    mx.synchronize()
    before = mx.get_active_memory()
    batch.finish([Done(uid, keep=True) for uid in ended])
    gc.collect()
    mx.synchronize()
    after = mx.get_active_memory()
    idle = kv.blocks()
    assert responses and batch.empty and idle.used == 0 and idle.allocated == MIN_BLOCKS, idle
    per_block = 1024 * BLOCK_SIZE  # builtin:tiny: 1 KiB of KV a token, both layers
    freed = (grown.allocated - MIN_BLOCKS) * per_block
    assert before - after >= freed * 3 // 4, (before, after, freed)


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
