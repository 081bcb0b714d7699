"""Embeddings from a model's hidden states: one batched forward of the transformer body
(no LM head), pooled per input and L2-normalized where the model says so.

Runs on the engine thread (`Engine.call`), the sole owner of MLX in a replica; the replica
above it tokenizes, checks and plans the batches (`replicas.embedder`).

Padding goes on the right. Under the causal mask a real token attends only to positions
before it, so pads after it change nothing, and every input keeps the positions (RoPE
offsets) it has alone: the plain causal mask is exact, and pooling reads real positions
only (the true last token, or a mean masked to the input's length). Left padding would need
a padding mask and shifted positions in every attention layer, as mlx-lm's batch caches do
for generation.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Sequence, get_args

import mlx.core as mx
import mlx.nn as nn

from replicas.engine.config import Pooling

POOLINGS: tuple[Pooling, ...] = get_args(Pooling)

# Inputs in one forward, and the padded hidden states' bytes in one forward (rows x longest
# input x hidden x 4: the float32 states pooling reads). Several forwards serve a larger
# request, and decode steps of the running generations come between them.
MAX_ROWS = 64
MAX_BATCH_BYTES = 64 * 1024**2
# sentence-transformers' Normalize (torch's F.normalize) divides by max(norm, 1e-12).
_NORM_EPS = 1e-12


@dataclass(frozen=True)
class PoolingSpec:
    pooling: Pooling
    normalize: bool  # L2-normalize each vector (the model's own Normalize module)


class NoHiddenStates(ValueError):
    """The model class does not expose its transformer body as `model.model`."""


def plan_batches(lengths: Sequence[int], bytes_per_token: int, max_rows: int = MAX_ROWS,
                 max_bytes: int = MAX_BATCH_BYTES) -> list[list[int]]:
    """The inputs' indexes grouped into forwards: sorted by length (least padding), each
    group at most `max_rows` with its padded size (rows x longest x `bytes_per_token`)
    within `max_bytes`. An input past the bound alone still gets a forward of its own (its
    length is already within the model's context)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        rows = len(current) + 1
        # Sorted ascending, so this input is the group's longest.
        if current and (rows > max_rows or rows * lengths[index] * bytes_per_token > max_bytes):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def hidden_size(config: dict[str, Any]) -> int | None:
    """The width of the model's hidden states, the vectors' dimension (None: its config
    names none under the usual keys)."""
    text_config = config.get("text_config", config)
    for key in ("hidden_size", "d_model", "n_embd", "dim"):
        if isinstance(text_config.get(key), int):
            return int(text_config[key])
    return None


def bytes_per_token(width: int) -> int:
    """Padded bytes per token that `plan_batches` bounds: the float32 hidden states."""
    return 4 * width


def embed_rows(model: nn.Module, rows: Sequence[Sequence[int]], spec: PoolingSpec,
               dimensions: int | Sequence[int | None] | None = None) -> list[list[float]]:
    """One vector per row of token ids (each non-empty), from one forward.

    `dimensions`: Matryoshka truncation, the first N values then re-normalized; one for
    all rows, or one per row (rows of several requests share a forward)."""
    if dimensions is not None and not isinstance(dimensions, int):
        whole = embed_rows(model, rows, spec)
        return [v if d is None else _truncated(v, d) for v, d in zip(whole, dimensions)]
    body = getattr(model, "model", None)
    if not callable(body):
        raise NoHiddenStates(f"{type(model).__name__} exposes no transformer body (`model.model`)")
    lengths = [len(row) for row in rows]
    width = max(lengths)
    padded = mx.array([list(row) + [0] * (width - len(row)) for row in rows])  # right pads
    # A causal decoder's real tokens never see the right padding; an encoder's would, so it
    # takes the lengths for its attention mask (`replicas.encoder`).
    hidden = (body(padded, lengths=mx.array(lengths)) if getattr(body, "bidirectional", False)
              else body(padded)).astype(mx.float32)  # (rows, width, hidden), final norm
    pooled = pool(hidden, mx.array(lengths), spec.pooling)
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    if spec.normalize or dimensions is not None:
        pooled = l2_normalize(pooled)
    mx.eval(pooled)
    vectors: list[list[float]] = pooled.tolist()  # type: ignore[assignment]
    return vectors


def pool(hidden: mx.array, lengths: mx.array, pooling: Pooling) -> mx.array:
    """(rows, width, hidden) right-padded states -> (rows, hidden), reading real tokens only."""
    if pooling == "last_token":
        return hidden[mx.arange(hidden.shape[0]), lengths - 1]
    if pooling == "cls":  # an encoder's first token ([CLS]), as BERT-style models pool
        return hidden[:, 0]
    real = mx.arange(hidden.shape[1])[None, :] < lengths[:, None]
    return (hidden * real[..., None]).sum(axis=1) / lengths[:, None].astype(mx.float32)


def _truncated(vector: list[float], dimensions: int) -> list[float]:
    """The first `dimensions` values, re-normalized (as `embed_rows` does with one `dimensions`
    for all rows: normalizing before is a scale, which the re-normalizing undoes)."""
    head = vector[:dimensions]
    norm = max(math.sqrt(math.fsum(x * x for x in head)), _NORM_EPS)
    return [x / norm for x in head]


def l2_normalize(vectors: mx.array) -> mx.array:
    norms = mx.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / mx.maximum(norms, _NORM_EPS)
