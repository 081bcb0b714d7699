"""`builtin:embed-bert`: a tiny BERT sentence encoder, for tests and benchmarks of encoder
embeddings through mlx-embeddings (`replicas.encoder`).

mlx-embeddings' own `bert` model with random weights, the built-in tokenizer with a
post-processor that brackets every text as BERT's does (`<|im_start|>` standing for [CLS],
`<|endoftext|>` for [SEP]), and sentence-transformers' files naming CLS pooling and a
Normalize module, as BGE's checkpoints do. Orchard finds all of it from the files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, processors

from .build import ensure_scripted, save_random_model
from .embed_model import write_sentence_transformers
from .recipe import Architecture, RandomInit, Recipe
from .scripts import parse_scripts
from .tokenizer_files import (
    IM_START,
    PAD_TOKEN,
    token_id,
    train_tokenizer,
    training_texts,
    write_json,
    write_tokenizer_files,
)

log = logging.getLogger(__name__)

NAME = "embed-bert"
SHAPE = Recipe(
    name=NAME,
    architecture=Architecture(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                              max_position_embeddings=512, tie_word_embeddings=False),
    weights=RandomInit(logit_std=1.0),
    seed=20251126,
)


def ensure_encoder_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:embed-bert`, built first if missing (a second)."""
    return ensure_scripted(NAME, SHAPE, "bert cls", build_encoder_model, cache_dir,
                           expected="a second")


def build_encoder_model(out_dir: Path, scripts: str, key: str) -> None:
    from mlx_embeddings.models import bert

    arch = SHAPE.architecture
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2)
    write_tokenizer_files(tokenizer, out_dir, arch.max_position_embeddings)
    _bracket(out_dir / "tokenizer.json", tokenizer)
    config = bert_config(tokenizer, SHAPE, "BertModel")
    write_json(out_dir / "config.json", config)
    mx.random.seed(SHAPE.seed)
    model = bert.Model(bert.ModelArgs.from_dict(config))
    save_random_model(out_dir, dict(tree_flatten(model.parameters())), name=NAME, key=key,
                      seed=SHAPE.seed)
    write_sentence_transformers(out_dir, arch.hidden_size, pooling="cls_token",
                                max_seq_length=arch.max_position_embeddings)


def bert_config(tokenizer: Tokenizer, recipe: Recipe, architecture: str,
                **more: Any) -> dict[str, Any]:
    """A BERT `config.json` of `recipe`'s shape over the built-in tokenizer (`more`: the
    head's fields, e.g. a classifier's labels)."""
    arch = recipe.architecture
    return {
        "architectures": [architecture], "model_type": "bert",
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "intermediate_size": arch.intermediate_size, "hidden_act": "gelu",
        "max_position_embeddings": arch.max_position_embeddings, "type_vocab_size": 2,
        "layer_norm_eps": 1e-12, "pad_token_id": token_id(tokenizer, PAD_TOKEN),
        **more, "torch_dtype": recipe.dtype,
    }


def _bracket(path: Path, tokenizer: Tokenizer) -> None:
    """Every encoded text (with special tokens on) as `<|im_start|> text <|endoftext|>`:
    BERT's [CLS] text [SEP], with the built-in vocabulary's special tokens."""
    start, end = token_id(tokenizer, IM_START), token_id(tokenizer, PAD_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{IM_START} $A {PAD_TOKEN}", pair=f"{IM_START} $A {PAD_TOKEN} $B {PAD_TOKEN}",
        special_tokens=[(IM_START, start), (PAD_TOKEN, end)])
    tokenizer.save(str(path))
