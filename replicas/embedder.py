"""`/v1/embeddings` in a replica: tokenize, check, queue the inputs, run forwards on the
engine thread, truncate where asked.

Everything that can refuse a request runs before any engine time: a model that serves no
embeddings, `dimensions` it does not allow, an empty input, one past the model's input
length, a token id outside the vocabulary. Accepted inputs join one queue for the replica,
and each engine `call` runs one forward over what is queued then, whichever requests it
came from (`replicas.embedding_queue`: the oldest request's inputs first, the room left
to later ones, bounded by rows and padded bytes), so many small requests at once share
forwards, no request waits behind later ones, and the decode steps of running generations
come between the forwards of a large one. A request cancelled while it waits (its client
left) takes its queued inputs with it. The pooling is `replicas.engine.model.embedding`'s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from replicas.contract import EmbeddingInput, EmbeddingRequest, EmbeddingResult
from replicas.embedding_files import SENTENCE_TRANSFORMERS_FILES, EmbeddingSpec, \
    NotEmbedding, embedding_support
from replicas.embedding_queue import EmbeddingQueue, Queued
from replicas.engine.model.embedding import PoolingSpec, bytes_per_token, embed_rows, hidden_size
from replicas.engine.core import EngineDead
from replicas.engine.model.loading import LoadedModel
from replicas.errors import ContextLengthError, InternalError, InvalidRequestError
from replicas.options import ReplicaOptions
from replicas.pipeline.prompt import encodable
from replicas.sources import model_files
from replicas.timings import Timings

log = logging.getLogger(__name__)

# `Engine.call`: runs a function on the engine thread between steps.
EngineCall = Callable[[Callable[[], Any]], "Future[Any]"]


@dataclass
class _Job:
    """One request's vectors, filled in as forwards finish (on the engine thread)."""

    request_id: str
    dimensions: int | None
    vectors: list[list[float] | None]
    done: "Future[list[list[float]]]" = field(default_factory=Future)

    def place(self, index: int, vector: list[float]) -> None:
        self.vectors[index] = vector
        if all(v is not None for v in self.vectors) and not self.done.done():
            self.done.set_result([v for v in self.vectors if v is not None])


class Embedder:
    def __init__(self, model: LoadedModel, support: EmbeddingSpec | NotEmbedding,
                 context_length: int, call: EngineCall,
                 timings: Timings) -> None:
        self._lock = threading.Lock()  # the queue: requests add, the engine thread takes
        self.forwards = 0  # forwards run so far (tests see requests share them)
        # The model's pooling (unused where it serves no embeddings: `_spec` refuses first).
        self._pooling = PoolingSpec(support.pooling, support.normalize) \
            if isinstance(support, EmbeddingSpec) else PoolingSpec("last_token", True)
        self._model = model
        self._support = support
        self._call = call
        self._timings = timings
        self._width = hidden_size(model.config) or 0  # known wherever `support` is a spec
        self._queue: EmbeddingQueue[_Job] = EmbeddingQueue(bytes_per_token(self._width))
        limit = support.max_tokens if isinstance(support, EmbeddingSpec) else None
        # The model's input length: its context, or less where its files say so.
        self.max_tokens = context_length if limit is None else min(limit, context_length)

    @classmethod
    def open(cls, options: ReplicaOptions, model: LoadedModel, context_length: int,
             call: EngineCall, timings: Timings) -> "Embedder":
        return cls(model, replica_support(options, model), context_length, call, timings)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """The vectors, in input order; raises `ReplicaError` for what the request got
        wrong, and lets `EngineDead` through (the replica's fault, not the request's)."""
        self._spec(request)
        rows = await asyncio.to_thread(self._tokenize, request.inputs)
        self._check(rows)
        job = _Job(request.request_id, request.dimensions, [None] * len(rows))
        with self._lock:
            self._queue.add(job, rows)
        self._run_one()
        try:
            vectors = await asyncio.wrap_future(job.done)
        except asyncio.CancelledError:  # the client left (Serve cancels the call): drop it
            with self._lock:
                dropped = self._queue.drop(job)
            log.debug("request %s cancelled: %d queued inputs dropped", job.request_id, dropped)
            raise
        tokens = sum(len(r) for r in rows)
        self._timings.embedded(len(rows), tokens)
        return EmbeddingResult(tuple(tuple(v) for v in vectors), tokens)

    def _run_one(self) -> None:
        """One forward over the queue's head, on the engine thread; the queue's requests
        fail with the engine if it cannot run it."""
        try:
            self._call(self._forward).add_done_callback(self._engine_failed)
        except EngineDead as exc:
            self._fail_queued(exc)

    def _engine_failed(self, call: "Future[Any]") -> None:
        exc = call.exception()
        if isinstance(exc, EngineDead):
            self._fail_queued(exc)

    def _fail_queued(self, exc: BaseException) -> None:
        with self._lock:
            jobs = self._queue.clear()
        for job in jobs:
            if not job.done.done():
                job.done.set_exception(exc)

    def _forward(self) -> None:
        """On the engine thread: a forward over the first planned batch of the queue, each
        vector to its request; another call queued if inputs remain."""
        with self._lock:
            taken: list[Queued[_Job]] = self._queue.take()
            if not taken:
                return  # an earlier call took these inputs, or their requests left
            more = len(self._queue) > 0
        if more:
            self._run_one()
        self.forwards += 1
        try:
            vectors = embed_rows(self._model.model, [q.ids for q in taken], self._pooling,
                                 [q.job.dimensions for q in taken])
        except Exception:  # noqa: BLE001 - these requests fail alone
            for job in {id(q.job): q.job for q in taken}.values():
                log.exception("request %s: embedding failed", job.request_id)
                with self._lock:
                    self._queue.drop(job)  # its other inputs would be forwards for nothing
                if not job.done.done():
                    job.done.set_exception(InternalError("embedding failed for this request"))
            return
        for queued, vector in zip(taken, vectors):
            queued.job.place(queued.index, vector)

    def _spec(self, request: EmbeddingRequest) -> EmbeddingSpec:
        support = self._support
        if isinstance(support, NotEmbedding):
            raise InvalidRequestError(f"model '{request.model}' does not serve embeddings: "
                                      f"{support.reason}", param="model")
        wanted = request.dimensions
        if wanted is not None:
            if not support.dimensions:
                raise InvalidRequestError(
                    f"model '{request.model}' does not support `dimensions` (its vectors are "
                    f"{self._width} wide; a model trained Matryoshka-style allows it with "
                    "`embedding_dimensions: true` in its config)", param="dimensions")
            if not 1 <= wanted <= self._width:
                raise InvalidRequestError(f"`dimensions` must be between 1 and {self._width} "
                                          f"for model '{request.model}'", param="dimensions")
        return support

    def _tokenize(self, inputs: Sequence[EmbeddingInput]) -> list[tuple[int, ...]]:
        """Each input's ids: a text through the tokenizer with its special tokens (an
        embedding checkpoint's tokenizer appends the token it pools, as Qwen3-Embedding's
        does), token ids as sent."""
        texts = [(i, encodable(x, "input")) for i, x in enumerate(inputs) if isinstance(x, str)]
        rows: list[tuple[int, ...]] = [x if not isinstance(x, str) else () for x in inputs]
        if texts:
            # One call for every text: the fast tokenizer encodes a batch in parallel.
            encoded = self._model.hf_tokenizer([t for _, t in texts], add_special_tokens=True)
            for (index, _), ids in zip(texts, encoded["input_ids"]):
                rows[index] = tuple(ids)
        return rows

    def _check(self, rows: Sequence[tuple[int, ...]]) -> None:
        vocab = self._model.vocab_size
        for index, row in enumerate(rows):
            where = f"input[{index}]" if len(rows) > 1 else "input"
            if not row:
                raise InvalidRequestError(f"{where} has no tokens", param="input")
            if len(row) > self.max_tokens:
                raise ContextLengthError(
                    f"{where} has {len(row)} tokens; this model embeds at most "
                    f"{self.max_tokens}", param="input")
            bad = next((t for t in row if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"{where}: token id {bad} is outside the vocabulary "
                                          f"(0..{vocab - 1})", param="input")


def replica_support(options: ReplicaOptions, model: LoadedModel) -> EmbeddingSpec | NotEmbedding:
    """Whether this replica serves embeddings: its config, else its model's files."""
    if options.shard is not None:
        # rank 0 alone holds no whole model, and a forward would need every rank in step
        return NotEmbedding("a sharded replica (`shards` > 1) does not serve embeddings; "
                            "serve the model unsharded for them")
    if not callable(getattr(model.model, "model", None)) or hidden_size(model.config) is None:
        return NotEmbedding(f"its model class ({type(model.model).__name__}) exposes no "
                            "hidden states (`model.model` and the config's `hidden_size`)")
    directory = model.path if (model.path / "config.json").is_file() else None
    if directory is None:  # a Hub model: mlx-lm fetched its JSON files with the weights
        try:
            directory = model_files(options.source, SENTENCE_TRANSFORMERS_FILES)
        except Exception:  # noqa: BLE001 - no files is a plain answer: not an embedding model
            log.warning("model %s: reading its sentence-transformers files failed",
                        options.model_id, exc_info=True)
    return embedding_support(directory, options.embeddings, options.embedding_dimensions)
