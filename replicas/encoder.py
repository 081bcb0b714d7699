"""Encoder embedding models (BERT, XLM-RoBERTa, ModernBERT): loaded through mlx-embeddings,
served by `/v1/embeddings` only (or, a cross-encoder checkpoint, by `/v1/rerank`:
`replicas.reranker`).

mlx-lm loads decoders; the sentence encoders many retrieval pipelines still run (BGE,
E5, all-MiniLM, nomic) are encoders, which mlx-embeddings implements in MLX. Such a replica
has no generation: its engine thread runs the embedding forwards alone (`Engine.call`, as
for any model), its batch refuses rows, and a chat or completion request is a 400. The
pooling is Orchard's (`replicas.engine.model.embedding`, as the model's sentence-transformers
files name it, `cls` included), over the encoder's last hidden states, with the padding
masked out of attention: an encoder's tokens see both ways, so right padding would reach them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_tokenizer

from replicas.engine.stats import DecodeCounts
from replicas.engine.batch.local import Prefill
from replicas.engine.batch.rows import Done, Row
from replicas.engine.kv.layout import KvLayout
from replicas.engine.model.loading import LoadedModel, loaded_model
from replicas.engine.sampling.logprobs import Picked
from replicas.engine.kv.budget import KvBudget, RankMemory, default_budget, machine
from replicas.engine.kv.prefix_cache import PromptCache
from replicas.errors import InvalidRequestError
from replicas.startup import Progress

# config.json model types served this way (mlx-embeddings 0.1.0 implements them).
ENCODER_MODEL_TYPES: frozenset[str] = frozenset({"bert", "xlm-roberta", "modernbert"})
# What an encoder's Hub snapshot needs: weights, config, tokenizer, sentence-transformers'.
ENCODER_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*/config.json")


def is_encoder(config: dict[str, Any]) -> bool:
    return str(config.get("model_type", "")) in ENCODER_MODEL_TYPES


class EncoderBody(nn.Module):
    """The encoder as `embed_rows` drives a model's body: ids (right padded) and each row's
    length in, last hidden states out."""

    bidirectional = True  # `embed_rows` passes the lengths for the attention mask

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def __call__(self, ids: mx.array, lengths: mx.array | None = None) -> mx.array:
        width = ids.shape[1]
        mask = None if lengths is None else \
            (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)
        return self.encoder(ids, attention_mask=mask).last_hidden_state  # type: ignore[no-any-return]


class EncoderModel(nn.Module):
    """What a replica holds as its model: `model` is the body embeddings read."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.model = EncoderBody(encoder)


def load_encoder(source: str, path: Path, config: dict[str, Any]) -> LoadedModel:
    """The encoder through mlx-embeddings, and its tokenizer as mlx-lm wraps one (a BERT or
    XLM-RoBERTa cross-encoder: the library's encoder under HF's head, `cross_encoder.py`)."""
    from mlx_embeddings.utils import load_model

    from replicas.cross_encoder import classifier_architecture, load_sequence_classifier

    with Progress(f"loading encoder model {source} from {path}"):
        encoder = load_sequence_classifier(path, config) \
            if classifier_architecture(config) is not None else load_model(path)
        tokenizer = load_tokenizer(path)
    return loaded_model(source, path, EncoderModel(encoder), tokenizer, config)


def encoder_memory(model: nn.Module, configured: int | None) -> RankMemory:
    """An encoder keeps no KV between forwards: no per-token cache, its budget the
    activations' room (what admission would give a decoder's KV)."""
    params: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    weights = sum(v.nbytes for v in params.values())
    budget = configured if configured is not None else default_budget(machine(), weights)
    return RankMemory(max(budget, 1), KvLayout(0, (), 0), weights)


class NoGeneration:
    """The batch of a replica that only embeds: always empty, refusing rows (the replica
    answers generation requests with a 400 before they get here)."""

    cache: PromptCache | None = None
    empty = True

    def begin(self, row: Row) -> Prefill | None:
        raise InvalidRequestError("this model serves embeddings only (/v1/embeddings)")

    def advance(self, prefill: Prefill) -> bool:
        raise InvalidRequestError("this model serves embeddings only (/v1/embeddings)")

    def insert(self, rows: Sequence[Row]) -> list[tuple[int, int]]:
        raise InvalidRequestError("this model serves embeddings only (/v1/embeddings)")

    def step(self) -> list[Any]:
        return []

    def decode_counts(self) -> DecodeCounts:
        return DecodeCounts(False, 0, 0, 0, 0, 0, 0)

    def finish(self, done: Sequence[Done]) -> None:
        return None

    def score(self, prompt_ids: Sequence[int], top: int,
              adapter: str | None = None) -> list[Picked]:
        raise InvalidRequestError("this model serves embeddings only (/v1/embeddings)")

    def recover(self) -> bool:
        return True

    def bound_cache(self, nbytes: int) -> None:
        return None

    def page(self, kv: KvBudget, context_length: int) -> None:
        return None  # no KV: nothing to page

    def close(self) -> None:
        return None
