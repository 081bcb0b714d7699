"""How a paged batch splits its KV budget (`paging_plan`): the gather reserve, the block
pool (the rows' blocks and the prefix cache's share) and what the pool holds beside its
blocks, so that what MLX holds stays within the budget plus the reserve by construction:

- every paged layer keeps one scratch block beside its blocks (`kv/blocks.py`);
- a layer's arrays grow by reallocation (`LayerBlocks._resize`): for a moment one layer holds
  its old arrays beside the new ones. Layers grow one at a time, each evaluated at once, so
  the most this adds is one layer's old arrays, under `n` blocks of one layer for a pool of
  `n` (the last growth, capped at `n`, may start from almost `n`): 1/layers of the pool.

The reserve holds a step's gathered view or a growth's transient, never both: a growth
first waits for the step before (which holds its view) to finish. So the pool's `n` blocks
keep the pool's arrays within the budget less the gather share (the view's room is the
reserve), and the arrays plus one layer's old arrays within the budget less the gather
share plus the reserve (the gather share, or the gather floor where it is larger: taken
from the activation reserve). The second bounds the pool only
where one layer is a large share of it: few layers and a budget over a few hundred MiB (a
2-layer model above about 600 MiB; never from 7 layers up).

A hybrid's other layers (sliding windows, recurrent state) stay in mlx-lm's batch forms, a
fixed cost a row (`row_bytes`): the plan keeps room for `most_rows` of them out of the
budget before the pool takes the rest, and `Paging.fits` admits no more rows than that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# The gather reserve: this share of the budget, and at least GATHER_FLOOR (out of the
# activation reserve, which `budget.MIN_RESERVE`, twice the floor, keeps beside the budget).
GATHER_SHARE = 8
GATHER_FLOOR = 256 * 1024**2


@dataclass(frozen=True)
class Paging:
    """What a paged batch may hold: `blocks` of `block_size` tokens (`block_bytes` each,
    every paged layer), and per forward pass one layer's gathered view of at most
    `gather_bytes` (`gather_per_token` a view position); the prefix cache keeps its own
    `cache_bytes` beside the rows' blocks, in the same pool. `growth_bytes`: a growth's
    most (one layer's old arrays), which fits what the arrays leave of their share plus
    the reserve (`gather_bytes`, the view's in turn)."""

    block_size: int
    block_bytes: int
    blocks: int
    gather_per_token: int
    gather_bytes: int
    cache_bytes: int
    growth_bytes: int = 0
    # A hybrid's layers that do not page (sliding windows, recurrent state): what each row
    # holds in them whatever its length, and the most rows the budget keeps that room for
    # (0: no such layers, no cap but the blocks).
    row_bytes: int = 0
    rows: int = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits(self, tokens: Sequence[int], shared: int = 0) -> bool:
        """Whether rows of `tokens` fit, `shared` of their blocks held by more than one
        (a prefix cache hit's full blocks, counted once: `KvBudget`)."""
        if self.row_bytes and len(tokens) > self.rows:
            return False
        blocks = sum(self.blocks_for(t) for t in tokens) - shared
        view = len(tokens) * max(tokens, default=0) * self.gather_per_token
        return blocks <= self.blocks and view <= self.gather_bytes


def layer_block(block_bytes: int, layers: int) -> int:
    """One layer's block where its layers are one size, rounded up (`paging_plan` takes
    the largest layer's where they differ)."""
    return -(-block_bytes // max(1, layers))


def paging_plan(budget: int, per_token: int, layers: int, cache_bytes: int, block_size: int,
                most_tokens: int, largest: int | None = None, row_bytes: int = 0,
                most_rows: int = 0) -> Paging:
    """Split `budget` for a paged batch: the gather reserve (`GATHER_SHARE`, at least
    `GATHER_FLOOR`, which comes out of the activation reserve; a growth's transient
    uses it too), the prefix cache's bytes (at most half of the pool) and the rows'
    blocks (the rest, never more than `most_tokens` need). `per_token`: every paged layer's
    KV for one token, `layers` of them, the largest `largest` a token (None: all one size).
    `row_bytes`: what a row holds in the layers that do not page (a hybrid's sliding windows
    and recurrent state, mlx-lm's batch forms), kept for `most_rows` rows (at most half of
    what the gather leaves) before the pool takes the rest."""
    gather = budget // GATHER_SHARE
    reserve = max(gather, GATHER_FLOOR)
    rows = 0
    if row_bytes > 0:
        rows = max(1, min(most_rows, (budget - gather) // 2 // row_bytes))
    left = budget - gather - rows * row_bytes  # the pool's arrays: n blocks, the scratch ones
    block_bytes = max(1, per_token * block_size)
    layer = per_token // max(1, layers) if largest is None else largest
    per_layer = layer_block(block_bytes, layers) if largest is None else largest * block_size
    pool = max(0, min((left - block_bytes) // block_bytes,
                      # and mid-growth one layer's old arrays (n of its blocks) beside them
                      (left - block_bytes + reserve) // (block_bytes + per_layer)))
    cache = min(cache_bytes, pool * block_bytes // 2)
    blocks = min(pool - cache // block_bytes, -(-most_tokens // block_size))
    growth = (blocks + cache // block_bytes) * per_layer
    return Paging(block_size, block_bytes, max(1, blocks), max(1, layer), reserve, cache,
                  growth, row_bytes, rows)
