"""Apply an llguidance token bitmask to MLX logits: disallowed ids become -inf.

The bitmask holds one bit per token id, 32 ids per int32 word (bit i of word w is id
32*w + i). llguidance ships a Metal kernel for this; it is used when Metal is present and
gives the same answer as the portable compiled function, which runs on every backend.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import cast

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

BitmaskApply = Callable[[mx.array, mx.array], mx.array]


@mx.compile
def _apply_unpacked(logits: mx.array, bitmask: mx.array) -> mx.array:
    # Unsigned, so the shift of bit 31 does not drag the sign along.
    bits = mx.right_shift(bitmask.astype(mx.uint32)[..., None], mx.arange(32, dtype=mx.uint32))
    allowed = (bits & 1).reshape(bitmask.shape[0], -1)[:, : logits.shape[-1]]
    return mx.where(allowed.astype(mx.bool_), logits, -mx.inf)


def apply_token_bitmask(logits: mx.array, bitmask: mx.array) -> mx.array:
    """`logits` (B, V) with every id whose bit is 0 in `bitmask` (B, ceil(V/32)) at -inf."""
    return _implementation()(logits, bitmask)


@functools.cache
def _implementation() -> BitmaskApply:
    if mx.metal.is_available():
        kernel = _working_metal_kernel()
        if kernel is not None:
            return kernel
    return _apply_unpacked


def _working_metal_kernel() -> BitmaskApply | None:
    """llguidance's Metal kernel, if it runs here and agrees with the portable path."""
    try:
        from llguidance.mlx import apply_token_bitmask_kernel

        kernel = cast(BitmaskApply, apply_token_bitmask_kernel)
        rng = np.random.default_rng(0)
        logits = mx.array(rng.standard_normal((2, 100)).astype(np.float32))
        bitmask = mx.array(rng.integers(-(2**31), 2**31, (2, 4)).astype(np.int32))
        agree = mx.array_equal(kernel(logits, bitmask), _apply_unpacked(logits, bitmask)).item()
    except Exception:  # an optional fast path: any failure means "use the portable one"
        log.warning("llguidance Metal bitmask kernel unavailable", exc_info=True)
        return None
    if not agree:
        log.warning("llguidance Metal bitmask kernel disagrees; using the portable path")
        return None
    return kernel
