"""M-RoPE on mlx-lm's rope (`replicas.engine.model.mrope`), against mlx-vlm's own rotary
embedding: over equal 3-D positions it is the 1-D rope, so a row after an image decodes
with mlx-lm's rope shifted by its delta; an image's own 3-D positions go through
mlx-vlm's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from replicas.engine.model.mrope import MRope, RowPositions

HEAD_DIM, BASE = 32, 1_000_000.0


def rotaries() -> tuple[nn.Module, object]:
    from mlx_vlm.models.qwen2_vl.language import Qwen2RotaryEmbedding

    vlm = Qwen2RotaryEmbedding(HEAD_DIM, base=BASE,
                               rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})
    return nn.RoPE(HEAD_DIM, traditional=False, base=BASE), vlm


def vlm_apply(vlm: object, x: mx.array, positions: mx.array) -> mx.array:
    rotated, _ = vlm.apply_rotary(x, x, positions, unsqueeze_dim=1)  # type: ignore[attr-defined]
    return rotated  # type: ignore[no-any-return]


def test_each_rows_delta_shifts_its_positions() -> None:
    rope, vlm = rotaries()
    rows = RowPositions()
    layer = MRope(rope, vlm, rows)
    x = mx.random.normal((2, 4, 5, HEAD_DIM))
    offsets = mx.array([10, 7])
    rows.by_uid = {31: -4}  # the first row is after an image; the second is text
    with rows.of([31, 32]):
        shifted = layer(x, offset=offsets)
    assert rows.deltas is None  # set only while the forward is built
    # mlx-vlm's M-RoPE with each row's three equal positions: offset + delta + i.
    starts = np.array([[10 - 4], [7]])
    positions = mx.array(np.broadcast_to(starts + np.arange(5), (3, 2, 5)).copy())
    assert mx.allclose(shifted, vlm_apply(vlm, x, positions), atol=1e-4)
    # No row with a delta: mlx-lm's rope as it was.
    with rows.of([32, 33]):
        assert rows.deltas is None
        assert mx.array_equal(layer(x, offset=offsets), rope(x, offset=offsets))


def test_an_image_prefix_takes_its_3d_positions() -> None:
    rope, vlm = rotaries()
    rows = RowPositions()
    layer = MRope(rope, vlm, rows)
    x = mx.random.normal((1, 4, 6, HEAD_DIM))
    # Two text tokens, then a 2 x 2 image: temporal, height, width differ inside it.
    positions = mx.array([[[0, 1, 2, 2, 2, 2]], [[0, 1, 2, 2, 3, 3]], [[0, 1, 2, 3, 2, 3]]])
    with rows.explicit(positions):
        rotated = layer(x, offset=0)
    assert rows.positions is None
    assert mx.allclose(rotated, vlm_apply(vlm, x, positions), atol=1e-5)
    assert not mx.allclose(rotated, rope(x), atol=1e-3)  # not the 1-D rope
