"""DeepStack (Qwen3-VL) on mlx-lm's language model: features of earlier vision blocks
added to the hidden states at the image positions, after each of the first decoder layers.

mlx-vlm's `Qwen3VLModel` adds level i of `deepstack_visual_embeds` to the output of
decoder layer i at the image tokens (`_deepstack_process`). Only an image prefix has image
tokens, and it is prefilled as a one-row forward (`replicas.engine.batch.image_prefix`):
so the additions are one dense array per level over the prefix, zero at its text tokens,
sliced per chunk (`DeepStack.adding`). Adding 0.0 leaves a hidden state exactly as it was,
and at an image token the sum is mlx-vlm's, so the result is its own. Every other forward
(text rows, decoding) adds nothing: a layer's output is mlx-lm's, unchanged.

The first layers' class is swapped for a subclass that adds after calling the original,
rather than wrapped in a module, so their parameters keep their names (loading, LoRA).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class DeepStack:
    """What the forward being built adds after each of the first `levels` layers.
    Engine thread only."""

    def __init__(self, levels: int) -> None:
        self.levels = levels
        self.additions: mx.array | None = None  # (levels, 1, L, D) while a chunk is built

    @contextmanager
    def adding(self, additions: mx.array) -> Iterator[None]:
        """While a one-row forward over an image prefix's chunk is built (MLX is lazy: the
        additions are captured in the graph). `additions`: (levels, 1, L, D)."""
        self.additions = additions
        try:
            yield
        finally:
            self.additions = None

    def after(self, level: int) -> mx.array | None:
        additions = self.additions
        return None if additions is None else additions[level]


_SUBCLASSES: dict[type, type] = {}


def _deepstacked(cls: type) -> type:
    """`cls` with its output plus its level's addition, when one is set."""
    if cls not in _SUBCLASSES:
        def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            out = cls.__call__(self, x, *args, **kwargs)
            addition = self._deepstack.after(self._deepstack_level)
            return out if addition is None else out + addition  # type: ignore[no-any-return]

        _SUBCLASSES[cls] = type(f"DeepStacked{cls.__name__}", (cls,), {"__call__": __call__})
    return _SUBCLASSES[cls]


def install(model: nn.Module, levels: int) -> DeepStack:
    """Make the first `levels` of `model`'s layers add DeepStack's features; what they
    read."""
    layers = model.layers  # type: ignore[union-attr]
    if levels > len(layers):
        raise ValueError(f"{levels} DeepStack levels for {len(layers)} layers")
    stack = DeepStack(levels)
    for level, layer in enumerate(layers[:levels]):
        layer.__class__ = _deepstacked(type(layer))
        layer._deepstack = stack  # plain attributes, not parameters
        layer._deepstack_level = level
    model._deepstack = stack  # type: ignore[union-attr]
    return stack


def deepstack_of(model: nn.Module) -> DeepStack | None:
    """The DeepStack `install` gave `model`, or None (no DeepStack)."""
    return getattr(model, "_deepstack", None)


def dense(ids: Sequence[int], image_token: int, features: Sequence[mx.array]) -> mx.array:
    """mlx-vlm's per-level features (one row per image token, in order) as additions over
    the whole prefix: (levels, len(ids), D), zero at every other token."""
    at = mx.array(np.flatnonzero(np.asarray(ids) == image_token).astype(np.uint32))
    stacked = mx.stack(list(features))  # (levels, n, D)
    if stacked.shape[1] != at.size:
        raise ValueError(f"{stacked.shape[1]} DeepStack rows for {at.size} image tokens")
    additions = mx.zeros((stacked.shape[0], len(ids), stacked.shape[2]), dtype=stacked.dtype)
    additions[:, at] = stacked
    return additions
