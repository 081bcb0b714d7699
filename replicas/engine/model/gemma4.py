"""Gemma 4's image prefix on mlx-lm's language model: mlx-vlm's embeddings and per-layer
inputs, as mlx-vlm's own language model takes them.

Two things differ from a text prompt's forward in mlx-lm's `gemma4_text`:
- mlx-vlm's `get_input_embeddings` returns the embeddings already multiplied by the
  embedding scale (sqrt of the hidden size) with the image features merged in unscaled;
  mlx-lm multiplies whatever `input_embeddings` it is given by that scale again. So the
  prefix's forward runs with the scale at 1.0 (exact: no division that would round).
- Models with per-layer inputs (Gemma 4 E2B, E4B) look up each token's per-layer
  embedding; mlx-vlm looks up the pad token (0) in place of each image token, while mlx-lm
  would look up the image token's id. So the prefix's ids reach the lookup with its image
  tokens as 0.
Every other forward (text rows, decoding) has no `input_embeddings` and is mlx-lm's own.
The text model's class is swapped for a subclass, rather than wrapped, so its parameters
keep their names (loading, LoRA).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

_SUBCLASSES: dict[type, type] = {}


def _prefixed(cls: type) -> type:
    """`cls` (mlx-lm's `Gemma4TextModel`) taking mlx-vlm's prefix embeddings as they are."""
    if cls not in _SUBCLASSES:
        def __call__(self: Any, inputs: mx.array | None = None, cache: Any = None,
                     input_embeddings: mx.array | None = None,
                     per_layer_inputs: mx.array | None = None) -> mx.array:
            if input_embeddings is None:
                return cls.__call__(self, inputs, cache, None, per_layer_inputs)
            if self.hidden_size_per_layer_input and per_layer_inputs is None:
                if inputs is None:
                    raise ValueError("Gemma 4's image prefix needs its token ids")
                # mlx-vlm's: the pad token in place of each image token.
                ids = mx.where(inputs == self._image_token, mx.zeros_like(inputs), inputs)
                per_layer_inputs = self._get_per_layer_inputs(ids)
            scale = self.embed_scale
            self.embed_scale = 1.0  # mlx-vlm's embeddings are scaled already
            try:
                return cls.__call__(self, inputs, cache, input_embeddings, per_layer_inputs)
            finally:
                self.embed_scale = scale

        _SUBCLASSES[cls] = type(f"Prefixed{cls.__name__}", (cls,), {"__call__": __call__})
    return _SUBCLASSES[cls]


def install(language_model: nn.Module, image_token: int) -> None:
    """Make mlx-lm's Gemma 4 (`gemma4.Model` or `gemma4_text.Model`) take an image prefix's
    embeddings from mlx-vlm's `get_input_embeddings`."""
    text: Any = language_model
    for name in ("language_model", "model"):
        text = getattr(text, name, text)
    if not hasattr(text, "embed_scale") or not hasattr(text, "_get_per_layer_inputs"):
        raise ValueError(f"{type(text).__name__} is not mlx-lm's Gemma 4 text model")
    text.__class__ = _prefixed(type(text))
    text._image_token = image_token  # a plain attribute, not a parameter
