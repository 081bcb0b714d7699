"""Orchard's metrics through Ray Serve's metrics API, exported at Ray's Prometheus endpoint.

Ray prefixes every application metric with its namespace, so `orchard_requests_total` is
scraped as `ray_orchard_requests_total`; the scrape configs in `docs/` drop the prefix, and
the dashboard queries the `orchard_*` names. Every metric is labelled by `model` (Serve adds
`deployment`, `replica` and `application`).

Two sources feed them, neither per token: the ingress's one `RequestRecord` per finished
request (`RequestMetrics`), and a replica's engine, polled every `metrics_interval_s` for
its gauges and counters and drained of its step and grammar-compile samples (`EnginePoller`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, cast

from ray.serve.metrics import Counter, Gauge, Histogram

from ingress.observe import RequestRecord
from replicas.engine.stats import EngineStats
from replicas.timings import TimingSamples

log = logging.getLogger(__name__)

# Seconds. From an M-series Mac's tens of milliseconds to a loaded 2-core box's tens of
# seconds; ITL and engine steps from about a millisecond.
LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
DURATION_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
TOKEN_GAP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0]
STEP_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.25, 0.5, 1.0]
BATCH_BUCKETS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
COMPILE_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]

# Every metric's name, as Ray receives it: the README's list and the tests check against it.
REQUEST_METRICS = (
    "orchard_requests_total", "orchard_time_to_first_token_seconds",
    "orchard_inter_token_latency_seconds", "orchard_request_duration_seconds",
    "orchard_prompt_tokens_total", "orchard_output_tokens_total",
    "orchard_cached_tokens_total", "orchard_reasoning_tokens_total",
    "orchard_cancellations_total", "orchard_errors_total",
    "orchard_backpressure_refusals_total",
)
ENGINE_METRICS = (
    "orchard_queue_depth", "orchard_running_sequences", "orchard_batch_size",
    "orchard_engine_step_seconds", "orchard_prefix_cache_hits_total",
    "orchard_prefix_cache_misses_total", "orchard_prefix_cache_evictions_total",
    "orchard_prefix_cache_bytes", "orchard_grammar_compile_seconds",
)
# KV memory admission (`replicas.engine.kv.budget`).
MEMORY_METRICS = ("orchard_kv_budget_bytes", "orchard_kv_projected_bytes",
                  "orchard_waiting_for_memory", "orchard_memory_refusals_total",
                  "orchard_preemptions_total", "orchard_kv_token_bytes",
                  "orchard_kv_sequence_bytes")
# Paged KV's block pool (`memory.paged_kv`), by `state`: total, used, shared, free.
PAGED_METRICS = ("orchard_kv_blocks",)
# A replica's shard count (1 unless `shards`), and its per-step sync, only when sharded.
SHARD_METRICS = ("orchard_replica_shards", "orchard_shard_sync_seconds")
# `/v1/embeddings`: the inputs a replica embedded and their tokens.
EMBEDDING_METRICS = ("orchard_embedding_inputs_total", "orchard_embedding_tokens_total")
# The prefix cache's disk tier (`prompt_cache.disk_path`): its hits and its bytes.
DISK_METRICS = ("orchard_prefix_cache_disk_hits_total", "orchard_prefix_cache_disk_bytes")
# Speculative decoding (`speculative:`): rows' passes and tokens (their ratio is a
# sequence's tokens per target pass), drafts verified and kept; only a model that
# speculates exports them.
SPECULATIVE_METRICS = ("orchard_spec_target_passes_total", "orchard_spec_output_tokens_total",
                       "orchard_spec_draft_tokens_total", "orchard_spec_accepted_tokens_total")
# Prefix KV pulled from another replica (`replicas.kv_pull`): tries by outcome, the prompt
# tokens it saved from prefill, the bytes moved and the time each pull took.
PULL_METRICS = ("orchard_kv_pulls_total", "orchard_kv_pulled_tokens_total",
                "orchard_kv_pulled_bytes_total", "orchard_kv_pull_seconds")
# A vision model: the images its tower encoded, and the time per prompt.
IMAGE_METRICS = ("orchard_images_total", "orchard_image_encode_seconds")
# Per tenant (`tenants:`), created with the first tenant's request: requests by status,
# time to first token (its wait for a batch row included), tokens by kind, and refusals at
# the door (429) or for overload.
TENANT_METRICS = ("orchard_tenant_requests_total", "orchard_tenant_time_to_first_token_seconds",
                  "orchard_tenant_tokens_total", "orchard_tenant_refusals_total")
# And from each replica's scheduler: requests admitted to the batch, their summed queue
# waits and the rows preempted, per tenant.
ENGINE_TENANT_METRICS = ("orchard_tenant_admitted_total",
                         "orchard_tenant_queue_wait_seconds_total",
                         "orchard_tenant_preemptions_total")


def _keys(*names: str) -> tuple[str]:
    # Ray annotates tag_keys as `tuple[str]` (a one-tuple) though it takes any number.
    return cast("tuple[str]", names)


class RequestMetrics:
    """A `RequestObserver` (ingress.observe) that records each finished request."""

    def __init__(self) -> None:
        model = _keys("model")
        by_api = _keys("model", "protocol", "endpoint")
        self._requests = Counter(
            "orchard_requests_total", "Finished requests by API, HTTP status and finish "
            "reason (error / cancelled when there was none).",
            tag_keys=_keys(*by_api, "status", "finish_reason"))
        self._ttft = Histogram("orchard_time_to_first_token_seconds", "From the request "
                               "arriving to the first generated event.", LATENCY_BUCKETS,
                               tag_keys=by_api)
        self._itl = Histogram("orchard_inter_token_latency_seconds", "Mean time between "
                              "output tokens after the first, one sample per request.",
                              TOKEN_GAP_BUCKETS, tag_keys=model)
        self._duration = Histogram("orchard_request_duration_seconds", "End-to-end request "
                                   "time.", DURATION_BUCKETS, tag_keys=by_api)
        self._tokens = {kind: Counter(f"orchard_{kind}_tokens_total", f"{kind.capitalize()} "
                                      "tokens of finished requests.", tag_keys=model)
                        for kind in ("prompt", "output", "cached", "reasoning")}
        self._cancelled = Counter("orchard_cancellations_total", "Generations stopped before "
                                  "their end (client gone, deadline).", tag_keys=model)
        self._errors = Counter("orchard_errors_total", "Failed requests by error kind.",
                               tag_keys=_keys("model", "kind"))
        self._refused = Counter("orchard_backpressure_refusals_total", "Requests refused as "
                                "overloaded (503 / 529).", tag_keys=model)
        self._tenants: TenantMetrics | None = None  # with the first tenant's request

    def request_finished(self, record: RequestRecord) -> None:
        model = {"model": record.model}
        api = {**model, "protocol": record.protocol, "endpoint": record.endpoint}
        reason = (record.finish_reason.value if record.finish_reason is not None
                  else "cancelled" if record.cancelled
                  else "error" if record.error is not None else "none")
        self._requests.inc(1, {**api, "status": str(record.status), "finish_reason": reason})
        self._duration.observe(record.duration_s, api)
        if record.ttft_s is not None:
            self._ttft.observe(record.ttft_s, api)
        if record.itl_s is not None:
            self._itl.observe(record.itl_s, model)
        usage = record.usage
        if usage is not None:
            for kind, count in (("prompt", usage.prompt_tokens),
                                ("output", usage.completion_tokens),
                                ("cached", usage.cached_tokens),
                                ("reasoning", usage.reasoning_tokens)):
                if count:
                    self._tokens[kind].inc(count, model)
        if record.cancelled:
            self._cancelled.inc(1, model)
        if record.error is not None:
            self._errors.inc(1, {**model, "kind": record.error.value})
            if record.error.value == "overloaded":
                self._refused.inc(1, model)
        if record.tenant != "default" or self._tenants is not None:
            self._tenants = self._tenants or TenantMetrics()
            self._tenants.request_finished(record)


class TenantMetrics:
    """The request metrics a tenant's share is judged by, labelled by tenant."""

    def __init__(self) -> None:
        tags = _keys("model", "tenant")
        self._requests = Counter("orchard_tenant_requests_total", "Finished requests by tenant "
                                 "and HTTP status.", tag_keys=_keys(*tags, "status"))
        self._ttft = Histogram("orchard_tenant_time_to_first_token_seconds", "From the request "
                               "arriving to the first generated event, by tenant (its wait "
                               "for a batch row included).", LATENCY_BUCKETS, tag_keys=tags)
        self._tokens = Counter("orchard_tenant_tokens_total", "Tokens of finished requests by "
                               "tenant and kind (prompt, cached, output).",
                               tag_keys=_keys(*tags, "kind"))
        self._refused = Counter("orchard_tenant_refusals_total", "Requests refused by tenant "
                                "and reason: `rate_limited` (429 at the door), `overloaded`.",
                                tag_keys=_keys(*tags, "reason"))

    def request_finished(self, record: RequestRecord) -> None:
        tags = {"model": record.model, "tenant": record.tenant}
        self._requests.inc(1, {**tags, "status": str(record.status)})
        if record.ttft_s is not None:
            self._ttft.observe(record.ttft_s, tags)
        usage = record.usage
        if usage is not None:
            for kind, count in (("prompt", usage.prompt_tokens),
                                ("cached", usage.cached_tokens),
                                ("output", usage.completion_tokens)):
                if count:
                    self._tokens.inc(count, {**tags, "kind": kind})
        if record.error is not None and record.error.value in ("rate_limited", "overloaded"):
            self._refused.inc(1, {**tags, "reason": record.error.value})


def stream_resumes() -> Callable[[str], None]:
    """Counts streams moved to another replica after theirs failed (`RayModelClient`)."""
    counter = Counter("orchard_stream_resumes_total", "Streams that went on on another "
                      "replica after theirs died, froze or lost a shard.",
                      tag_keys=_keys("model"))
    return lambda model: counter.inc(1, {"model": model})


PullRecorder = Callable[[str, str, int, int, float], None]


def kv_pulls(model: str) -> PullRecorder:
    """Counts a replica's prefix pulls: `(source, outcome, tokens saved, bytes, seconds)`,
    the source a holder of the prefix or a prefill replica (`role: prefill`)."""
    tries = Counter("orchard_kv_pulls_total", "Prefix KV pulls a replica tried, by source "
                    "and outcome (pulled, declined, failed, recomputed: a prefill was "
                    "estimated faster).", tag_keys=_keys("model", "source", "outcome"))
    tokens = Counter("orchard_kv_pulled_tokens_total", "Prompt tokens whose KV was pulled "
                     "from another replica instead of prefilled here.",
                     tag_keys=_keys("model", "source"))
    moved = Counter("orchard_kv_pulled_bytes_total", "Bytes of KV pulled from other replicas.",
                    tag_keys=_keys("model", "source"))
    took = Histogram("orchard_kv_pull_seconds", "Time from asking for a prefix's KV to "
                     "holding it.", boundaries=LATENCY_BUCKETS, tag_keys=_keys("model", "source"))

    def record(source: str, outcome: str, saved: int, nbytes: int, seconds: float) -> None:
        tags = {"model": model, "source": source}
        tries.inc(1, {**tags, "outcome": outcome})
        if outcome == "pulled":
            tokens.inc(saved, tags)
            moved.inc(nbytes, tags)
            took.observe(seconds, tags)

    return record


class EngineMetrics:
    """A replica's engine, read into gauges, counters (as deltas) and histograms."""

    def __init__(self, model: str, shards: int = 1) -> None:
        tags = _keys("model")
        self._tags = {"model": model}
        self._shards = Gauge("orchard_replica_shards", "Processes (Macs) one replica of the "
                             "model runs on (`shards`).", tag_keys=tags)
        self._shards_value = shards
        self._sync = Histogram("orchard_shard_sync_seconds", "A sharded replica's wait at "
                               "each step boundary: the step's batch record queues behind "
                               "the step still computing, then crosses to the other ranks.", STEP_BUCKETS, tag_keys=tags)
        self._queue = Gauge("orchard_queue_depth", "Requests waiting to join the batch.",
                            tag_keys=tags)
        self._running = Gauge("orchard_running_sequences", "Sequences in the batch.",
                              tag_keys=tags)
        self._batch = Histogram("orchard_batch_size", "Sequences that got a token, per "
                                "engine step.", BATCH_BUCKETS, tag_keys=tags)
        self._step = Histogram("orchard_engine_step_seconds", "One engine step (prefill "
                               "chunk and / or decode).", STEP_BUCKETS, tag_keys=tags)
        self._hits = Counter("orchard_prefix_cache_hits_total", "Requests that reused a "
                             "cached prompt prefix.", tag_keys=tags)
        self._misses = Counter("orchard_prefix_cache_misses_total", "Requests that found no "
                               "cached prefix.", tag_keys=tags)
        self._evictions = Counter("orchard_prefix_cache_evictions_total", "Prefix cache "
                                  "entries dropped for room.", tag_keys=tags)
        self._bytes = Gauge("orchard_prefix_cache_bytes", "KV bytes the prefix cache holds.",
                            tag_keys=tags)
        self._disk_hits = Counter("orchard_prefix_cache_disk_hits_total", "Prefix cache hits "
                                  "the disk tier served (loaded instead of prefilled).",
                                  tag_keys=tags)
        self._disk_bytes = Gauge("orchard_prefix_cache_disk_bytes", "KV bytes the prefix "
                                 "cache's disk tier holds.", tag_keys=tags)
        self._compile = Histogram("orchard_grammar_compile_seconds", "Compiling one "
                                  "request's grammar (response_format, tools).",
                                  COMPILE_BUCKETS, tag_keys=tags)
        self._budget = Gauge("orchard_kv_budget_bytes", "KV bytes the replica may use for "
                             "running requests plus the prefix cache.", tag_keys=tags)
        self._projected = Gauge("orchard_kv_projected_bytes", "KV bytes the running requests' "
                                "reservations hold (every row padded to the longest, as "
                                "mlx-lm's batch cache is).", tag_keys=tags)
        self._preempted = Counter("orchard_preemptions_total", "Requests preempted when KV "
                                  "memory ran out (each resumes by prefill).", tag_keys=tags)
        self._token_bytes = Gauge("orchard_kv_token_bytes", "KV bytes one token adds, measured "
                                  "at load (full-attention and MLA layers, plus sliding-window "
                                  "layers below their window).", tag_keys=tags)
        self._sequence_bytes = Gauge("orchard_kv_sequence_bytes", "Fixed KV state per "
                                     "sequence, measured at load (linear-attention and SSM "
                                     "layers).", tag_keys=tags)
        self._blocks = Gauge("orchard_kv_blocks", "Paged KV's blocks per layer, by state: "
                             "total, used, shared (held by the prefix cache: hits read "
                             "them in place) and free.",
                             tag_keys=_keys("model", "state"))
        self._memory_waiting = Gauge("orchard_waiting_for_memory", "Requests waiting for KV "
                                     "memory to join the batch.", tag_keys=tags)
        self._memory_refused = Counter("orchard_memory_refusals_total", "Requests refused as "
                                       "overloaded because too many waited for KV memory.",
                                       tag_keys=tags)
        self._embedded = Counter("orchard_embedding_inputs_total", "Inputs embedded "
                                 "(`/v1/embeddings`).", tag_keys=tags)
        self._embedded_tokens = Counter("orchard_embedding_tokens_total", "Tokens of the "
                                        "inputs embedded.", tag_keys=tags)
        self._images = Counter("orchard_images_total", "Images a vision model's tower "
                               "encoded (prompts with images whose KV was not cached).",
                               tag_keys=tags)
        self._image_encode = Histogram("orchard_image_encode_seconds", "Encoding one prompt's "
                                       "images (vision tower and projector), on the engine "
                                       "thread.", COMPILE_BUCKETS, tag_keys=tags)
        spec = _keys("model", "method")
        self._spec = [Counter(name, about, tag_keys=spec) for name, about in zip(
            SPECULATIVE_METRICS,
            ("Rows' decoding passes: each forward of the target counts once per sequence in "
             "it (it verifies that sequence's drafts).",
             "Tokens those passes emitted (over passes: a sequence's tokens per pass).",
             "Draft tokens verified.", "Draft tokens the target kept and emitted."))]
        self._last: EngineStats | None = None
        self._tenants: EngineTenantMetrics | None = None  # with the first tenant's request

    def record(self, stats: EngineStats, samples: TimingSamples) -> None:
        tags = self._tags
        # Set on every poll, not once: a value set before Ray's exporter saw the metric can
        # be missing from the scrape.
        self._shards.set(self._shards_value, tags)
        self._queue.set(stats.waiting, tags)
        self._running.set(stats.active, tags)
        self._bytes.set(stats.cache_bytes, tags)
        self._disk_bytes.set(stats.disk_bytes, tags)
        last = self._last
        counts = [(self._hits, stats.cache_hits, last.cache_hits if last else 0),
                  (self._misses, stats.cache_misses, last.cache_misses if last else 0),
                  (self._evictions, stats.cache_evictions, last.cache_evictions if last else 0),
                  (self._disk_hits, stats.disk_hits, last.disk_hits if last else 0)]
        memory, before_memory = stats.memory, last.memory if last else None
        if memory is not None:
            self._budget.set(memory.budget_bytes, tags)
            self._projected.set(memory.projected_bytes, tags)
            self._memory_waiting.set(memory.waiting, tags)
            layout = memory.layout
            self._token_bytes.set(layout.per_token + sum(b for _, b in layout.windows), tags)
            self._sequence_bytes.set(layout.per_sequence, tags)
            if memory.blocks is not None:  # paged KV (`memory.paged_kv`)
                pool = memory.blocks
                for state, n in (("total", pool.total), ("used", pool.used),
                                 ("shared", pool.shared), ("free", pool.free)):
                    self._blocks.set(n, {**tags, "state": state})
            counts += [(self._memory_refused, memory.refused,
                        before_memory.refused if before_memory else 0),
                       (self._preempted, memory.preempted,
                        before_memory.preempted if before_memory else 0)]
        decode, before_decode = stats.decode, last.decode if last else None
        if decode is not None and decode.speculative:
            spec_tags = {**tags, "method": decode.method}
            current = (decode.passes, decode.tokens, decode.drafted, decode.accepted)
            previous = (before_decode.passes, before_decode.tokens, before_decode.drafted,
                        before_decode.accepted) if before_decode else (0, 0, 0, 0)
            for spec_counter, n, b in zip(self._spec, current, previous):
                if n > b:
                    spec_counter.inc(n - b, spec_tags)
        for counter, now, before in counts:
            if now > before:  # Ray refuses inc(0); a restart's lower count adds nothing
                counter.inc(now - before, tags)
        if stats.tenants and any(t.tenant != "default" for t in stats.tenants):
            self._tenants = self._tenants or EngineTenantMetrics()
            self._tenants.record(tags, stats, last)
        self._last = stats
        for seconds, batch in samples.steps:
            self._step.observe(seconds, tags)
            self._batch.observe(batch, tags)
        for seconds in samples.grammar_compile_s:
            self._compile.observe(seconds, tags)
        for seconds in samples.sync_s:
            self._sync.observe(seconds, tags)
        inputs = sum(n for n, _ in samples.embeddings)
        if inputs:  # Ray refuses inc(0)
            self._embedded.inc(inputs, tags)
            self._embedded_tokens.inc(sum(t for _, t in samples.embeddings), tags)
        for images, seconds in samples.images:
            self._images.inc(images, tags)
            self._image_encode.observe(seconds, tags)


class EngineTenantMetrics:
    """What a replica's scheduler did for each tenant (`fair_share.TenantTally`), as
    counters: their rate ratio is the mean wait for a batch row."""

    def __init__(self) -> None:
        tags = _keys("model", "tenant")
        self._admitted = Counter("orchard_tenant_admitted_total", "Requests that joined the "
                                 "batch, by tenant.", tag_keys=tags)
        self._waited = Counter("orchard_tenant_queue_wait_seconds_total", "Seconds requests "
                               "waited in the replica's queue for a batch row, summed, by "
                               "tenant (over orchard_tenant_admitted_total: the mean).",
                               tag_keys=tags)
        self._preempted = Counter("orchard_tenant_preemptions_total", "Rows preempted when KV "
                                  "memory ran out, by tenant.", tag_keys=tags)

    def record(self, tags: dict[str, str], stats: EngineStats,
               last: EngineStats | None) -> None:
        before = {t.tenant: t for t in last.tenants} if last is not None else {}
        for now in stats.tenants:
            was = before.get(now.tenant)
            tenant = {**tags, "tenant": now.tenant}
            for counter, value, previous in (
                    (self._admitted, now.admitted, was.admitted if was else 0),
                    (self._waited, now.waited_s, was.waited_s if was else 0.0),
                    (self._preempted, now.preempted, was.preempted if was else 0)):
                if value > previous:  # Ray refuses inc(0)
                    counter.inc(value - previous, tenant)


class EnginePoller:
    """A daemon thread that records `read()` every `interval_s` until `stop()`."""

    def __init__(self, metrics: EngineMetrics,
                 read: Callable[[], tuple[EngineStats, TimingSamples]],
                 interval_s: float) -> None:
        self._metrics = metrics
        self._read = read
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orchard-metrics", daemon=True)

    def start(self) -> "EnginePoller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._metrics.record(*self._read())
            except Exception:  # noqa: BLE001 - metrics must never take a replica down
                log.exception("recording engine metrics failed")
