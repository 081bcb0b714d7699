"""`builtin:embed`: a tiny embedding model laid out as Qwen3-Embedding is, for tests and
benchmarks of `/v1/embeddings`.

A qwen3 model (2 layers, hidden 256) with random weights and the built-in tokenizer, plus
what makes Qwen3-Embedding an embedding checkpoint: sentence-transformers' `modules.json`
(Transformer, Pooling, Normalize), `1_Pooling/config.json` with last-token pooling, a
`sentence_bert_config.json` with its longest input, and a tokenizer that appends
`<|endoftext|>` to every text (the token last-token pooling reads). Orchard finds all of it
from the files (`replicas.embedding_files`), as for the real checkpoint. Random weights
still give distinct, deterministic vectors; nothing here is trained.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer, processors

from ..startup import Progress
from .build import build, cached_build, default_cache_root
from .recipe import Architecture, RandomInit, Recipe, cache_key
from .scripts import parse_scripts, scripts_text
from .tokenizer_files import PAD_TOKEN, write_json

log = logging.getLogger(__name__)

NAME = "embed"
EMBED = Recipe(
    name=NAME,
    architecture=Architecture(
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        tie_word_embeddings=False,  # random weights want an untied head; pooling never reads it
    ),
    weights=RandomInit(logit_std=5.0),
    seed=20250801,
)
# Its longest input (sentence-transformers' `max_seq_length`), below the context, as
# embedding checkpoints set one.
MAX_SEQ_LENGTH = 2048


def ensure_embed_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:embed`, built first if missing (a second or two)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    text = scripts_text()
    key = cache_key(EMBED, text)

    def make(tmp: Path) -> None:
        with Progress(f"building the built-in model builtin:{NAME}",
                      f"once (cached in {root}), a few seconds"):
            build(EMBED, parse_scripts(text), tmp, key)
            write_sentence_transformers(tmp, EMBED.architecture.hidden_size)
            _append_eos(tmp / "tokenizer.json")

    return cached_build(root, key, make)


def write_sentence_transformers(directory: Path, hidden_size: int, pooling: str = "lasttoken",
                                max_seq_length: int = MAX_SEQ_LENGTH) -> None:
    """The files that make `directory` an embedding checkpoint, as Qwen3-Embedding's
    (`pooling`: sentence-transformers' mode name, `lasttoken` or `cls_token`)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    (directory / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (directory / "1_Pooling").mkdir()
    write_json(directory / "1_Pooling" / "config.json", {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": pooling == "cls_token",
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken", "include_prompt": True})
    (directory / "2_Normalize").mkdir()
    write_json(directory / "sentence_bert_config.json",
               {"max_seq_length": max_seq_length, "do_lower_case": False})


def _append_eos(path: Path) -> None:
    """Every encoded text ends with `<|endoftext|>` (with special tokens on), as
    Qwen3-Embedding's tokenizer does: its hidden state is the vector."""
    tokenizer = Tokenizer.from_file(str(path))
    eos = tokenizer.token_to_id(PAD_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {PAD_TOKEN}", pair=f"$A {PAD_TOKEN} $B {PAD_TOKEN}",
        special_tokens=[(PAD_TOKEN, eos)])
    tokenizer.save(str(path))
    log.info("builtin:%s: the tokenizer appends %s (id %d)", NAME, PAD_TOKEN, eos)
