"""ModelReplica: one model, one engine thread, an async stream of events per request.

Each request is prepared first (`replicas.pipeline.prepare`: everything that can reject it runs
there, before any engine time), then submitted to the engine, whose events come back
coalesced. On a sharded replica this is rank 0; its batch keeps the other ranks in lockstep.
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import logging
import uuid
from pathlib import Path
from typing import Any, AsyncGenerator, Callable

from replicas.engine.batch.local import Batch, LocalBatch
from replicas.contract import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorKind,
    Failed,
    Finished,
    GenerationRequest,
    OutputEvent,
    RerankRequest,
    RerankResult,
    SamplingParams,
    TokenizerInfo,
    TokenPrompt,
    is_terminal,
    merge_deltas,
)
from replicas.embedder import Embedder
from replicas.reranker import Reranker
from replicas.engine import failpoints  # test-only: a slow load (`start`)
from replicas.engine.core import Engine, EngineDead
from replicas.beside_model import kv_fingerprint, load_draft
from replicas.engine.kv.disk import DiskTier
from replicas.engine.kv.directory import DIRECTORY_FILE, PrefixDirectory
from replicas.engine.stats import EngineStats
from replicas.errors import ReplicaError
from replicas.engine.model.loading import LoadedModel, load_model
from replicas.versions import MODEL_STACK, check as check_versions
from replicas.engine.sharded.lockstep import LockstepBatch
from replicas.engine.kv.quantized import cache_maker
from replicas.engine.kv.budget import RankMemory, plan_memory
from replicas.options import ReplicaOptions
from replicas.replica_adapters import ReplicaAdapters
from replicas.replica_forwards import Forwards
from replicas.replica_prefixes import PrefixMoves
from replicas.encoder import ENCODER_FILES, NoGeneration, encoder_memory, is_encoder, \
    load_encoder
from replicas.sources import model_config, model_files, resolve_source
from replicas.families.channel_format import ChannelFormat
from replicas.families.registry import (
    detect_channel_format,
    detect_tool_format,
    get_channel_format,
    get_tool_format,
)
from replicas.families.tool_format import ToolFormat
from replicas.pipeline.detokenizer import make_decode
from replicas.pipeline.prepare import InputProcessor, Prepared
from replicas.routing_keys import token_spans
from replicas.kv_pull import PullResult, Ranks, Source
from replicas.engine.kv.transfer import PrefixKV, PrefixPull
from replicas.engine.delivery import EventBuffer
from replicas.timings import Timings, TimingSamples
from replicas.vision import VisionModel, VisionUnsupported, sees

log = logging.getLogger(__name__)

__all__ = ["ModelReplica", "ReplicaOptions"]


class ModelReplica:
    def __init__(self, options: ReplicaOptions,
                 wake_shards: Callable[[], None] | None = None,
                 on_pull: Callable[[PullResult], None] | None = None,
                 ranks: Ranks | None = None) -> None:
        """`wake_shards`: on a sharded replica, wakes the other ranks (they sleep while
        the batch is empty); the deployment passes Ray's call to them. `on_pull`: told
        of every prefix pull this replica tried (the deployment's metrics). `ranks`: a
        sharded replica's other ranks, which move their parts of pulled KV themselves."""
        # A native crash (MLX, Metal) then dumps every thread's Python stack into the
        # replica's log; the engine thread is named for the OS, so crash reports name it.
        faulthandler.enable(all_threads=True)
        self.options = options
        self._wake_shards = wake_shards or (lambda: None)
        # The generating batch: pulled KV lands in its cache, exported KV comes from it.
        self._batch: LocalBatch | LockstepBatch | None = None
        self._timings = Timings()
        self._engine = Engine(self._open, options.engine, on_step=self._timings.step,
                              name=options.model_id)
        self._model: LoadedModel | None = None
        self._format: ChannelFormat = get_channel_format("none")
        self._tool_format: ToolFormat = get_tool_format("none")
        self._inputs: InputProcessor | None = None
        self._forwards: Forwards | None = None  # tokenizer, embeddings, rerank: at start
        self._vision: VisionModel | None = None  # a model that sees: set by `_open`
        self._encoder_only = False  # an encoder (`replicas.encoder`): embeddings only
        self._streams = 0  # streams open now, which share the replica's chunk rate
        # Which prompt prefixes the cache holds, as the router names them (routing stats).
        self._directory = PrefixDirectory()
        self._directory_file: Path | None = None  # where it is kept, with a disk tier
        self._adapters = ReplicaAdapters(options.model_id, options.adapters, self._engine)
        self._prefixes = PrefixMoves(options.model_id, options.pull, self._engine,
                                     on_pull or (lambda result: None), ranks)

    def _open(self) -> tuple[LoadedModel, Batch, tuple[RankMemory, ...]]:
        """The model, its batch and each rank's memory, on the engine thread: whole, or
        rank 0's shard."""
        check_versions(MODEL_STACK)  # before any private hook of mlx-lm or mlx-vlm runs
        plan = self.options.shard
        budget = self.options.engine.kv_budget_bytes
        if plan is None:
            config = model_config(self.options.source)
            if config is not None and is_encoder(config):
                self._encoder_only = True
                directory = model_files(self.options.source, ENCODER_FILES)
                assert directory is not None  # fetched where it is not on disk
                model = load_encoder(self.options.source, directory, config)
                return model, NoGeneration(), (encoder_memory(model.model, budget),)
            model = load_model(self.options.source, resolve_source(self.options.source))
            if sees(model.config, self.options.kind):
                self._vision = VisionModel.load(model.path, model.model, self._timings)
            adapters = self._adapters.open(model, self._vision is not None)
            engine = self.options.engine
            draft = load_draft(self.options, model)
            # The adapters' tables are weights beside the model's, counted by admission.
            memory = plan_memory(model.model, budget, self.options.model_id,
                                 (self._vision.nbytes if self._vision else 0)
                                 + (adapters.nbytes if adapters else 0),
                                 cache_maker(engine.kv_bits, engine.kv_group_size), draft)
            self._batch = LocalBatch(model.model, self.options.engine,
                                     disk=self._disk_tier(model), held=self._directory.held,
                                     draft=draft, adapters=adapters)
            self._adapters.batch = self._batch if self._vision is None else None
            return model, self._batch, (memory,)
        if self.options.adapters:
            raise ValueError("LoRA adapters are served by whole-model replicas: set shards: 1")
        if self.options.kind == "vision":
            raise VisionUnsupported("a sharded replica reads text only: set shards: 1")
        from replicas.engine.sharded.rank import open_shard  # only sharded replicas join a group

        model, local, group, ranks = open_shard(
            self.options.source, resolve_source(self.options.source), plan, self.options.engine,
            self._directory.held, draft=lambda target: load_draft(self.options, target))
        self._batch = LockstepBatch(local, group, self._wake_shards, on_sync=self._timings.sync)
        return model, self._batch, ranks

    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters this replica serves now."""
        return self._adapters.names()

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve LoRA adapter `name` from `path` from the next step on, beside the rows
        decoding now (`ReplicaAdapters.load`: its weights come out of the KV budget)."""
        await self._adapters.load(name, path)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter `name`; refused while rows use it (`ReplicaAdapters`)."""
        await self._adapters.unload(name)

    def _disk_tier(self, model: LoadedModel) -> DiskTier | None:
        """The prefix cache's disk tier, under the model's fingerprint, where configured."""
        engine = self.options.engine
        if engine.disk_cache_dir is None or engine.prompt_cache_bytes == 0:
            return None
        tier = DiskTier(Path(engine.disk_cache_dir), engine.disk_cache_bytes,
                        kv_fingerprint(self.options, model), self._directory.held)
        # The directory's key table lives beside the tier's files: same model, same life.
        self._directory_file = tier.directory / DIRECTORY_FILE
        self._directory.load(self._directory_file)
        return tier

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Load the model on the engine thread and wait for it (blocking)."""
        if failpoints.ENABLED:  # test-only: a slow load (a model still loading), held by a file
            failpoints.hold("load", self.options.model_id)
        self._engine.start()
        model = self._engine.wait_ready(self.options.load_timeout_s)
        self._model = model
        vocab = model.hf_tokenizer.get_vocab().keys()
        name = self.options.channel_format or detect_channel_format(model.chat_template, vocab)
        self._format = get_channel_format(name)
        tool_name = self.options.tool_format or detect_tool_format(model.chat_template, vocab)
        self._tool_format = get_tool_format(tool_name)
        kv_tokens = self._engine.kv_budget.max_tokens
        if kv_tokens < self.context_length:
            # Serving a capped context beats refusing every long prompt; say it loudly.
            log.warning(
                "%s: KV memory holds one sequence of at most %d tokens, less than the %d-token "
                "context: requests are capped there (max_model_len). Raise memory.budget_bytes "
                "if the machine has room, or set max_model_len to choose the cap yourself.",
                self.options.model_id, kv_tokens, self.context_length)
        self._prefixes.open(self._batch, kv_fingerprint(self.options, model),
                            sharded=self.options.shard is not None)
        self._inputs = InputProcessor(self.options, model, make_decode(model.hf_tokenizer),
                                      self._format, self._tool_format, self.context_length,
                                      self._timings, self._engine.kv_budget.max_tokens,
                                      seer=self._vision)
        embedder = Embedder.open(self.options, model, self.context_length,
                                 self._engine.call, self._timings)
        reranker = Reranker.open(self.options, model, self._encoder_only,
                                 self.context_length, self._engine.call)
        self._forwards = Forwards(model, self._inputs, embedder, reranker,
                                  lambda: self.served_context)

    @property
    def sees(self) -> bool:
        """Whether requests may carry images."""
        return self._vision is not None

    @property
    def tool_format(self) -> ToolFormat:
        return self._tool_format

    def shutdown(self) -> None:
        self._engine.shutdown()  # the memory tier is written to disk first
        if self._directory_file is not None:
            try:
                self._directory.save(self._directory_file)
            except OSError:
                log.exception("saving the prefix directory's keys failed")

    def check_health(self) -> None:
        self._engine.check_health()

    def abort(self, reason: str) -> None:
        """Fail every queued and running request now (a fault outside the engine thread's
        sight, such as a lost shard); the health check fails from then on."""
        self._engine.abort(reason)

    def stalled_for(self) -> float:
        """Seconds the current batch step has run while requests wait on it."""
        return self._engine.stalled_for()

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def sync_totals(self) -> tuple[int, float]:
        """A sharded replica's steps so far and the seconds they waited on the other ranks."""
        return self._timings.sync_steps, self._timings.sync_seconds

    def drain_timings(self) -> TimingSamples:
        """Step, grammar-compile and shard-sync samples since the last call (for metrics)."""
        return self._timings.drain()

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            raise RuntimeError("the replica has not started")
        return self._model

    @property
    def context_length(self) -> int:
        """Prompt plus output tokens one request may use."""
        limit = self.options.max_model_len
        native = self.model.context_length
        return native if limit is None else min(native, limit)

    @property
    def served_context(self) -> int:
        """The context requests really get: the model's, under `max_model_len`, under what
        KV memory holds for one sequence (`GET /v1/models` reports it)."""
        return min(self.context_length, self._engine.kv_budget.max_tokens)

    @property
    def channel_format(self) -> ChannelFormat:
        return self._format

    @property
    def inputs(self) -> InputProcessor:
        if self._inputs is None:
            raise RuntimeError("the replica has not started")
        return self._inputs

    # ---- requests -----------------------------------------------------------------------

    async def stream(self, request: GenerationRequest, source: Source | None = None
                     ) -> AsyncGenerator[list[OutputEvent], None]:
        """Events in order, coalesced: the first batch leaves at once, later ones at most
        every `flush_interval_s`, each holding everything that arrived meanwhile.
        `source`: another replica that may give the prompt's prefix KV (`replicas.kv_pull`),
        asked before the request starts where that pays."""
        if self._encoder_only:
            what = "a cross-encoder: it serves /v1/rerank only" if self.reranker.serves \
                else "an embedding encoder: it serves /v1/embeddings only"
            yield [Failed(ErrorKind.INVALID_REQUEST, f"model '{request.model}' is {what}")]
            return
        if request.adapter is not None and request.adapter not in self.adapter_names():
            yield [Failed(ErrorKind.INVALID_REQUEST, f"model '{request.model}' has no adapter "
                          f"'{request.adapter}'; its adapters: "
                          f"{', '.join(self.adapter_names()) or 'none'}")]
            return
        loop = asyncio.get_running_loop()
        buffer = EventBuffer(loop)
        try:
            prepared = await asyncio.to_thread(self._prepare, request, buffer)
        except ReplicaError as exc:
            yield [exc.as_event()]
            return
        warnings = prepared.warnings
        ready = prepared.request
        cache_ids = self._adapters.cache_ids(request, ready.prompt_ids)  # an adapter's key space
        if ready.embeddings is None:  # a prompt with images is cached under its own keys
            await self._prefixes.before(cache_ids, source, ready.sampled_before > 0)
        submitted = loop.time()
        first: float | None = None
        try:
            self._engine.submit(prepared.request, prepared.output)
        except EngineDead as exc:  # fail fast: Serve replaces this replica on its health check
            yield [Failed(ErrorKind.INTERNAL, f"the model is unavailable: {exc}",
                          replica_fault=True)]
            return
        done = False
        next_flush = 0.0
        self._streams += 1
        try:
            while not done:
                batch = merge_deltas(await buffer.next(hold_until=next_flush))
                first = loop.time() if first is None else first
                done = any(is_terminal(e) for e in batch)
                if done and warnings:
                    batch = [_with_warnings(e, warnings) for e in batch]
                yield batch
                next_flush = loop.time() + self._chunk_interval()
            self._prefixes.prefilled(batch, first - submitted if first is not None else 0.0)
        finally:
            self._streams -= 1
            if not done:  # the consumer left: free the batch slot
                self._engine.cancel(request.request_id)

    async def export_prefix(self, pull: PrefixPull) -> PrefixKV | None:
        """Another replica's pull: the KV of the longest prefix of its prompt held here."""
        return await self._prefixes.export(pull)

    async def prefill_prefix(self, tokens: tuple[int, ...]) -> PrefixKV | None:
        """A prefill replica's job (`role: prefill`): prefill `tokens` here (one greedy
        token, which the cache keeps with the prompt), and hand over their KV."""
        request = GenerationRequest(f"prefill-{uuid.uuid4().hex}", self.options.model_id,
                                    TokenPrompt(tokens), SamplingParams(max_tokens=1,
                                                                        temperature=0.0))
        async for batch in self.stream(request):
            for event in batch:
                if isinstance(event, Failed):
                    log.warning("prefilling %d tokens for a decode replica failed: %s",
                                len(tokens), event.message)
                    return None
        return await self.export_prefix(PrefixPull(tokens, 1, ""))

    def pull_totals(self) -> dict[str, Any]:
        """Prefix pulls so far: outcomes, and the prompt tokens and bytes pulled."""
        return self._prefixes.totals()

    def _prepare(self, request: GenerationRequest, buffer: EventBuffer) -> Prepared:
        """The request ready for the engine; its prefix keys learnt by the directory."""
        prepared = self.inputs.prepare(request, buffer)
        ready = prepared.request
        if self.options.engine.prompt_cache_bytes and ready.embeddings is None:
            prompt = len(ready.prompt_ids) - ready.sampled_before  # a resume's ids end it
            self._directory.learn(token_spans(request, prompt, ready.boundary),
                                  self._adapters.cache_ids(request, ready.prompt_ids))
        return prepared

    def held_prefixes(self) -> frozenset[bytes]:
        """The prefix keys (`replicas.routing_keys`) whose tokens the cache holds now."""
        return self._directory.published()

    def _chunk_interval(self) -> float:
        """Seconds a stream's next chunk waits for more tokens. Every chunk costs the same
        CPU however many tokens it holds (rendering, the ASGI send, Ray's hop to the proxy,
        the socket write), so the replica's chunks per second are bounded: with many
        streams each chunk carries several steps' tokens (load/RESULTS.md, issue 23)."""
        rate = self.options.max_chunks_per_s
        shared = self._streams / rate if rate > 0 else 0.0
        return max(self.options.flush_interval_s, shared)

    @property
    def forwards(self) -> Forwards:
        """The calls that run no generation (`replicas/replica_forwards.py`)."""
        if self._forwards is None:
            raise RuntimeError("the replica has not started")
        return self._forwards

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...] | Failed:
        return await self.forwards.tokenize(request, add_special_tokens)

    async def detokenize(self, token_ids: tuple[int, ...]) -> str | Failed:
        return await self.forwards.detokenize(token_ids)

    def tokenizer_info(self) -> TokenizerInfo:
        return self.forwards.tokenizer_info()

    @property
    def embedder(self) -> Embedder:
        return self.forwards.embedder

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | Failed:
        return await self.forwards.embed(request)

    @property
    def reranker(self) -> Reranker:
        return self.forwards.reranker

    async def rerank(self, request: RerankRequest) -> RerankResult | Failed:
        return await self.forwards.rerank(request)


def _with_warnings(event: OutputEvent, warnings: tuple[str, ...]) -> OutputEvent:
    if isinstance(event, Finished):
        return dataclasses.replace(event, warnings=event.warnings + warnings)
    return event
