"""Moving a prefix's KV (`replicas.engine.kv_transfer`) and deciding to (`replicas.kv_pull`):
bytes that decode to the same arrays, and the transfer-versus-prefill arithmetic."""

from __future__ import annotations

from typing import Any


from replicas.engine.disk_cache import snapshot
from replicas.engine.kv_transfer import decode, encode
from replicas.kv_pull import KvPuller, Rate
from replicas.options import PullOptions
from tests.unit.test_disk_cache import kv, same


def test_a_cache_survives_the_trip_through_bytes() -> None:
    cache = kv(40, layers=3)
    back = decode(encode(snapshot(cache)))
    assert len(back) == 3 and same(back, cache)
    assert [c.offset for c in back] == [40, 40, 40]


def puller(**options: Any) -> KvPuller:
    return KvPuller(PullOptions(**options), call=lambda fn: None, cache=lambda: None,
                    fingerprint="f")


def test_until_both_rates_are_measured_a_pull_is_tried() -> None:
    p = puller()
    assert p.faster(512)
    p.prefilled(5000, 1.0)
    assert p.faster(512)  # the KV's bytes a token are not known before a first pull


def test_a_pull_is_worth_it_when_moving_a_token_beats_prefilling_it() -> None:
    p = puller(min_tokens=1, link_bytes_per_s=1e9)
    p.token_bytes = 100_000.0  # 100 kB of KV a token: 0.1 ms a token over 1 GB/s
    p.prefilled(5000, 1.0)  # 5000 tokens/s: 0.2 ms a token
    assert p.faster(1000)
    p.prefill = Rate(50_000.0)  # 0.02 ms a token: a fast Mac on a small model
    assert not p.faster(1000)
    p.prefilled(10, 1.0)  # a slow prefill (min_tokens is 1 here) brings the average down
    assert p.prefill.value is not None and p.prefill.value < 50_000


def test_rates_average_toward_recent_samples_and_ignore_empty_ones() -> None:
    rate = Rate()
    rate.observe(100, 1.0)
    assert rate.value == 100
    rate.observe(200, 1.0)
    assert rate.value == 0.7 * 100 + 0.3 * 200
    rate.observe(0, 1.0)
    rate.observe(5, 0.0)
    assert rate.value == 0.7 * 100 + 0.3 * 200
