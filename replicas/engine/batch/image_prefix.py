"""A prompt's image prefix, prefilled from embeddings one chunk per engine loop
(`LocalBatch.begin`, `advance`), so that decoding rows go on between chunks.

The vision tower runs with the first chunk. Each chunk is a one-row forward of mlx-lm's
language model over the prefix's embeddings; with M-RoPE under mlx-vlm's 3-D positions
(`replicas.engine.model.mrope`) and for Qwen3-VL with DeepStack's additions after the first
layers (`replicas.engine.model.deepstack`), and for Gemma under a mask with each image's tokens
attending to each other both ways (`replicas.engine.model.bidirectional`), a chunk then
ending before an image rather than inside it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from replicas.engine.model.bidirectional import chunk_end, overlaid
from replicas.engine.model.deepstack import deepstack_of
from replicas.engine.model.mrope import RowPositions

if TYPE_CHECKING:  # local imports this module
    from replicas.engine.batch.rows import Row


@dataclass
class Prefill:
    """A row whose prompt starts with embeddings (an image prefix), prefilled one chunk per
    engine loop, then inserted as a prefix cache hit."""

    row: Row
    cache: list[Any]
    done: int = 0  # positions prefilled so far
    embeddings: Any = None  # computed with the first chunk (with M-RoPE: and positions)


def prefill_chunk(model: nn.Module, prefill: Prefill, step: int, stream: mx.Stream,
                  positions: RowPositions | None) -> bool:
    """One chunk of about `step` positions of `prefill` into its cache; True when the
    prefix is done."""
    row = prefill.row
    assert row.embeddings is not None
    size, blocks = len(row.embeddings.key), row.embeddings.blocks
    start = prefill.done
    end = chunk_end(start, min(start + step, size), blocks)
    with mx.stream(stream):
        if prefill.embeddings is None:
            prefill.embeddings = row.embeddings.compute()
        # The embeddings; with M-RoPE their 3-D positions; with DeepStack its additions.
        embeddings, explicit, additions = (
            (*prefill.embeddings, None)[:3] if isinstance(prefill.embeddings, tuple)
            else (prefill.embeddings, None, None))
        stack = deepstack_of(model)
        with (positions.explicit(explicit[:, :, start:end])
              if positions is not None and explicit is not None else nullcontext()), \
             (stack.adding(additions[:, None, start:end])
              if stack is not None and additions is not None else nullcontext()):
            model(mx.array([row.prompt_ids[start:end]]),
                  cache=overlaid(prefill.cache, start, end, blocks),
                  input_embeddings=embeddings[None, start:end])
        mx.eval([c.state for c in prefill.cache])
    prefill.done = end
    return end >= size
