"""`builtin:rerank` and `builtin:cross-encoder`: tiny random-weight rerankers, for tests of
`/v1/rerank` (`replicas.reranker`).

- `rerank`: a qwen3 decoder laid out as Qwen3-Reranker is, made with mlx-lm's own class:
  the built-in tokenizer, its BPE also learned on the reranker's prompt text so that "yes"
  and "no" are single tokens (the two logits it scores), and a head drawn so logits spread
  (std 5) and the scores differ between documents. Served with `kind: rerank`.
- `cross-encoder`: mlx-embeddings' own `ModernBertForSequenceClassification` (one label,
  so the library's head ends in a sigmoid), with the built-in tokenizer bracketing a pair
  as BERT does ([CLS] query [SEP] document [SEP], with the built-in special tokens).
- `cross-encoder-bert`: a `BertForSequenceClassification` checkpoint as transformers saves
  one (`bert.` encoder weights, mlx-embeddings' `bert` class drawing them, a one-label
  `classifier`), its tokenizer writing token type ids 1 for the document, as ms-marco
  MiniLM's does (`replicas.cross_encoder` serves it).

Random weights give distinct, deterministic scores that mean nothing; nothing is trained.
Each builds in about a second, offline.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .build import ensure_scripted, save_random_model
from tokenizers import Tokenizer, processors

from .encoder_model import _bracket, bert_config
from .recipe import Architecture, RandomInit, Recipe
from .scripts import parse_scripts
from .tokenizer_files import EOS_TOKEN, IM_START, PAD_TOKEN, token_id, train_tokenizer, \
    training_texts, write_json, write_tokenizer_files

NAME = "rerank"
CROSS_ENCODER_NAME = "cross-encoder"
BERT_CROSS_ENCODER_NAME = "cross-encoder-bert"
RERANK = Recipe(
    name=NAME,
    architecture=Architecture(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              max_position_embeddings=4096, tie_word_embeddings=False),
    weights=RandomInit(logit_std=2.0),
    seed=20251205,
)
CROSS_ENCODER = Recipe(
    name=CROSS_ENCODER_NAME,
    architecture=Architecture(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                              max_position_embeddings=512, tie_word_embeddings=False),
    weights=RandomInit(logit_std=1.0),
    seed=20251206,
)
BERT_CROSS_ENCODER = replace(CROSS_ENCODER, name=BERT_CROSS_ENCODER_NAME, seed=20251207)
# Text the decoder's BPE also learns from: Qwen3-Reranker's turns (without their added
# tokens, which never go through BPE) and its two answers, each more than `min_frequency`.
_RERANK_TEXTS = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".",
    "<Instruct>: Given a web search query, retrieve relevant passages that answer the query"
    "\n<Query>: \n<Document>: ",
    "yes", "no", "yes", "no", "yes", "no",
)


def ensure_rerank_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:rerank`, built first if missing (a second)."""
    return _ensure(RERANK, "qwen3 yes/no reranker", _build_decoder, cache_dir)


def ensure_bert_cross_encoder_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:cross-encoder-bert`, built first if missing."""
    return _ensure(BERT_CROSS_ENCODER, "bert sequence classification", _build_bert,
                   cache_dir)


def ensure_cross_encoder_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:cross-encoder`, built first if missing."""
    return _ensure(CROSS_ENCODER, "modernbert sequence classification", _build_cross_encoder,
                   cache_dir)


def _ensure(recipe: Recipe, salt: str, builder: Any, cache_dir: Path | None) -> Path:
    return ensure_scripted(recipe.name, recipe, salt, builder, cache_dir, expected="a second")


def _build_decoder(out_dir: Path, scripts: str, key: str) -> None:
    from mlx_lm.models import qwen3

    arch = RERANK.architecture
    texts = [*training_texts(parse_scripts(scripts)), *_RERANK_TEXTS]
    tokenizer = train_tokenizer(texts, RERANK.max_vocab, RERANK.min_frequency)
    yes, no = token_id(tokenizer, "yes"), token_id(tokenizer, "no")  # KeyError: not learned
    eos_id = write_tokenizer_files(tokenizer, out_dir, arch.max_position_embeddings)
    pad_id = token_id(tokenizer, PAD_TOKEN)
    config = arch.config(tokenizer.get_vocab_size(), eos_id, pad_id, RERANK.dtype)
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": pad_id, "eos_token_id": [eos_id], "pad_token_id": pad_id})
    mx.random.seed(RERANK.seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    head = model.lm_head.weight
    # The final RMSNorm makes hidden states about sqrt(hidden) long: logits of std 2, so
    # the yes/no scores spread over (0, 1) instead of piling up at its ends.
    model.lm_head.weight = mx.random.normal(head.shape) * (2.0 / arch.hidden_size**0.5)
    save_random_model(out_dir, dict(tree_flatten(model.parameters())), name=NAME, key=key,
                      seed=RERANK.seed, yes_no_ids=[yes, no], eos=EOS_TOKEN)


def _build_cross_encoder(out_dir: Path, scripts: str, key: str) -> None:
    from mlx_embeddings.models import modernbert

    arch = CROSS_ENCODER.architecture
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2)
    write_tokenizer_files(tokenizer, out_dir, arch.max_position_embeddings)
    _bracket(out_dir / "tokenizer.json", tokenizer)
    config = {
        "architectures": ["ModernBertForSequenceClassification"], "model_type": "modernbert",
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "intermediate_size": arch.intermediate_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "classifier_pooling": "mean", "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
        "pad_token_id": token_id(tokenizer, PAD_TOKEN), "torch_dtype": CROSS_ENCODER.dtype,
        # [CLS] and [SEP] as the tokenizer writes them (ModernBERT's defaults are its own ids)
        **{key: token_id(tokenizer, IM_START) for key in ("bos_token_id", "cls_token_id")},
        **{key: token_id(tokenizer, PAD_TOKEN) for key in ("eos_token_id", "sep_token_id")},
    }
    write_json(out_dir / "config.json", config)
    mx.random.seed(CROSS_ENCODER.seed)
    model = modernbert.Model(modernbert.ModelArgs.from_dict(config))
    # The default init leaves the one logit near 0 for every pair: spread it (std about 2,
    # the head's LayerNorm makes its input about sqrt(hidden) long).
    model.classifier.weight = mx.random.normal(model.classifier.weight.shape) \
        * (2.0 / arch.hidden_size**0.5)
    save_random_model(out_dir, dict(tree_flatten(model.parameters())),
                      name=CROSS_ENCODER_NAME, key=key, seed=CROSS_ENCODER.seed)


def _build_bert(out_dir: Path, scripts: str, key: str) -> None:
    from mlx_embeddings.models import bert

    arch = BERT_CROSS_ENCODER.architecture
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2)
    write_tokenizer_files(tokenizer, out_dir, arch.max_position_embeddings)
    _segments(out_dir / "tokenizer.json", tokenizer)
    config = bert_config(tokenizer, BERT_CROSS_ENCODER, "BertForSequenceClassification",
                         id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    write_json(out_dir / "config.json", config)
    mx.random.seed(BERT_CROSS_ENCODER.seed)
    encoder = bert.Model(bert.ModelArgs.from_dict(config))
    drawn: dict[str, mx.array] = dict(tree_flatten(encoder.parameters()))
    weights = {f"bert.{k}": v for k, v in drawn.items()}
    # transformers' one-label head over the pooler output, drawn for logits of std ~2
    weights["classifier.weight"] = mx.random.normal((1, arch.hidden_size)) \
        * (4.0 / arch.hidden_size**0.5)
    weights["classifier.bias"] = mx.zeros((1,))
    save_random_model(out_dir, weights, name=BERT_CROSS_ENCODER_NAME, key=key,
                      seed=BERT_CROSS_ENCODER.seed)


def _segments(path: Path, tokenizer: Tokenizer) -> None:
    """BERT's pair encoding: `[CLS] A [SEP]` with token type 0, `B [SEP]` with type 1 (the
    built-in special tokens standing for [CLS] and [SEP], as `_bracket` writes them)."""
    start, end = token_id(tokenizer, IM_START), token_id(tokenizer, PAD_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{IM_START} $A {PAD_TOKEN}",
        pair=f"{IM_START} $A {PAD_TOKEN} $B:1 {PAD_TOKEN}:1",
        special_tokens=[(IM_START, start), (PAD_TOKEN, end)])
    tokenizer.save(str(path))
