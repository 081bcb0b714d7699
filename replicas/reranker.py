"""`/v1/rerank` in a replica: which kind of reranker the model is, each (query, document)
pair's tokens, the checks, and the forwards on the engine thread.

Two kinds (`replicas.rerank_scores` computes the scores):
- a decoder configured `kind: rerank` (Qwen3-Reranker and models laid out like it): each
  pair rendered in its prompt template, scored by its "yes"/"no" logits;
- a cross-encoder: an encoder checkpoint with a one-label sequence-classification head,
  ModernBERT's as mlx-embeddings implements it, BERT's and XLM-RoBERTa's on mlx-embeddings'
  encoders (`replicas.cross_encoder`: the library has no head for them).

Everything that can refuse a request runs before any engine time. A request's pairs run in
forwards planned as embeddings' are (sorted by length, bounded by rows and padded bytes),
one engine `call` each, so decode steps of running generations come between them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from replicas.contract import RerankRequest, RerankResult
from replicas.cross_encoder import SEQUENCE_CLASSIFIERS, labels
from replicas.engine.model.embedding import bytes_per_token, hidden_size, plan_batches
from replicas.engine.model.loading import LoadedModel
from replicas.errors import ContextLengthError, InternalError, InvalidRequestError
from replicas.options import ReplicaOptions
from replicas.rerank_scores import classifier_scores, yes_no_scores

log = logging.getLogger(__name__)

# Qwen3-Reranker's template, as its model card writes it: a system turn, the pair in the
# user turn, and the assistant turn opened after an empty think block.
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                "on the Query and the Instruct provided. Note that the answer can only be "
                "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Cross-encoder architectures: ModernBERT's head is mlx-embeddings' own, BERT's and
# XLM-RoBERTa's `replicas.cross_encoder`'s.
CLASSIFIER_ARCHITECTURES = frozenset({"ModernBertForSequenceClassification",
                                      *SEQUENCE_CLASSIFIERS})


def qwen3_pair_text(instruction: str | None, query: str, document: str) -> str:
    """The user turn's text for one pair (Qwen3-Reranker's `format_instruction`)."""
    return (f"<Instruct>: {instruction or QWEN3_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}")


@dataclass(frozen=True)
class YesNo:
    """A decoder reranker: the ids of its "yes" and "no" tokens."""

    yes: int
    no: int


@dataclass(frozen=True)
class Classifier:
    """A cross-encoder: an encoder with its classification head."""

    pad: int
    segments: bool  # BERT reads token type ids: 0 for the query, 1 for the document


@dataclass(frozen=True)
class Pair:
    """One (query, document) pair as the model reads it."""

    ids: tuple[int, ...]
    types: tuple[int, ...] | None = None  # a BERT pair's token type ids


@dataclass(frozen=True)
class NotReranker:
    reason: str


RerankKind = YesNo | Classifier | NotReranker


class RerankUnsupported(ValueError):
    """A model configured `kind: rerank` that cannot be one (the replica fails to load)."""


def is_cross_encoder(config: dict[str, Any]) -> bool:
    """A checkpoint with a one-label classification head served here (what `/v1/models`
    says before a replica loads it)."""
    return not CLASSIFIER_ARCHITECTURES.isdisjoint(config.get("architectures") or ()) \
        and labels(config) == 1


def rerank_kind(options: ReplicaOptions, model: LoadedModel, encoder: bool) -> RerankKind:
    """Which reranker the model is, from its config and tokenizer."""
    architectures = [str(a) for a in model.config.get("architectures") or ()]
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    if options.shard is not None:
        if options.kind == "rerank":
            raise RerankUnsupported("a sharded replica does not rerank; set shards: 1")
        return NotReranker("a sharded replica (`shards` > 1) does not rerank")
    if encoder and classifier:
        if CLASSIFIER_ARCHITECTURES.isdisjoint(architectures):
            return NotReranker(f"no classification head here for {', '.join(architectures)} "
                               f"(only {', '.join(sorted(CLASSIFIER_ARCHITECTURES))})")
        if labels(model.config) != 1:
            return NotReranker(f"its head has {labels(model.config)} labels; a reranker "
                               "scores one")
        return Classifier(int(model.config.get("pad_token_id") or 0),
                          "BertForSequenceClassification" in architectures)
    if options.kind == "rerank":
        if encoder:
            raise RerankUnsupported("`kind: rerank` on an encoder without a sequence-"
                                    "classification head")
        return _yes_no(model)
    return NotReranker("it is not a reranker (a Qwen3-Reranker-style model needs "
                       "`kind: rerank` in its config; a cross-encoder, a "
                       "sequence-classification head)")


def _yes_no(model: LoadedModel) -> YesNo:
    vocab = model.hf_tokenizer.get_vocab()
    missing = [t for t in ("yes", "no") if t not in vocab]
    if missing:
        raise RerankUnsupported(f"`kind: rerank` scores the \"yes\" and \"no\" tokens, and "
                                f"this tokenizer has no token {', '.join(missing)}")
    if not callable(getattr(model.model, "model", None)):
        raise RerankUnsupported(f"`kind: rerank`: the model class "
                                f"({type(model.model).__name__}) exposes no hidden states")
    return YesNo(int(vocab["yes"]), int(vocab["no"]))


# `Engine.call`: runs a function on the engine thread between steps.
EngineCall = Callable[[Callable[[], Any]], "Future[Any]"]


class Reranker:
    def __init__(self, model: LoadedModel, kind: RerankKind, max_tokens: int,
                 call: EngineCall) -> None:
        self._model = model
        self.kind = kind
        self.max_tokens = max_tokens  # one pair's tokens, at most
        self._call = call
        self._bytes_per_token = bytes_per_token(hidden_size(model.config) or 1)
        self.forwards = 0  # forwards run so far (tests see the pairs share them)
        tok = model.hf_tokenizer
        self._prefix = tuple(tok.encode(QWEN3_PREFIX, add_special_tokens=False)) \
            if isinstance(kind, YesNo) else ()
        self._suffix = tuple(tok.encode(QWEN3_SUFFIX, add_special_tokens=False)) \
            if isinstance(kind, YesNo) else ()

    @classmethod
    def open(cls, options: ReplicaOptions, model: LoadedModel, encoder: bool,
             context_length: int, call: EngineCall) -> "Reranker":
        return cls(model, rerank_kind(options, model, encoder), context_length, call)

    @property
    def serves(self) -> bool:
        return not isinstance(self.kind, NotReranker)

    async def rerank(self, request: RerankRequest) -> RerankResult:
        """Each document's score, in request order; raises `ReplicaError` for what the
        request got wrong (before any forward), lets `EngineDead` through."""
        kind = self.kind
        if isinstance(kind, NotReranker):
            raise InvalidRequestError(f"model '{request.model}' does not rerank: "
                                      f"{kind.reason}", param="model")
        pairs = await asyncio.to_thread(self.pairs, request)
        self._check(pairs)
        scores: list[float] = [0.0] * len(pairs)
        for batch in plan_batches([len(p.ids) for p in pairs], self._bytes_per_token):
            taken = [pairs[i] for i in batch]
            got = await asyncio.wrap_future(self._call(lambda: self._forward(taken)))
            for index, score in zip(batch, got):
                scores[index] = score
        return RerankResult(tuple(scores), sum(len(p.ids) for p in pairs))

    def _forward(self, pairs: list[Pair]) -> list[float]:
        """On the engine thread: one forward's scores."""
        self.forwards += 1
        kind = self.kind
        rows = [p.ids for p in pairs]
        try:
            if isinstance(kind, YesNo):
                return yes_no_scores(self._model.model, rows, kind.yes, kind.no)
            assert isinstance(kind, Classifier)
            types = [p.types or () for p in pairs] if kind.segments else None
            return classifier_scores(self._model.model.model.encoder, rows, kind.pad, types)
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            log.exception("rerank forward failed")
            raise InternalError("reranking failed for this request") from exc

    def pairs(self, request: RerankRequest) -> list[Pair]:
        """Each (query, document) pair's tokens, as the model's own code builds them:
        Qwen3-Reranker's prefix, pair text and suffix tokenized apart and joined; a
        cross-encoder's tokenizer encoding the two as a pair (with BERT's segment ids)."""
        tok = self._model.hf_tokenizer
        docs = [self._cut(d, request.max_tokens_per_doc) for d in request.documents]
        if isinstance(self.kind, YesNo):
            texts = [qwen3_pair_text(request.instruction, request.query, d) for d in docs]
            encoded = tok(texts, add_special_tokens=False)["input_ids"]
            return [Pair(self._prefix + tuple(ids) + self._suffix) for ids in encoded]
        encoded = tok([request.query] * len(docs), docs, add_special_tokens=True,
                      return_token_type_ids=True)
        types = encoded.get("token_type_ids") or [None] * len(docs)
        return [Pair(tuple(ids), tuple(t) if t is not None else None)
                for ids, t in zip(encoded["input_ids"], types)]

    def _cut(self, document: str, limit: int | None) -> str:
        """The document's text up to the end of its `limit`-th token (the text, so the
        pair is tokenized as a whole, as without a limit)."""
        if limit is None:
            return document
        spans = self._model.hf_tokenizer(document, add_special_tokens=False,
                                         return_offsets_mapping=True)["offset_mapping"]
        return document if len(spans) <= limit else document[:spans[limit - 1][1]]

    def _check(self, pairs: Sequence[Pair]) -> None:
        for index, pair in enumerate(pairs):
            if len(pair.ids) > self.max_tokens:
                raise ContextLengthError(
                    f"documents[{index}] with the query is {len(pair.ids)} tokens; this model "
                    f"reads at most {self.max_tokens} (set `max_tokens_per_doc` to cut "
                    "documents)", param="documents")
