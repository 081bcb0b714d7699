"""Gemma's image mask on mlx-lm's caches (`replicas.engine.model.bidirectional`): a chunk's
masks are mlx-lm's causal ones with each image's tokens attending to each other (within
the window on a sliding layer), and a chunk never ends inside an image."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from replicas.engine.model.bidirectional import Overlaid, chunk_end, image_blocks, overlaid

IMG = 9


def test_image_blocks_are_runs_of_the_image_token() -> None:
    ids = [1, IMG, IMG, IMG, 2, 3, IMG, IMG, 4, IMG]
    assert image_blocks(ids, IMG) == ((1, 4), (6, 8), (9, 10))
    assert image_blocks([1, 2], IMG) == ()


def test_a_chunk_never_ends_inside_an_image() -> None:
    blocks = ((4, 20), (22, 30))
    assert chunk_end(0, 3, blocks) == 3  # before any image
    assert chunk_end(0, 10, blocks) == 4  # stops before the image
    assert chunk_end(4, 7, blocks) == 20  # the image starts the chunk: all of it
    assert chunk_end(20, 25, blocks) == 22
    assert chunk_end(22, 23, blocks) == 30
    assert chunk_end(4, 20, blocks) == 20  # ending at an image's end is fine


def _filled(cache: KVCache | RotatingKVCache, n: int) -> None:
    cache.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))


def test_the_chunks_images_attend_both_ways() -> None:
    cache = KVCache()
    _filled(cache, 5)  # five positions before the chunk
    chunk = overlaid([cache], 5, 13, [(2, 4), (7, 11), (14, 20)])  # (7, 11) is inside
    layer = chunk[0]
    assert isinstance(layer, Overlaid) and layer.offset == 5
    mask = np.array(layer.make_mask(8))
    expected = np.tril(np.ones((8, 13), dtype=bool), k=5)  # causal after 5 cached keys
    expected[2:6, 5 + 2:5 + 6] = True  # positions 7..10 are chunk rows 2..5
    assert (mask == expected).all()
    # A chunk without an image keeps mlx-lm's own caches and masks.
    assert overlaid([cache], 0, 2, [(7, 11)]) == [cache]


def test_a_sliding_layer_keeps_its_window() -> None:
    cache = RotatingKVCache(max_size=3)
    chunk = overlaid([cache], 0, 6, [(1, 6)])
    mask = np.array(chunk[0].make_mask(6, window_size=3))
    rows, cols = np.indices((6, 6))
    window = (rows - cols) < 3
    expected = ((cols <= rows) & window) | ((rows >= 1) & (cols >= 1) & window)
    assert (mask == expected).all()
