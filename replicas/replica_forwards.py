"""A replica's calls that run no generation: the tokenizer's (`/tokenize`, `/detokenize`,
`/tokenizer_info`) and the forwards-only ones (`/v1/embeddings` through
`replicas.embedder`, `/v1/rerank` through `replicas.reranker`), each answering with its
result or its failure as an event."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from replicas.contract import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorKind,
    Failed,
    GenerationRequest,
    RerankRequest,
    RerankResult,
    TextPrompt,
    TokenizerInfo,
)
from replicas.embedder import Embedder
from replicas.engine.core import EngineDead
from replicas.engine.model.loading import LoadedModel
from replicas.errors import ReplicaError
from replicas.pipeline.prepare import InputProcessor
from replicas.reranker import Reranker
from replicas.tokenizer_api import decode_ids, describe_tokenizer, encode_plain


class Forwards:
    """`served_context`: the context requests get now (it shrinks with KV memory)."""

    def __init__(self, model: LoadedModel, inputs: InputProcessor, embedder: Embedder,
                 reranker: Reranker, served_context: Callable[[], int]) -> None:
        self._model = model
        self._inputs = inputs
        self.embedder = embedder
        self.reranker = reranker
        self._served_context = served_context

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...] | Failed:
        """The prompt's token ids as generation would run them (`add_special_tokens`
        false: a text prompt without the tokenizer's BOS), or why it cannot be rendered."""
        try:
            if not add_special_tokens and isinstance(request.prompt, TextPrompt):
                return await asyncio.to_thread(encode_plain, self._model.hf_tokenizer,
                                               request.prompt.text)
            rendered = await asyncio.to_thread(self._inputs.render, request)
        except ReplicaError as exc:
            return exc.as_event()
        return rendered.token_ids

    async def detokenize(self, token_ids: tuple[int, ...]) -> str | Failed:
        """The ids' text, special tokens kept, or a 400 for an id outside the vocabulary."""
        try:
            return await asyncio.to_thread(decode_ids, self._model.hf_tokenizer,
                                           self._model.vocab_size, token_ids)
        except ReplicaError as exc:
            return exc.as_event()

    def tokenizer_info(self) -> TokenizerInfo:
        return describe_tokenizer(self._model, self._served_context())

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | Failed:
        """`/v1/embeddings`: the vectors, or why not (`replicas.embedder`)."""
        return await _answered(self.embedder.embed(request))

    async def rerank(self, request: RerankRequest) -> RerankResult | Failed:
        """`/v1/rerank`: each document's score, or why not (`replicas.reranker`)."""
        return await _answered(self.reranker.rerank(request))


_Answer = TypeVar("_Answer", EmbeddingResult, RerankResult)


async def _answered(call: Awaitable[_Answer]) -> _Answer | Failed:
    """A forwards-only call's answer, or its failure as an event."""
    try:
        return await call
    except ReplicaError as exc:
        return exc.as_event()
    except EngineDead as exc:  # fail fast: Serve replaces this replica on its health check
        return Failed(ErrorKind.INTERNAL, f"the model is unavailable: {exc}", replica_fault=True)
