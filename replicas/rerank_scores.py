"""Relevance scores from one batched forward, for the two kinds of reranker
(`replicas.reranker` tokenizes, checks and plans the batches; these run on the engine
thread, the sole owner of MLX in a replica).

- A decoder reranker (Qwen3-Reranker): the probability of "yes" against "no" as the next
  token after the prompt, `softmax([logit_no, logit_yes])[1]`, as its model card computes
  it. Rows are padded on the right: under the causal mask a real token never attends to a
  pad after it and keeps its RoPE positions, so each row scores as it would alone (see
  `replicas.engine.model.embedding`). Only the last real position of each row goes
  through the LM head.
- A cross-encoder with a sequence-classification head (mlx-embeddings' ModernBERT, or
  `replicas.cross_encoder`'s BERT and XLM-RoBERTa): the head's one label through a sigmoid
  (the library applies it for ModernBERT). Its tokens attend both ways, so the padding is
  masked out of attention.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn


def _padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[mx.array, mx.array]:
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids = mx.array([list(r) + [pad] * (width - len(r)) for r in rows], dtype=mx.int32)
    return ids, mx.array(lengths, dtype=mx.int32)


def head_logits(model: Any, hidden: mx.array) -> mx.array:
    """The LM head over hidden states, as mlx-lm's model applies it: its own `lm_head`, or
    the embedding matrix where the weights are tied (Qwen3-Reranker-0.6B's are)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        return head(hidden)  # type: ignore[no-any-return]
    return model.model.embed_tokens.as_linear(hidden)  # type: ignore[no-any-return]


def yes_no_scores(model: Any, rows: Sequence[Sequence[int]], yes: int, no: int,
                  pad: int = 0) -> list[float]:
    """P(yes) against P(no) at each row's last token: one forward for all rows."""
    ids, lengths = _padded(rows, pad)
    hidden = model.model(ids)  # (rows, width, hidden), causal
    last = hidden[mx.arange(len(rows)), lengths - 1]  # each row's last real position
    logits = head_logits(model, last)
    pair = mx.stack([logits[:, no], logits[:, yes]], axis=-1).astype(mx.float32)
    return _floats(mx.softmax(pair, axis=-1)[:, 1])


def classifier_scores(encoder: Any, rows: Sequence[Sequence[int]], pad: int = 0,
                      types: Sequence[Sequence[int]] | None = None) -> list[float]:
    """The classification head's score per (query, document) pair: one forward, the
    padding masked out of attention (and out of the head's pooling); `types`: BERT's
    token type ids, where the model reads them."""
    ids, lengths = _padded(rows, pad)
    mask = (mx.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(mx.float32)
    extra = {} if types is None else {"token_type_ids": _padded(types, 0)[0]}
    out = encoder(ids, attention_mask=mask, **extra).pooler_output  # (rows, 1), activated
    return _floats(out[:, 0].astype(mx.float32))


def _floats(values: mx.array) -> list[float]:
    listed: list[float] = values.tolist()  # type: ignore[assignment]  # 1-D: floats
    return [float(v) for v in listed]
