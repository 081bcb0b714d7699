"""Moving a prefix's KV (`replicas.engine.kv.transfer`) and deciding to (`replicas.kv_pull`):
bytes that decode to the same arrays, and the transfer-versus-prefill arithmetic."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import mlx.core as mx
import pytest

from replicas.engine.batch.rows import Exported
from replicas.engine.kv.disk import snapshot
from replicas.engine.kv.transfer import PrefixKV, decode, encode
from replicas.engine.kv.quantized import QuantizedRowKVCache
from replicas.kv_pull import KvPuller, Rate, Source
from replicas.options import PullOptions
from tests.unit.test_disk_cache import kv, same


def test_a_cache_survives_the_trip_through_bytes() -> None:
    cache = kv(40, layers=3)
    back = decode(encode(snapshot(cache)))
    assert len(back) == 3 and same(back, cache)
    assert [c.offset for c in back] == [40, 40, 40]


def test_quantized_rows_travel_as_mlx_lm_s_class_and_come_back_as_rows() -> None:
    row = QuantizedRowKVCache(group_size=32, bits=8)
    row.update_and_fetch(mx.random.normal((1, 2, 40, 32)), mx.random.normal((1, 2, 40, 32)))
    snap = snapshot([row.view(30)])
    assert "QuantizedKVCache" in snap.metadata.values()  # mlx-lm's loader reads the file
    (back,) = decode(encode(snap))
    assert type(back) is QuantizedRowKVCache and back.offset == 30
    # Only the positions the view holds travel, not the room allocated past them.
    assert back.keys[0].shape[2] == 30
    assert all(mx.array_equal(a, b[..., :30, :]).item() for a, b in zip(back.keys, row.keys))


def call(fn: Callable[[], Any]) -> Future[Any]:
    """`Engine.call` without a thread: run now."""
    done: Future[Any] = Future()
    done.set_result(fn())
    return done


class Home:
    """A batch that holds nothing and records what it adopts."""

    def __init__(self) -> None:
        self.adopted: list[tuple[int, str]] = []

    def held_length(self, tokens: Sequence[int]) -> int:
        return 0

    def export_prefix(self, tokens: Sequence[int], at_least: int) -> Exported | None:
        return None

    def adopt(self, tokens: Sequence[int], layers: list[Any], staged: str = "") -> None:
        self.adopted.append((len(tokens), staged))


class Ranks:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.staged: list[str] = []
        self.discarded: list[str] = []

    def attach(self, kv: PrefixKV) -> PrefixKV:
        return kv

    async def stage(self, staged: str, kv: PrefixKV) -> None:
        self.staged.append(staged)
        if self.fail:
            raise ConnectionError("rank 1's Mac went away")

    def discard(self, staged: str) -> None:
        self.discarded.append(staged)


@pytest.mark.parametrize("fail", [False, True])
def test_a_sharded_pull_adopts_only_once_every_rank_staged_its_part(fail: bool) -> None:
    home, ranks = Home(), Ranks(fail)
    p = KvPuller(PullOptions(min_tokens=8), call, home, "f", ranks)
    prompt = tuple(range(40))

    async def fetch(tokens: tuple[int, ...], at_least: int) -> PrefixKV:
        return PrefixKV(tokens[:32], encode(snapshot(kv(32))), "f", "e1", ("part 1",))

    result = asyncio.run(p.before(prompt, Source(fetch, 8)))
    assert result is not None and len(ranks.staged) == 1
    if fail:  # a prefill instead; nothing adopted, every staged part freed
        assert result.outcome == "failed" and home.adopted == []
        assert ranks.discarded == ranks.staged
    else:
        assert result.outcome == "pulled" and result.tokens == 32
        assert home.adopted == [(32, ranks.staged[0])] and ranks.discarded == []


def puller(**options: Any) -> KvPuller:
    return KvPuller(PullOptions(**options), call, Home(), "f")


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


class Refusing(Home):
    """A batch whose adopt fails (say, the KV does not fit a layer it expects)."""

    def adopt(self, tokens: Sequence[int], layers: list[Any], staged: str = "") -> None:
        raise ValueError("no room for it")


@pytest.mark.parametrize("broken", ["adopt", "decode"])
def test_a_pull_that_fails_to_land_costs_a_prefill_only(broken: str) -> None:
    """Issue 59: a decode or adopt failure escaped `before`, so `stream` failed and the
    client resumed the request elsewhere as if the replica had died."""
    ranks = Ranks(fail=False)
    home = Refusing() if broken == "adopt" else Home()
    p = KvPuller(PullOptions(min_tokens=8), call, home, "f", ranks)
    payload = encode(snapshot(kv(32)))
    if broken == "decode":
        payload = payload[: len(payload) // 3]  # cut short on the way

    async def fetch(tokens: tuple[int, ...], at_least: int) -> PrefixKV:
        return PrefixKV(tokens[:32], payload, "f", "e1", ("part 1",))

    result = asyncio.run(p.before(tuple(range(40)), Source(fetch, 8)))
    assert result is not None and result.outcome == "failed"
    assert ranks.discarded == ranks.staged and len(ranks.staged) == 1
    assert p.outcomes == {"failed": 1}
