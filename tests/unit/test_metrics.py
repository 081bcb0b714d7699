"""`deployments.metrics` without Ray: its metric classes replaced by recorders, so each
update is checked exactly (the HTTP observability suite checks the export end to end)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import deployments.metrics as metrics
from ingress.observe import RequestRecord
from replicas.contract import ErrorKind, FinishReason, Usage
from replicas.engine.fair_share import TenantCounts
from replicas.engine.stats import DecodeCounts, EngineStats
from replicas.engine.kv.layout import KvLayout
from replicas.engine.kv.blocks import BlockPool
from replicas.engine.kv.budget import MemoryStats
from replicas.timings import TimingSamples


class _Recorder:
    """Stands in for Ray's Counter, Gauge and Histogram: keeps every call."""

    def __init__(self, name: str, description: str = "", *args: Any, **kwargs: Any) -> None:
        self.name = name
        self.calls: list[tuple[str, float, dict[str, str]]] = []
        _ALL[name] = self

    def inc(self, value: float, tags: dict[str, str]) -> None:
        assert value > 0, "Ray refuses inc(0)"
        self.calls.append(("inc", value, dict(tags)))

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("set", value, dict(tags)))

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("observe", value, dict(tags)))


_ALL: dict[str, _Recorder] = {}


@pytest.fixture(autouse=True)
def recorders(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Recorder]:
    _ALL.clear()
    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, name, _Recorder)
    return _ALL


RECORD = RequestRecord(
    request_id="r1", model="m", protocol="openai", endpoint="/v1/chat/completions",
    status=200, streaming=True, duration_s=1.5, ttft_s=0.25, itl_s=0.01,
    usage=Usage(prompt_tokens=10, completion_tokens=4, reasoning_tokens=0, cached_tokens=6),
    finish_reason=FinishReason.LENGTH, error=None, cancelled=False)


def test_every_metric_name_is_created(recorders: dict[str, _Recorder]) -> None:
    metrics.RequestMetrics()
    metrics.EngineMetrics("m", shards=2)
    assert set(recorders) == {*metrics.REQUEST_METRICS, *metrics.ENGINE_METRICS,
                              *metrics.MEMORY_METRICS, *metrics.SHARD_METRICS,
                              *metrics.EMBEDDING_METRICS, *metrics.IMAGE_METRICS,
                              *metrics.DISK_METRICS, *metrics.SPECULATIVE_METRICS,
                              *metrics.PAGED_METRICS}


def test_a_pull_counts_its_source_and_outcome_and_only_a_pull_moves_tokens(
        recorders: dict[str, _Recorder]) -> None:
    record = metrics.kv_pulls("m")
    assert set(recorders) == set(metrics.PULL_METRICS)
    record("holder", "recomputed", 0, 0, 0.0)
    record("prefill", "pulled", 900, 1 << 20, 0.25)
    holder, prefill = {"model": "m", "source": "holder"}, {"model": "m", "source": "prefill"}
    assert recorders["orchard_kv_pulls_total"].calls == [
        ("inc", 1, {**holder, "outcome": "recomputed"}),
        ("inc", 1, {**prefill, "outcome": "pulled"})]
    assert recorders["orchard_kv_pulled_tokens_total"].calls == [("inc", 900, prefill)]
    assert recorders["orchard_kv_pulled_bytes_total"].calls == [("inc", 1 << 20, prefill)]
    assert recorders["orchard_kv_pull_seconds"].calls == [("observe", 0.25, prefill)]


def test_a_finished_request_counts_once_with_its_labels(recorders: dict[str, _Recorder]) -> None:
    metrics.RequestMetrics().request_finished(RECORD)
    api = {"model": "m", "protocol": "openai", "endpoint": "/v1/chat/completions"}
    assert recorders["orchard_requests_total"].calls == [
        ("inc", 1, {**api, "status": "200", "finish_reason": "length"})]
    assert recorders["orchard_request_duration_seconds"].calls == [("observe", 1.5, api)]
    assert recorders["orchard_time_to_first_token_seconds"].calls == [("observe", 0.25, api)]
    assert recorders["orchard_prompt_tokens_total"].calls == [("inc", 10, {"model": "m"})]
    assert recorders["orchard_output_tokens_total"].calls == [("inc", 4, {"model": "m"})]
    assert recorders["orchard_cached_tokens_total"].calls == [("inc", 6, {"model": "m"})]
    assert recorders["orchard_reasoning_tokens_total"].calls == []  # no inc(0)
    assert recorders["orchard_errors_total"].calls == []


@pytest.mark.parametrize("record,reason", [
    (replace(RECORD, finish_reason=None, cancelled=True), "cancelled"),
    (replace(RECORD, finish_reason=None, error=ErrorKind.OVERLOADED, status=503), "error"),
    (replace(RECORD, finish_reason=None), "none"),
    (replace(RECORD, finish_reason=FinishReason.TOOL_CALLS), "tool_calls"),
])
def test_finish_reason_label(recorders: dict[str, _Recorder], record: RequestRecord,
                             reason: str) -> None:
    metrics.RequestMetrics().request_finished(record)
    ((_, _, tags),) = recorders["orchard_requests_total"].calls
    assert tags["finish_reason"] == reason
    overloaded = record.error is ErrorKind.OVERLOADED
    assert len(recorders["orchard_backpressure_refusals_total"].calls) == int(overloaded)
    assert len(recorders["orchard_errors_total"].calls) == int(record.error is not None)
    assert len(recorders["orchard_cancellations_total"].calls) == int(record.cancelled)


def _stats(**counts: Any) -> EngineStats:
    return EngineStats(active=1, waiting=0, steps=0, finished=0, submitted=0,
                       cancel_latency_steps=(), **counts)


def test_engine_counters_are_recorded_as_deltas(recorders: dict[str, _Recorder]) -> None:
    engine = metrics.EngineMetrics("m")
    none = TimingSamples((), ())
    engine.record(_stats(cache_hits=3, cache_misses=1), none)
    engine.record(_stats(cache_hits=5, cache_misses=1), none)
    # A replica restart's lower count adds nothing (and never an inc(0)).
    engine.record(_stats(cache_hits=2, cache_misses=1), none)
    assert [c[1] for c in recorders["orchard_prefix_cache_hits_total"].calls] == [3, 2]
    assert [c[1] for c in recorders["orchard_prefix_cache_misses_total"].calls] == [1]


def test_speculation_is_counted_only_where_a_model_speculates(
        recorders: dict[str, _Recorder]) -> None:
    engine = metrics.EngineMetrics("m")
    none = TimingSamples((), ())
    engine.record(_stats(decode=DecodeCounts(False, 10, 10, 0, 0, 0, 0)), none)
    assert not any(recorders[n].calls for n in metrics.SPECULATIVE_METRICS)
    engine = metrics.EngineMetrics("s")
    engine.record(_stats(decode=DecodeCounts(True, 10, 25, 20, 15, 0, 0, "ngram")), none)
    engine.record(_stats(decode=DecodeCounts(True, 12, 28, 22, 16, 0, 0, "ngram")), none)
    passes, tokens, drafted, kept = (recorders[n].calls for n in metrics.SPECULATIVE_METRICS)
    assert [c[1] for c in passes] == [10, 2] and [c[1] for c in tokens] == [25, 3]
    assert [c[1] for c in drafted] == [20, 2] and [c[1] for c in kept] == [15, 1]
    assert kept[0][2] == {"model": "s", "method": "ngram"}
    engine = metrics.EngineMetrics("d")  # a draft model's counts carry its method
    engine.record(_stats(decode=DecodeCounts(True, 4, 9, 8, 5, 0, 0, "draft")), none)
    assert recorders[metrics.SPECULATIVE_METRICS[3]].calls[-1][2] == \
        {"model": "d", "method": "draft"}


def test_samples_and_memory_and_shards(recorders: dict[str, _Recorder]) -> None:
    engine = metrics.EngineMetrics("m", shards=2)
    memory = MemoryStats(budget_bytes=1000, projected_bytes=400, waiting=2, refused=1,
                         preempted=2, layout=KvLayout(100, ((64, 10),), 5000))
    engine.record(_stats(memory=memory),
                  TimingSamples(((0.01, 3), (0.02, 4)), (0.5,), (0.001, 0.002)))
    engine.record(_stats(memory=replace(memory, refused=4, preempted=2)),
                  TimingSamples((), ()))
    tags = {"model": "m"}
    assert recorders["orchard_replica_shards"].calls == [("set", 2, tags)] * 2
    assert [c[1] for c in recorders["orchard_engine_step_seconds"].calls] == [0.01, 0.02]
    assert [c[1] for c in recorders["orchard_batch_size"].calls] == [3, 4]
    assert [c[1] for c in recorders["orchard_grammar_compile_seconds"].calls] == [0.5]
    assert [c[1] for c in recorders["orchard_shard_sync_seconds"].calls] == [0.001, 0.002]
    assert recorders["orchard_kv_budget_bytes"].calls[-1] == ("set", 1000, tags)
    assert recorders["orchard_kv_projected_bytes"].calls[-1] == ("set", 400, tags)
    assert recorders["orchard_waiting_for_memory"].calls[-1] == ("set", 2, tags)
    assert [c[1] for c in recorders["orchard_memory_refusals_total"].calls] == [1, 3]
    assert recorders["orchard_preemptions_total"].calls == [("inc", 2, tags)]
    assert recorders["orchard_kv_token_bytes"].calls[-1] == ("set", 110, tags)
    assert recorders["orchard_kv_sequence_bytes"].calls[-1] == ("set", 5000, tags)
    assert recorders["orchard_kv_blocks"].calls == []  # the padded batch: no blocks


def test_paged_kv_blocks_by_state(recorders: dict[str, _Recorder]) -> None:
    engine = metrics.EngineMetrics("m")
    pool = BlockPool(8, block_size=4)
    layer = pool.layer(0)
    held = layer.allocate(3)
    layer.share(held[:1])  # one block with two owners, one of them the prefix cache
    layer.hold(held[:1])
    memory = MemoryStats(budget_bytes=1000, projected_bytes=400, waiting=0, refused=0,
                         blocks=pool.stats())
    engine.record(_stats(memory=memory), TimingSamples((), ()))
    got = {c[2]["state"]: c[1] for c in recorders["orchard_kv_blocks"].calls}
    assert got == {"total": 8, "used": 3, "shared": 1, "free": 5}


def test_embeddings_are_counted_by_inputs_and_tokens(recorders: dict[str, _Recorder]) -> None:
    engine = metrics.EngineMetrics("m")
    engine.record(_stats(), TimingSamples((), (), (), ((1, 7), (16, 120))))
    engine.record(_stats(), TimingSamples((), ()))  # none since: no inc(0)
    tags = {"model": "m"}
    assert recorders["orchard_embedding_inputs_total"].calls == [("inc", 17, tags)]
    assert recorders["orchard_embedding_tokens_total"].calls == [("inc", 127, tags)]


def test_images_are_counted_with_their_encode_time(recorders: dict[str, _Recorder]) -> None:
    engine = metrics.EngineMetrics("m")
    engine.record(_stats(), TimingSamples((), (), (), (), ((1, 0.02), (4, 0.09))))
    engine.record(_stats(), TimingSamples((), ()))  # none since: nothing recorded
    tags = {"model": "m"}
    assert recorders["orchard_images_total"].calls == [("inc", 1, tags), ("inc", 4, tags)]
    assert [c[1] for c in recorders["orchard_image_encode_seconds"].calls] == [0.02, 0.09]


def test_tenant_metrics_only_with_tenants_labelled_by_tenant(
        recorders: dict[str, _Recorder]) -> None:
    observer = metrics.RequestMetrics()
    observer.request_finished(RECORD)  # the default tenant: no tenant series
    assert not set(metrics.TENANT_METRICS) & set(recorders)
    observer.request_finished(replace(RECORD, tenant="ci"))
    observer.request_finished(replace(RECORD, tenant="ci", status=429, usage=None,
                                      ttft_s=None, finish_reason=None,
                                      error=ErrorKind.RATE_LIMITED))
    assert set(metrics.TENANT_METRICS) <= set(recorders)
    ci = {"model": "m", "tenant": "ci"}
    assert recorders["orchard_tenant_requests_total"].calls == [
        ("inc", 1, {**ci, "status": "200"}), ("inc", 1, {**ci, "status": "429"})]
    assert recorders["orchard_tenant_time_to_first_token_seconds"].calls == [
        ("observe", 0.25, ci)]
    assert recorders["orchard_tenant_tokens_total"].calls == [
        ("inc", 10, {**ci, "kind": "prompt"}), ("inc", 6, {**ci, "kind": "cached"}),
        ("inc", 4, {**ci, "kind": "output"})]
    assert recorders["orchard_tenant_refusals_total"].calls == [
        ("inc", 1, {**ci, "reason": "rate_limited"})]


def test_engine_tenant_counters_as_deltas_only_with_tenants(
        recorders: dict[str, _Recorder]) -> None:
    engine = metrics.EngineMetrics("m")
    none = TimingSamples((), ())
    engine.record(_stats(tenants=(TenantCounts("default", 4, 1.0, 0),)), none)
    assert not set(metrics.ENGINE_TENANT_METRICS) & set(recorders)
    engine.record(_stats(tenants=(TenantCounts("ci", 2, 0.5, 0),)), none)
    engine.record(_stats(tenants=(TenantCounts("ci", 5, 2.0, 1),
                                  TenantCounts("agents", 1, 0.25, 0))), none)
    ci, agents = {"model": "m", "tenant": "ci"}, {"model": "m", "tenant": "agents"}
    assert recorders["orchard_tenant_admitted_total"].calls == [
        ("inc", 2, ci), ("inc", 3, ci), ("inc", 1, agents)]
    assert recorders["orchard_tenant_queue_wait_seconds_total"].calls == [
        ("inc", 0.5, ci), ("inc", 1.5, ci), ("inc", 0.25, agents)]
    assert recorders["orchard_tenant_preemptions_total"].calls == [("inc", 1, ci)]
