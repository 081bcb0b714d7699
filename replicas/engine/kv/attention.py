"""Attention over a paged batch: rows grouped by length, so a short row does not attend over
a long row's padding.

mlx-lm's attention layers call `scaled_dot_product_attention(queries, keys, values, cache,
scale, mask)` from `mlx_lm.models.base`, imported into each model's module. `install`
wraps that name in the modules of a model's layers: where the layer's cache has
`attend_paged` (`replicas.engine.kv.paged.PagedBatchKVCache`), the call goes there, and
everything else goes to mlx-lm's own function unchanged. The paged cache's
`update_and_fetch` still returns the whole batch's view, so a layer the hook does not reach
computes the same attention over it; where the hook answers, MLX never evaluates that view
(it is lazy), and each group gathers only its own rows' blocks.

`plan_groups` splits a decode step's rows by their widths in blocks: sorted widest first,
a group is a run of rows attending over its widest row's width, and a group costs
`GROUP_COST` block-rows more (one more gather and attention call), so uniform lengths
stay one group and one 4096-token row among 256-token ones becomes two.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base

# What one more group costs, in block-rows of attention (one row attending over one block):
# a gather and an attention call, about 16 block-rows' time on this CPU with builtin:tiny.
GROUP_COST = 16

_HOOKED = "_orchard_paged_attention"


def plan_groups(widths: Sequence[int], cost: int | None = None) -> list[list[int]]:
    """Row indices in groups (widest first) that minimise the block-rows attention reads,
    `sum(rows x widest) + cost` a group (`GROUP_COST`). Rows of one width share a group."""
    cost = GROUP_COST if cost is None else cost
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    w = [widths[i] for i in order]
    starts = [j for j in range(len(w)) if j == 0 or w[j] != w[j - 1]] + [len(w)]
    runs = len(starts) - 1
    # best[r]: the least cost of grouping the rows of runs [0, r); cut[r]: where its last
    # group starts (a run index).
    best = [0.0] + [float("inf")] * runs
    cut = [0] * (runs + 1)
    for end in range(1, runs + 1):
        for first in range(end):
            c = best[first] + (starts[end] - starts[first]) * w[starts[first]] + cost
            if c < best[end]:
                best[end], cut[end] = c, first
    groups: list[list[int]] = []
    end = runs
    while end > 0:
        first = cut[end]
        groups.append(order[starts[first]:starts[end]])
        end = first
    return groups[::-1]


@dataclass(frozen=True)
class Group:
    rows: mx.array  # the batch rows it holds, `[G]`
    index: mx.array  # the by-block storage rows of their blocks, `[G, H, width]`
    mask: mx.array  # which of those columns each row's query sees, `[G, 1, 1, width * block]`


@dataclass(frozen=True)
class Step:
    """One step of a paged batch, alike for every layer: where it writes, what the batch's
    view reads, and its groups where a decode step's rows split by length."""

    write: mx.array  # the storage rows the step's keys and values go to, `[B * H * n]`
    view: mx.array | int  # the view's by-block index `[B, H, width]`, or one row's first block
    width: int  # the view's width in blocks
    groups: list[Group] | None  # None: attention reads the whole view
    order: mx.array | None  # where each batch row lands among the groups' outputs


def plan_step(tables: Sequence[Sequence[int]], pads: Sequence[int],
              ends: Sequence[int] | None, prev: int, n: int, num_blocks: int,
              block_size: int, heads: int) -> Step:
    """The step writing view columns `[prev, prev + n)` of a batch whose rows are
    left-padded by `pads` (their real tokens ending at `ends` in a right-padded prefill)
    and hold the blocks `tables` lists. Position p of row i lies in slot
    `tables[i][p // block] * block + p % block`; padding writes to the scratch block
    (`num_blocks`), which the view reads past a row's table."""
    B, bs, nb = len(pads), block_size, num_blocks
    if B == 1 and n == 1 and ends is None and prev >= pads[0]:
        return _one_row_decode(tables[0], prev - pads[0], nb, bs, heads)
    pad = np.asarray(pads, dtype=np.int64)
    stop = np.full(B, prev + n) if ends is None else \
        np.minimum(prev + n, pad + np.asarray(ends, dtype=np.int64))
    stored = np.maximum(0, stop - pad)  # each row's positions after the step
    width = max(1, -(-int(stored.max(initial=0)) // bs))
    table = np.full((B, max(width, max((len(t) for t in tables), default=0))), nb, np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    pos = np.arange(prev, prev + n)[None, :] - pad[:, None]  # [B, n]
    real = (pos >= 0) & (pos < stored[:, None])
    p = np.where(real, pos, 0)
    slot = np.where(real, table[np.arange(B)[:, None], p // bs] * bs + p % bs, nb * bs)
    write = (np.arange(heads)[None, :, None] * (nb + 1) * bs + slot[:, None, :]).reshape(-1)
    by_head = np.arange(heads)[None, :, None] * (nb + 1)
    view: mx.array | int
    if B == 1 and _run(tables[0], width):
        view = int(table[0, 0])
    else:
        view = mx.array((by_head + table[:, None, :width]).astype(np.int32))
    groups, order = None, None
    if n == 1 and B > 1:
        widths = [max(1, -(-int(s) // bs)) for s in stored]
        plan = plan_groups(widths)
        if len(plan) > 1:
            groups = []
            for rows in plan:
                w = widths[rows[0]]
                cols = np.arange(w * bs)[None, :]
                seen = (cols < stored[rows][:, None]) & (cols <= pos[rows, 0][:, None])
                groups.append(Group(mx.array(rows),
                                    mx.array((by_head + table[rows][:, None, :w]).astype(np.int32)),
                                    mx.array(seen[:, None, None, :])))
            flat = np.array([i for rows in plan for i in rows])
            order = mx.array(np.argsort(flat).astype(np.int32))
    return Step(mx.array(write.astype(np.int32)), view, width, groups, order)


def _run(table: Sequence[int], width: int) -> bool:
    """Whether a row's first `width` blocks are one run (its view a slice of the pool)."""
    return len(table) >= width and \
        list(table[:width]) == list(range(table[0], table[0] + width))


def _one_row_decode(table: Sequence[int], p: int, nb: int, bs: int, heads: int) -> Step:
    """`plan_step` for one row decoding its position `p` (a single stream's every step,
    without numpy: its fixed cost is a larger part of a small step)."""
    width = p // bs + 1
    slot = table[p // bs] * bs + p % bs
    write = mx.array([h * (nb + 1) * bs + slot for h in range(heads)], dtype=mx.int32)
    if _run(table, width):
        return Step(write, int(table[0]), width, None, None)
    view = mx.array([[[h * (nb + 1) + b for b in table[:width]] for h in range(heads)]],
                    dtype=mx.int32)
    return Step(write, view, width, None, None)


def attend_groups(queries: mx.array, store_k: mx.array, store_v: mx.array,
                  groups: Sequence[Group], order: mx.array, scale: float) -> mx.array:
    """A decode step's attention by groups: each group's queries over its rows' blocks
    (gathered from the by-block storage), the outputs back in the batch's row order."""
    bs, outs = store_k.shape[1], []
    for g in groups:
        G, H, w = g.index.shape
        k = store_k[g.index].reshape(G, H, w * bs, store_k.shape[2])
        v = store_v[g.index].reshape(G, H, w * bs, store_v.shape[2])
        outs.append(mx.fast.scaled_dot_product_attention(queries[g.rows], k, v, scale=scale,
                                                         mask=g.mask))
    return mx.concatenate(outs, axis=0)[order]


def _hook(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries: mx.array, keys: Any, values: Any, cache: Any,
                                     scale: float, mask: Any, sinks: Any = None) -> mx.array:
        attend = getattr(cache, "attend_paged", None)
        if attend is None or sinks is not None:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                            sinks=sinks)
        return attend(queries, keys, values, scale, mask)

    setattr(scaled_dot_product_attention, _HOOKED, original)
    return scaled_dot_product_attention


def install(model: nn.Module) -> int:
    """Route the attention of `model`'s layers to paged caches (idempotent). Returns how
    many modules' functions were wrapped now; a module whose function is not mlx-lm's own
    (another patch) is left as it is, and computes over the full view."""
    wrapped = 0
    names = {type(m).__module__ for m in model.modules()}
    for name in sorted(names):
        module = sys.modules.get(name)
        fn = getattr(module, "scaled_dot_product_attention", None)
        if fn is base.scaled_dot_product_attention:
            setattr(module, "scaled_dot_product_attention", _hook(fn))
            wrapped += 1
    return wrapped


def hooked(model: nn.Module) -> bool:
    """Whether every module of `model`'s layers that calls mlx-lm's attention is routed."""
    mods = [sys.modules.get(type(m).__module__) for m in model.modules()]
    fns = [getattr(m, "scaled_dot_product_attention", None) for m in mods]
    return any(fns) and all(f is None or hasattr(f, _HOOKED) for f in fns)
