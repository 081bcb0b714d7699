"""The prompt's own token logprobs (`echo` with `logprobs` on /v1/completions), from one
prefill. The echo's text and entries are the pipeline's (`replicas.pipeline.logprob_trail`).

A prompt is scored by one forward pass over it, in chunks, into a fresh KV cache: the
logits at position i give token i+1's logprob and its top alternatives. The KV that pass
built then goes into the prefix cache, so the generation that follows prefills one token
instead of the prompt again. mlx-lm's `BatchGenerator` keeps only the last position's
logits of a prefill, which is why this pass is our own.

The numbers are the model's raw distribution (no temperature, penalties or masks: nothing
was sampled at those positions), as vLLM reports prompt logprobs. The first token has no
logprob: nothing precedes it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from replicas.engine.sampling.logprobs import Picked, top_of

# Logits of one chunk are (chunk, vocab) float32: bound them, whatever the vocabulary.
_LOGITS_BYTES = 256 * 1024**2
_FIRST_CHUNK = 64


def score_prompt(model: nn.Module, prompt_ids: Sequence[int], top: int, max_chunk: int,
                 stream: mx.Stream,
                 make_cache: Callable[[nn.Module], list[Any]] = make_prompt_cache
                 ) -> tuple[list[Picked], list[Any]]:
    """Each prompt token's logprob after the first, with its `top` alternatives; and the
    KV cache of the whole prompt (one layer each, as `make_cache` builds it: the batch's
    kind, so the prefix cache can hand it to the batch)."""
    cache = make_cache(model)
    picked: list[Picked] = []
    ids = list(prompt_ids)
    with mx.stream(stream):
        chunk = min(max_chunk, _FIRST_CHUNK)  # until the vocabulary's size is known
        start = 0
        while start < len(ids):
            logits = model(mx.array(ids[start:start + chunk])[None], cache=cache)[0]
            # Later chunks keep their logits under the bound, whatever the vocabulary.
            chunk = max(1, min(max_chunk, _LOGITS_BYTES // (4 * logits.shape[-1])))
            # Position p predicts token p + 1; the prompt's last position predicts nothing.
            targets = ids[start + 1:start + logits.shape[0] + 1]
            if targets:
                rows = logits[:len(targets)].astype(mx.float32)
                picked += top_of(rows - mx.logsumexp(rows, axis=-1, keepdims=True),
                                 targets, top)
            start += logits.shape[0]
        mx.eval([c.state for c in cache])
    return picked, cache
