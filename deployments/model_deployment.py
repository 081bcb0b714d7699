"""One Serve deployment per configured model; each replica owns one engine thread."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from contextlib import aclosing
from typing import Any, AsyncGenerator

from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from deployments.adapter_store import AdapterSync, StoreRef
from deployments.board import Reporter
from deployments.cluster import require_metal
from deployments.config import (
    IngressSettings,
    ModelSettings,
    ObservabilitySettings,
    PullSettings,
    replica_max_stops,
)
from deployments.routing.headroom import ReplicaRoom
from deployments.metrics import kv_pulls
from deployments.observability import engine_poller
from deployments.routing.prefix import PREFIXES
from deployments.shards import ShardGroup
from deployments.startup_split import watch_first_token
from replicas.contract import (
    EmbeddingRequest,
    EmbeddingResult,
    Failed,
    GenerationRequest,
    OutputEvent,
    RerankRequest,
    RerankResult,
    TokenizerInfo,
)
from replicas.engine.config import EngineConfig
from replicas.engine.kv.transfer import PrefixKV, PrefixPull
from replicas.engine.stats import EngineStats
from replicas.errors import InvalidRequestError
from replicas.kv_pull import Fetch, Source
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.startup import announce


log = logging.getLogger(__name__)

# The ingress's per-request stop limit when a deployment is built without one (tests).
_REQUEST_MAX_STOPS: int = IngressSettings.model_fields["max_stops"].default


def replica_options(settings: ModelSettings,
                    request_max_stops: int = _REQUEST_MAX_STOPS) -> ReplicaOptions:
    return ReplicaOptions(
        model_id=settings.id,
        source=settings.source,
        default_stops=tuple(settings.default_stops),
        max_stops=replica_max_stops(request_max_stops, settings),
        channel_format=settings.channel_format,
        thinking_budget=settings.thinking_budget,
        tool_format=settings.tool_format,
        max_tokens_past_context=settings.max_tokens_past_context,
        max_model_len=settings.max_model_len,
        engine=EngineConfig(**settings.engine.model_dump(),
                            prompt_cache_bytes=settings.prompt_cache.max_bytes,
                            disk_cache_dir=settings.prompt_cache.disk_dir(),
                            disk_cache_bytes=settings.prompt_cache.disk_bytes,
                            kv_budget_bytes=settings.memory.budget_bytes,
                            max_memory_waiting=settings.memory.max_waiting,
                            max_memory_wait_s=settings.memory.max_wait_s,
                            kv_reservation=settings.memory.reservation,
                            paged_kv=settings.memory.paged_kv,
                            speculative=settings.speculative.engine()
                            if settings.speculative else None),
        load_timeout_s=settings.load_timeout_s,
        flush_interval_s=settings.stream_flush_ms / 1000,
        max_chunks_per_s=settings.stream_chunks_per_s,
        pull=(settings.routing.pull or PullSettings()).options(),
        embeddings=settings.embeddings,
        embedding_dimensions=settings.embedding_dimensions,
        kind=settings.kind,
        adapters=tuple((name, a.path) for name, a in settings.adapters.items()),
    )


class ReplicaOwner:
    """A deployment that owns one `ModelReplica`: startup, health, stats and shutdown."""

    def __init__(self, config: ModelSettings, request_max_stops: int = _REQUEST_MAX_STOPS,
                 observability: ObservabilitySettings = ObservabilitySettings()) -> None:
        constructed = time.time()  # the startup split's mark (deployments.startup_split)
        if config.placement is not None and config.placement.metal_required:
            require_metal(config.id)  # before loading: fail fast, with what to do about it
        options = replica_options(config, request_max_stops)
        self._shards: ShardGroup | None = None
        if config.shards > 1:
            # Ranks 1..N-1 start first and wait for rank 0 (this replica) to join them.
            from replicas.sharding import layer_count, sharding_mode
            from replicas.sources import model_config

            found = model_config(config.source)
            assert found is not None  # fetched when not on disk
            mode = sharding_mode(found, config.shards, config.sharding,
                                 config.distributed.pipeline_layers)
            self._shards = ShardGroup(config)
            options = dataclasses.replace(options, shard=self._shards.start(
                mode, options.engine, layer_count(found)))
        record = kv_pulls(config.id) if observability.metrics else None
        self._replica = ModelReplica(
            options, self._shards.wake if self._shards else None,
            on_pull=(lambda r: record(r.source, r.outcome, r.tokens, r.nbytes, r.seconds))
            if record else None, ranks=self._shards)
        if self._shards is not None:
            self._shards.watch(self._replica.abort, self._replica.stalled_for)
        # What the cluster snapshot shows of this replica (`GET /v1/cluster`), pushed; from
        # before the load, so a loading replica shows as `loading` (no KV memory yet).
        shards = self._shards
        try:
            context = serve.get_replica_context()
        except RayServeException:  # built outside Serve (a test's direct call): no board
            context = None
        if context is not None:
            self._reporter = Reporter(context.app_name, context.replica_id.to_full_id_str(),
                                      config.id, config.role, self.stats,
                                      (lambda: (shards.nodes, shards.node_facts))
                                      if shards is not None else lambda: ([], []))
        # Load before the replica reports ready, so Serve routes nothing to a cold model.
        self._replica.start()
        replica = self._replica
        self._adapters: AdapterSync | None = None
        if context is not None and config.shards == 1:
            # The adapters loaded at run time (`adapter_store.py`), before this one serves.
            self._adapters = AdapterSync.over_store(
                replica, config.id, context.replica_id.to_full_id_str(),
                tuple(config.adapters), StoreRef(context.app_name))
            try:
                self._adapters.once()
            except Exception:  # noqa: BLE001 - no store yet: the thread tries again
                log.warning("%s: the run-time adapters could not be read", config.id,
                            exc_info=True)
            self._adapters.start()
        self._poller = engine_poller(observability, config.id,
                                     lambda: (replica.stats(), replica.drain_timings()),
                                     shards=config.shards)
        self._stopped = threading.Event()
        if context is not None:  # `serve run`'s log: where the time to this first answer went
            watch_first_token(config.id, constructed, lambda: _answered(replica.stats()),
                              self._stopped)

    async def load_adapter(self, name: str, path: str) -> str | None:
        """A run-time adapter loaded here (`deployments/adapter_admin.py` checks one on a
        replica before every replica follows the store); why not, or None."""
        try:
            await self._replica.load_adapter(name, path)
        except InvalidRequestError as exc:
            return str(exc)
        return None

    def check_health(self) -> None:
        self._replica.check_health()  # raises when the engine thread died or is stuck
        if self._shards is not None:
            self._shards.check()  # every other rank alive and answering

    def stats(self) -> dict[str, Any]:
        # The replica's actor name says which replica answered (a handle picks one).
        name = serve.get_replica_context().replica_id.to_full_id_str()
        steps, sync_s = self._replica.sync_totals()
        return {"replica": name, "pid": os.getpid(), **dataclasses.asdict(self._replica.stats()),
                "pulls": self._replica.pull_totals(),
                "shards": self._shards.size if self._shards else 1,
                "pipeline_layers": self._shards.layers if self._shards else None,
                "sync_steps": steps, "sync_seconds": sync_s}

    def __del__(self) -> None:
        began = time.perf_counter()
        stopped = getattr(self, "_stopped", None)
        if stopped is not None:
            stopped.set()
        adapters = getattr(self, "_adapters", None)
        if adapters is not None:
            adapters.stop()
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.stop()
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.stop()
        threads = time.perf_counter()
        replica = getattr(self, "_replica", None)  # unset when __init__ refused the node
        if replica is not None:
            replica.shutdown()  # a sharded replica's rank 0 tells the others to stop
        engine = time.perf_counter()
        shards = getattr(self, "_shards", None)
        if shards is not None:
            shards.stop()
        # One line per stop, so a slow Ctrl-C shows whether this replica's part was slow.
        model = replica.options.model_id if replica is not None else "?"
        announce(f"{model}: replica stopped in {time.perf_counter() - began:.2f}s: threads "
                 f"{threads - began:.2f}s, engine and disk tier {engine - threads:.2f}s, "
                 f"shards {time.perf_counter() - engine:.2f}s")


def _answered(stats: EngineStats) -> bool:
    return stats.finished > 0 or (stats.decode is not None and stats.decode.tokens > 0)


@serve.deployment
class ModelDeployment(ReplicaOwner):
    def __init__(self, settings: dict[str, Any], request_max_stops: int = _REQUEST_MAX_STOPS,
                 observability: dict[str, Any] | None = None,
                 prefill: DeploymentHandle | None = None) -> None:
        """`prefill`: a decode model's prefill replicas (`role`), which long prompts go to."""
        config = ModelSettings.model_validate(settings)
        super().__init__(config, request_max_stops,
                         ObservabilitySettings.model_validate(observability or {}))
        self._own: DeploymentHandle | None = None  # this deployment's handle, for pulls
        self._pull = config.routing.pull
        self._prefill = None if prefill is None else Source(
            self._prefilled_by(prefill), config.prefill_min_tokens, estimate=False,
            kind="prefill")

    async def stream(self, request: GenerationRequest, prefix_holders: tuple[str, ...] = ()
                     ) -> AsyncGenerator[list[OutputEvent], None]:
        """`prefix_holders`: the replicas the router knows hold the prompt's prefix (the
        cluster prefix directory), added to the call by the router (`HOLDERS`)."""
        yield []  # accepted: the ingress bounds its wait for a replica on this (model_clients)
        source = self._holder(prefix_holders) or self._prefill
        async with aclosing(self._replica.stream(request, source)) as events:  # closed with us: cancels
            async for batch in events:
                yield batch

    def _holder(self, holders: tuple[str, ...]) -> Source | None:
        """The first of `holders`, asked through this deployment's own handle, whose router
        sends `export_prefix` to the replica it names; the KV comes back through Ray's
        object store. None: held here, or pulls are off."""
        context = serve.get_replica_context()
        if not holders or self._pull is None or \
                context.replica_id.to_full_id_str() in holders:
            return None
        if self._own is None:
            self._own = serve.get_deployment_handle(context.deployment, context.app_name)
        own, holder = self._own, holders[0]

        async def fetch(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
            answer: PrefixKV | None = await own.export_prefix.remote(
                PrefixPull(tokens, at_least, holder))
            return answer

        return Source(fetch, self._pull.min_tokens)

    @staticmethod
    def _prefilled_by(prefill: DeploymentHandle) -> Fetch:
        async def fetch(tokens: tuple[int, ...], at_least: int) -> PrefixKV | None:
            answer: PrefixKV | None = await prefill.prefill_prefix.remote(tokens)
            return answer
        return fetch

    async def prefill_prefix(self, tokens: tuple[int, ...]) -> PrefixKV | None:
        """A decode replica's long prompt (on a `role: prefill` model): prefilled here,
        its KV handed back."""
        return await self._replica.prefill_prefix(tokens)

    async def export_prefix(self, pull: PrefixPull) -> PrefixKV | None:
        """Another replica's pull: the KV of the longest prefix of its prompt held here."""
        return await self._replica.export_prefix(pull)

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...] | Failed:
        return await self._replica.tokenize(request, add_special_tokens)

    async def detokenize(self, token_ids: tuple[int, ...]) -> str | Failed:
        return await self._replica.detokenize(token_ids)

    def tokenizer_info(self) -> TokenizerInfo:
        return self._replica.tokenizer_info()

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve asks every `routing.stats_period_s`; the request router weighs replicas by
        it and sheds what none has KV room for (`deployments.routing.headroom`), and sends a
        request where its prefix is cached (`PREFIXES`: this replica's entry in the
        cluster prefix directory)."""
        stats: dict[str, Any] = {PREFIXES: self._replica.held_prefixes()}
        memory = self._replica.stats().memory
        if memory is not None:
            stats.update(ReplicaRoom.of(memory, self._replica.options.engine.max_memory_waiting,
                                        time.time_ns() // 1_000_000).stats())
        return stats

    async def embed(self, request: EmbeddingRequest
                    ) -> AsyncGenerator[EmbeddingResult | Failed | None, None]:
        """None first (accepted, as `stream` sends an empty batch: the client bounds its
        wait for a replica on it, not on the forwards), then the vectors or why not."""
        yield None
        yield await self._replica.embed(request)

    async def rerank(self, request: RerankRequest
                     ) -> AsyncGenerator[RerankResult | Failed | None, None]:
        """As `embed`: None first (accepted), then the scores or why not."""
        yield None
        yield await self._replica.rerank(request)
