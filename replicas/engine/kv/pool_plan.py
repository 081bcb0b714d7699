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

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fits(self, tokens: Sequence[int], shared: int = 0) -> bool:
        """Whether rows of `tokens` fit, `shared` of their blocks held by more than one
        (a prefix cache hit's full blocks, counted once: `KvBudget`)."""
        blocks = sum(self.blocks_for(t) for t in tokens) - shared
        view = len(tokens) * max(tokens, default=0) * self.gather_per_token
        return blocks <= self.blocks and view <= self.gather_bytes


def layer_block(block_bytes: int, layers: int) -> int:
    """One layer's block (layers of one size assumed), rounded up."""
    return -(-block_bytes // max(1, layers))


def paging_plan(budget: int, per_token: int, layers: int, cache_bytes: int, block_size: int,
                most_tokens: int) -> Paging:
    """Split `budget` for a paged batch: the gather reserve (`GATHER_SHARE`, at least
    `GATHER_FLOOR`, which comes out of the activation reserve; a growth's transient
    uses it too), the prefix cache's bytes (at most half of the pool) and the rows'
    blocks (the rest, never more than `most_tokens` need). `per_token`: every paged layer's
    KV for one token, `layers` of them."""
    gather = budget // GATHER_SHARE
    reserve = max(gather, GATHER_FLOOR)
    left = budget - gather  # the pool's arrays: n blocks and the scratch ones
    block_bytes = max(1, per_token * block_size)
    per_layer = layer_block(block_bytes, layers)
    pool = max(0, min((left - block_bytes) // block_bytes,
                      # and mid-growth one layer's old arrays (n of its blocks) beside them
                      (left - block_bytes + reserve) // (block_bytes + per_layer)))
    cache = min(cache_bytes, pool * block_bytes // 2)
    blocks = min(pool - cache // block_bytes, -(-most_tokens // block_size))
    growth = (blocks + cache // block_bytes) * per_layer
    return Paging(block_size, block_bytes, max(1, blocks), max(1, per_token // max(1, layers)),
                  reserve, cache, growth)
