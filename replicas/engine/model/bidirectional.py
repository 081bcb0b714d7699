"""Bidirectional attention over an image's tokens inside an otherwise causal mask (Gemma 3,
and Gemma 4 where its config says `use_bidirectional_attention: "vision"`).

Gemma 3 was trained with each image's tokens attending to each other both ways, while
every other token attends causally (transformers' Gemma 3 masks: the causal mask OR "query and key are in the same image", and on a sliding layer that AND the
key no further back than the window: `create_masks_for_vision_model`). Only the
image prefix's forwards see an image's tokens as queries, so only they need it: decoding
and the text after the last image are mlx-lm's causal forwards, unchanged.

mlx-lm's Gemma 3 builds each forward's masks from its layers' caches
(`create_attention_mask` calls `cache.make_mask`). So a chunk of the prefix is run over
`Overlaid` caches: each delegates to the row's own cache, and its `make_mask` returns
mlx-lm's causal (or windowed) mask as an array with the chunk's image blocks set. The
chunk's keys are the last columns of any mask (the cache's old keys come first), and the
batch never splits a block across chunks (`PromptEmbeddings.blocks`), so a block is
whole in the chunk that holds it.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np


def block_mask(length: int, blocks: Sequence[tuple[int, int]]) -> mx.array:
    """(length, length) booleans: True where query and key are in the same block.
    `blocks`: (start, end) ranges within the chunk."""
    same = np.zeros((length, length), dtype=bool)
    for start, end in blocks:
        same[start:end, start:end] = True
    return mx.array(same)


class Overlaid:
    """A layer's cache for one chunk's forward: the cache itself, but masks with the
    chunk's image blocks attending both ways."""

    def __init__(self, cache: Any, same: mx.array) -> None:
        self._cache = cache
        self._same = same  # (L, L): the chunk's tokens in the same block

    def __getattr__(self, name: str) -> Any:  # offset, update_and_fetch, bits...: the cache's
        return getattr(self._cache, name)

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array | None:
        mask = self._cache.make_mask(n, return_array=True, window_size=window_size)
        if mask is None:  # one token (a block of one changes nothing)
            return mask
        width = self._same.shape[-1]
        same = self._same
        if window_size is not None:  # a sliding layer: a block's keys within the window too
            at = mx.arange(width)
            same = same & ((at[:, None] - at[None]) < window_size)
        return mx.concatenate([mask[..., :-width], mask[..., -width:] | same], axis=-1)


def overlaid(cache: Sequence[Any], start: int, end: int,
             blocks: Sequence[tuple[int, int]]) -> list[Any]:
    """The caches for a forward over prompt positions [start, end): as they are when no
    block falls in it, else each `Overlaid` with the blocks inside it."""
    inside = [(max(s, start) - start, min(e, end) - start) for s, e in blocks
              if s < end and e > start]
    if not inside:
        return list(cache)
    same = block_mask(end - start, inside)
    return [Overlaid(c, same) for c in cache]


def chunk_end(start: int, end: int, blocks: Sequence[tuple[int, int]]) -> int:
    """Where a prefill chunk from `start` that would end at `end` ends instead so as not to
    split a block: before the block `end` falls in, or, when that block starts the chunk,
    after it (a chunk longer than the step, but the block whole)."""
    for s, e in blocks:
        if s < end < e:
            return s if s > start else e
    return end


def image_blocks(ids: Sequence[int], image_token: int) -> tuple[tuple[int, int], ...]:
    """Each run of `image_token` in `ids` (one image's tokens: Gemma writes its start and
    end tokens around each), as a (start, end) range."""
    blocks: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate([*ids, None]):
        if token == image_token and start is None:
            start = i
        elif token != image_token and start is not None:
            blocks.append((start, i))
            start = None
    return tuple(blocks)
