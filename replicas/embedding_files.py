"""Whether a model serves `/v1/embeddings`, and how: its config's `embeddings` pooling, or
else what its sentence-transformers files say.

An embedding checkpoint such as Qwen3-Embedding ships `modules.json`, which lists its
modules in order (the Transformer, a Pooling module in `1_Pooling/`, a Normalize module);
the Pooling module's `config.json` names the pooling (`pooling_mode_lasttoken: true`), and
`sentence_bert_config.json` the longest input (`max_seq_length`). A chat model has none of
these: it serves embeddings only when its config opts it in (`embeddings: last_token |
mean`), normalized, since OpenAI's clients compare vectors by dot product.

Plain files and no MLX: the app reads this at build time for `/v1/models`, and the replica
again once its model is on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicas.engine.config import Pooling

# What `replicas.sources.model_files` fetches of a Hub model to read this.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "*/config.json", "sentence_bert_config.json")
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' mode names (`pooling_mode_<name>`, or `pooling_mode: <name>` in
# newer files) -> the poolings Orchard computes (`replicas.engine.model.embedding`).
_MODES: dict[str, Pooling] = {"lasttoken": "last_token", "mean_tokens": "mean", "mean": "mean",
                               "cls_token": "cls", "cls": "cls"}


@dataclass(frozen=True)
class EmbeddingSpec:
    """How one model's vectors are made."""

    pooling: Pooling
    normalize: bool
    dimensions: bool  # Matryoshka: a request's `dimensions` truncates (config opts in)
    max_tokens: int | None  # sentence-transformers' `max_seq_length`; None: the context's


@dataclass(frozen=True)
class NotEmbedding:
    """Why a model serves no embeddings, for the 400."""

    reason: str


def embedding_support(directory: Path | None, configured: Pooling | None,
                      dimensions: bool = False) -> EmbeddingSpec | NotEmbedding:
    """`directory`: the model's files (None: not on disk); `configured`: its config's
    `embeddings`, which wins over its files; `dimensions`: its `embedding_dimensions`."""
    files = _read(directory) if directory is not None else None
    if configured is not None:
        normalize = files.normalize if files is not None else True
        max_tokens = files.max_tokens if files is not None else None
        return EmbeddingSpec(configured, normalize, dimensions, max_tokens)
    if files is None:
        return NotEmbedding("it is not an embedding model (no sentence-transformers pooling "
                            "in its files); set `embeddings: last_token`, `mean` or `cls` in its "
                            "config to serve embeddings from it")
    if isinstance(files.pooling, NotEmbedding):
        return files.pooling
    return EmbeddingSpec(files.pooling, files.normalize, dimensions, files.max_tokens)


def capabilities(spec: EmbeddingSpec | NotEmbedding, opted_in: bool) -> tuple[str, ...]:
    """What `/v1/models` says the model does: `text` (chat and completions) unless it is an
    embedding checkpoint (found by its files), and `embeddings` when it serves them; a chat
    model whose config opts it in (`opted_in`) does both."""
    if isinstance(spec, NotEmbedding):
        return ("text",)
    return ("text", "embeddings") if opted_in else ("embeddings",)


@dataclass(frozen=True)
class _Files:
    pooling: Pooling | NotEmbedding
    normalize: bool
    max_tokens: int | None


def _read(directory: Path) -> _Files | None:
    """What the sentence-transformers files say, or None when there are none."""
    modules = _json(directory / "modules.json")
    if not isinstance(modules, list):
        return None
    types = [m.get("type", "") for m in modules if isinstance(m, dict)]
    pooling_dir = next((m.get("path", "") for m in modules
                        if isinstance(m, dict) and m.get("type") == _POOLING), None)
    if pooling_dir is None:
        return None
    config = _json(directory / pooling_dir / "config.json")
    pooling = _pooling(config if isinstance(config, dict) else {})
    bert = _json(directory / "sentence_bert_config.json")
    length = bert.get("max_seq_length") if isinstance(bert, dict) else None
    return _Files(pooling, _NORMALIZE in types, length if isinstance(length, int) else None)


def _pooling(config: dict[str, Any]) -> Pooling | NotEmbedding:
    named = config.get("pooling_mode")
    modes = [named] if isinstance(named, str) else \
        [key.removeprefix("pooling_mode_") for key, on in config.items()
         if key.startswith("pooling_mode_") and on is True]
    if len(modes) == 1 and modes[0] in _MODES:
        return _MODES[modes[0]]
    found = ", ".join(modes) or "none"
    return NotEmbedding(f"its sentence-transformers pooling ({found}) is not one Orchard "
                        "computes; set `embeddings: last_token`, `mean` or `cls` in its "
                        "config")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
