"""Model loading: one code path for built-in models, local paths and Hub repo ids (each
resolved to a directory or repo id by `replicas.sources` before it gets here)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm import load as mlx_load
from mlx_lm.tokenizer_utils import TokenizerWrapper

from replicas.engine.model.mla import absorb_short_passes
from replicas.startup import Progress

@dataclass(frozen=True)
class LoadedModel:
    source: str
    path: Path
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict[str, Any] = field(repr=False)
    context_length: int
    vocab_size: int  # the logits width, which may exceed the tokenizer's vocabulary
    eos_token_ids: frozenset[int]

    @property
    def hf_tokenizer(self) -> Any:
        return self.tokenizer._tokenizer

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf_tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None


def load_model(source: str, resolved: Path | str) -> LoadedModel:
    """`source` as configured, loaded from `resolved` (`replicas.sources.resolve_source`)."""
    with Progress(f"loading model {source} from {resolved}"):
        loaded = mlx_load(str(resolved), return_config=True)
    assert len(loaded) == 3  # model, tokenizer, config: what return_config=True asks for
    model, tokenizer, config = loaded
    return loaded_model(source, resolved, model, tokenizer, config)


def loaded_model(source: str, resolved: Path | str, model: nn.Module,
                 tokenizer: TokenizerWrapper, config: dict[str, Any]) -> LoadedModel:
    """What mlx-lm loaded (whole or one shard), with what serving needs to know of it."""
    absorb_short_passes(model)  # MLA's verifying passes stay in the latent space
    path = Path(resolved) if isinstance(resolved, Path) else Path(getattr(model, "model_path", "."))
    eos = set(tokenizer.eos_token_ids)
    eos |= _generation_config_eos(resolved)
    return LoadedModel(
        source=source,
        path=path,
        model=model,
        tokenizer=tokenizer,
        config=config,
        context_length=_context_length(config),
        vocab_size=_vocab_size(config, tokenizer),
        eos_token_ids=frozenset(eos),
    )


def _generation_config_eos(resolved: Path | str) -> set[int]:
    # generation_config.json may list more EOS ids than the tokenizer (e.g. <|endoftext|>).
    path = Path(resolved) / "generation_config.json"
    if not path.is_file():
        return set()
    value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


# RoBERTa-style encoders number positions from `pad_token_id + 1` (positions 0..pad are
# never used), so `max_position_embeddings` of 514 holds 512 tokens.
_PAD_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert"})


def _context_length(config: dict[str, Any]) -> int:
    text_config = config.get("text_config", config)
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if isinstance(text_config.get(key), int):
            if text_config.get("model_type") in _PAD_OFFSET_POSITIONS:
                return int(text_config[key]) - int(text_config.get("pad_token_id", 1)) - 1
            return int(text_config[key])
    return 4096


def _vocab_size(config: dict[str, Any], tokenizer: TokenizerWrapper) -> int:
    text_config = config.get("text_config", config)
    if isinstance(text_config.get("vocab_size"), int):
        return int(text_config["vocab_size"])
    return len(tokenizer._tokenizer)
