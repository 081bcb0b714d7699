"""Rejected tails out of a batch cache (`replicas.engine.spec.tails`), on the built-in model's
float cache and its 8-bit quantized one: over several verifying passes with ragged
rejections (rows moving their oldest slots into their tails again and again), each row's
next logits are what a cache that never saw the rejected tokens gives, and the row taken
out of the batch, slots put back in order, holds that cache's KV position for position.
The slots really moved (a copy of the row's whole cache would not), and a row whose tail
is longer than what it holds moves everything it holds."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from replicas.engine.model.loading import load_model
from replicas.engine.kv.quantized import QuantizedRowKVCache, make_quantized_prompt_cache
from replicas.engine.spec.tails import drop_tails, in_order, rotated
from replicas.sources import resolve_source


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return load_model("builtin:tiny", resolve_source("builtin:tiny")).model


def _fresh(model: nn.Module, bits: int | None) -> list[Any]:
    return make_quantized_prompt_cache(model, bits, 32) if bits else make_prompt_cache(model)


def _alone(model: nn.Module, tokens: list[int], bits: int | None) -> list[Any]:
    cache = _fresh(model, bits)
    model(mx.array([tokens]), cache=cache)
    return cache


def _kv(layer: Any, bits: int | None) -> list[mx.array]:
    """A row's keys and values as floats, positions in order."""
    out = []
    for x in (layer.keys, layer.values):
        if bits:
            x = mx.dequantize(*x, group_size=32, bits=bits)
        out.append(x[..., :layer.offset, :])
    return out


@pytest.mark.parametrize("bits", [None, 8])
def test_ragged_passes_keep_each_row_as_alone(model: nn.Module, bits: int | None) -> None:
    rng = random.Random(3)
    seqs = [[rng.randrange(3, 300) for _ in range(n)] for n in (12, 2, 20)]
    rows = [_alone(model, s, bits) for s in seqs]
    merge = QuantizedRowKVCache.merge if bits else BatchKVCache.merge
    batch = [merge([r[i] for r in rows]) for i in range(len(model.layers))]
    orders: list[Any] = [None] * len(seqs)
    moved_any = False
    for step in range(6):
        width = 5
        feed = [[rng.randrange(3, 300) for _ in range(width)] for _ in seqs]
        model(mx.array(feed), cache=batch)
        kept = [rng.randrange(1, width + 1) for _ in seqs]  # the pending token and drafts
        if step == 0:
            kept = [5, 1, 3]  # the short row (3 tokens now) drops 4: more than it holds
        seqs = [s + f[:k] for s, f, k in zip(seqs, feed, kept)]
        moved = drop_tails(batch, [width - k for k in kept])
        orders = [rotated(o, len(s), m) for o, s, m in zip(orders, seqs, moved)]
        moved_any |= any(moved)
        if step == 0:
            assert moved == [0, 3, 2]  # the short row moved all 3 it held, the other 2
        assert batch[0].offset.tolist() == [len(s) for s in seqs]
        probe = [[rng.randrange(3, 300)] for _ in seqs]
        logits = model(mx.array(probe), cache=batch)[:, -1]
        for r, s in enumerate(seqs):
            want = model(mx.array([probe[r]]), cache=_alone(model, s, bits))[0, -1]
            assert float(mx.abs(logits[r] - want).max()) < 2e-2, (step, r)
        seqs = [s + p for s, p in zip(seqs, probe)]  # the probe stays: a plain step
    assert moved_any and any(o is not None for o in orders)
    for r, s in enumerate(seqs):
        ref = _alone(model, s, bits)
        taken = in_order([layer.extract(r) for layer in batch], orders[r])
        for got, want in zip(taken, ref):
            assert got.offset == want.offset == len(s)
            for a, b in zip(_kv(got, bits), _kv(want, bits)):
                assert float(mx.abs(a - b).max()) < 5e-2, r


def test_the_order_of_a_rotated_row() -> None:
    order = rotated(None, 6, 2)  # positions 0..5, its two oldest slots moved to its end
    assert order is not None and order.tolist() == [2, 3, 4, 5, 0, 1]
    # Two more positions appended in order, then three oldest slots moved.
    order = rotated(order, 8, 3)
    assert order is not None and order.tolist() == [5, 0, 1, 6, 7, 2, 3, 4]
    assert rotated(None, 5, 0) is None
