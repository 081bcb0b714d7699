"""`pool_plan.paging_plan` for a hybrid model: its other layers' fixed cost a row comes out
of the budget before the pool (for `most_rows` rows, at most half), `Paging.fits` admits no
more rows than that room holds, and paged layers of different sizes size a growth's
transient and the gathered view by the largest."""

from __future__ import annotations

from replicas.engine.kv.blocks import BLOCK_SIZE
from replicas.engine.kv.pool_plan import GATHER_SHARE, paging_plan

BUDGET = 4 * 1024**3
LAYERS = 32
PER_TOKEN = LAYERS * 512  # paged layers of 512 bytes a token (the pool binds, not a growth)


def test_a_rows_fixed_cost_comes_out_of_the_pool() -> None:
    plain = paging_plan(BUDGET, PER_TOKEN, LAYERS, 0, BLOCK_SIZE, 1 << 40)
    row_bytes = 8 * 1024**2
    hybrid = paging_plan(BUDGET, PER_TOKEN, LAYERS, 0, BLOCK_SIZE, 1 << 40, row_bytes=row_bytes,
                         most_rows=16)
    assert hybrid.rows == 16 and hybrid.row_bytes == row_bytes
    fixed_blocks = 16 * row_bytes // hybrid.block_bytes
    assert plain.blocks - fixed_blocks - 1 <= hybrid.blocks <= plain.blocks - fixed_blocks
    assert hybrid.fits([100] * 16)
    assert not hybrid.fits([100] * 17)  # the fixed room holds 16 rows
    assert plain.fits([100] * 17) and plain.rows == 0


def test_a_fixed_cost_too_large_for_every_row_caps_the_rows() -> None:
    row_bytes = BUDGET // 10
    plan = paging_plan(BUDGET, PER_TOKEN, LAYERS, 0, BLOCK_SIZE, 1 << 40, row_bytes=row_bytes,
                       most_rows=64)
    left = BUDGET - BUDGET // GATHER_SHARE
    assert plan.rows == left // 2 // row_bytes == 4
    assert plan.rows * row_bytes + plan.blocks * plan.block_bytes <= left
    assert plan.fits([10] * 4) and not plan.fits([10] * 5)


def test_layers_of_different_sizes_count_the_largest() -> None:
    even = paging_plan(BUDGET, 3 * 4096, 2, 0, BLOCK_SIZE, 1 << 40)
    uneven = paging_plan(BUDGET, 3 * 4096, 2, 0, BLOCK_SIZE, 1 << 40, largest=2 * 4096)
    assert even.gather_per_token == 3 * 4096 // 2
    assert uneven.gather_per_token == 2 * 4096  # the view of the largest layer
    assert uneven.growth_bytes > even.growth_bytes  # its growth's old arrays, the largest
    assert uneven.growth_bytes == (uneven.blocks + 0) * 2 * 4096 * BLOCK_SIZE
