"""Dropping each row's rejected tail from a batch cache, moving a few slots per row.

After a verifying pass, row i's last r_i cache slots hold positions it did not keep. Every
row of an mlx-lm batch cache ends at one write index, so what all rows reject is trimmed,
and a row with more to drop (its excess) must lose it some other way. mlx-lm's own move,
rolling the row right by its excess into its left padding (`prepare(right_padding)` then
`finalize()`), rewrites the row's whole cache: O(context) every ragged step, 0.35-0.5 s on
a 2-core CPU for 8 rows of 4k tokens of `builtin:bench`'s KV. Here the row's oldest
m = min(excess, its length) slots are copied into its rejected tail instead, and its left
padding grows by the excess: O(excess) per row.

Attention does not care which slot holds a past position: each key carries its RoPE
position, and every cached slot is visible to every new query (plain attention only: a
sliding window or a recurrent state cannot roll back at all). So decoding is unchanged;
only taking a row out of the batch (for the prefix cache) must put its slots back in order.
A row's order is None while its slots are in order, else the positions of its first
len(order) slots (a permutation of 0..len(order)-1); slots past those are in order.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from replicas.engine.kv.layout import leaves

Order = np.ndarray  # a row's slot order: the position each of its first slots holds


def drop_tails(caches: list[Any], rejected: Sequence[int]) -> list[int]:
    """Drop row i's last `rejected[i]` positions from every layer's batch cache (all layers
    alike: they share left padding and write index). Returns, per row, how many of its
    oldest slots moved to its end (`rotated` keeps its order)."""
    caches = list(leaves(caches))
    common = min(rejected)
    excess = [r - common for r in rejected]
    if common:
        for cache in caches:
            cache.trim(common)
    if not any(excess):
        return [0] * len(excess)
    first = caches[0]
    end = first._idx  # noqa: SLF001 - mlx-lm's batch caches keep their write index here
    starts: list[int] = first.left_padding.tolist()  # type: ignore[assignment]
    moved = [min(d, end - d - start) if d else 0 for d, start in zip(excess, starts)]
    rows = [i for i, m in enumerate(moved) for _ in range(m)]
    if rows:
        row = mx.array(rows)
        src = mx.array([s for start, m in zip(starts, moved) for s in range(start, start + m)])
        dst = mx.array([s for m in moved for s in range(end - m, end)])

        def move(a: mx.array) -> mx.array:
            a[row, :, dst] = a[row, :, src]
            return a

        for cache in caches:
            if cache.keys is not None:
                cache.keys = _each(cache.keys, move)
                cache.values = _each(cache.values, move)
    pad = mx.array(excess)
    for cache in caches:
        cache.left_padding = cache.left_padding + pad
        cache.offset = cache.offset - pad
    return moved


def rotated(order: Order | None, length: int, moved: int) -> Order | None:
    """A row's slot order after `drop_tails` moved its `moved` oldest slots to its end;
    `length`: the positions the row holds."""
    if order is None and moved == 0:
        return None
    full = np.arange(length) if order is None else \
        np.concatenate([order, np.arange(len(order), length)])
    return np.concatenate([full[moved:], full[:moved]])


def in_order(layers: list[Any], order: Order | None) -> list[Any]:
    """One row's extracted cache (slots as the batch held them) with its positions back in
    order, as the prefix cache keeps them."""
    if order is None:
        return layers
    length = next(leaves(layers)).offset
    full = np.concatenate([order, np.arange(len(order), length)])
    slot_of = mx.array(np.argsort(full))  # the slot that holds each position

    def reorder(a: mx.array) -> mx.array:
        return mx.contiguous(a[..., slot_of, :])

    for layer in leaves(layers):  # in place: a `CacheList` keeps its members
        layer.keys = _each(layer.keys, reorder)
        layer.values = _each(layer.values, reorder)
    return layers


def _each(x: Any, fn: Callable[[mx.array], mx.array]) -> Any:
    """`fn` over a cache's keys or values: one array, or a quantized cache's packed tuple."""
    return tuple(fn(a) for a in x) if isinstance(x, tuple) else fn(x)
