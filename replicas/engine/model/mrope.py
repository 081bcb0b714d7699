"""Multimodal rotary positions (Qwen-VL's M-RoPE) on mlx-lm's language model, per row.

Qwen2-VL gives each token three positions (temporal, height, width). Inside an image they
differ; for text they are equal, and M-RoPE over equal positions is the ordinary 1-D RoPE
that mlx-lm's `qwen2_vl` model runs. So only two things differ from a text model:

- an image prefix is prefilled with mlx-vlm's 3-D positions (`RowPositions.explicit`,
  applied by mlx-vlm's own rotary embedding), and
- every later token of that row sits at its cache offset plus the row's `rope_delta`
  (negative: an image of N tokens advances positions by less than N).

Each layer's `rope` becomes an `MRope`, which adds the current forward's per-row deltas to
the offset mlx-lm passes. The batch sets them by uid around each forward it builds
(`RowPositions.of`, as `Slots` does for LoRA); rows without a delta (text) add nothing, and
a forward with none at all is mlx-lm's, unchanged. A hybrid model's linear-attention layers
(Qwen3.5) have no rope: they are left as they are.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn


class RowPositions:
    """The rows' position deltas, and what the forward being built uses. Engine thread only."""

    def __init__(self) -> None:
        self.by_uid: dict[int, int] = {}  # rows after an image: their delta
        self.deltas: mx.array | None = None  # the forward's, one per row; None: all 0
        self.positions: mx.array | None = None  # (3, 1, L): an image prefix's own

    @contextmanager
    def of(self, uids: Sequence[int]) -> Iterator[None]:
        """While a forward over the batch's rows `uids` is built (MLX is lazy: the deltas
        are captured in the graph, so they may be reset right after)."""
        deltas = [self.by_uid.get(u, 0) for u in uids] if self.by_uid else []
        previous = self.deltas
        self.deltas = mx.array(deltas, dtype=mx.int32) if any(deltas) else None
        try:
            yield
        finally:
            self.deltas = previous

    @contextmanager
    def explicit(self, positions: mx.array) -> Iterator[None]:
        """While a one-row forward over an image prefix's chunk is built: its 3-D positions
        (3, 1, L), mlx-vlm's `get_rope_index`."""
        self.positions = positions
        try:
            yield
        finally:
            self.positions = None


class MRope(nn.Module):
    """A layer's 1-D rope (mlx-lm's), shifted per row; or mlx-vlm's M-RoPE over explicit
    3-D positions."""

    def __init__(self, rope: nn.Module, rotary: Any, rows: RowPositions) -> None:
        super().__init__()
        self.rope = rope
        self._rotary = rotary  # mlx-vlm's rotary embedding (no weights)
        self._rows = rows

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        rows = self._rows
        if rows.positions is not None:
            rotated, _ = self._rotary.apply_rotary(x, x, rows.positions, unsqueeze_dim=1)
            return rotated  # type: ignore[no-any-return]
        if rows.deltas is not None:
            offset = offset + rows.deltas
        return self.rope(x, offset=offset)  # type: ignore[no-any-return]


def install(model: nn.Module, rotary: Any) -> RowPositions:
    """Give each of `model`'s attention layers an `MRope` around its rope; the positions
    they read. `rotary`: mlx-vlm's rotary embedding for the same model."""
    rows = RowPositions()
    for layer in model.layers:  # type: ignore[union-attr]
        attention = getattr(layer, "self_attn", None)
        if attention is None:  # linear attention (Qwen3.5): no positions
            continue
        attention.rope = MRope(attention.rope, rotary, rows)
    model._row_positions = rows  # type: ignore[union-attr]  # not a parameter: a plain attribute
    return rows


def row_positions(model: nn.Module) -> RowPositions | None:
    """The positions `install` gave `model`, or None (a model with 1-D positions)."""
    return getattr(model, "_row_positions", None)
