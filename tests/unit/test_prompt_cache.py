"""PromptCache lookups and eviction, with stand-in layers (no model)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from replicas.engine.kv.prefix_cache import PromptCache, segments


class Layer:
    """A cache layer holding `size` tokens at 10 bytes each."""

    def __init__(self, size: int, trimmable: bool = True) -> None:
        self.size, self.trimmable = size, trimmable

    @property
    def state(self) -> list[Any]:
        return []

    @property
    def nbytes(self) -> int:
        return 10 * self.size

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        self.size -= n
        return n


def layers(tokens: list[int], trimmable: bool = True) -> list[Any]:
    return [Layer(len(tokens), trimmable), Layer(len(tokens), trimmable)]


def test_a_longer_entry_serves_a_prefix_trimmed_and_leaves_the_last_token() -> None:
    cache = PromptCache(10_000)
    cache.save([1, 2, 3, 4, 5, 6], layers([1, 2, 3, 4, 5, 6]))
    hit = cache.fetch([1, 2, 3, 9])
    assert hit is not None and hit.length == 3 and [c.size for c in hit.cache] == [3, 3]
    same = cache.fetch([1, 2, 3, 4, 5, 6])  # the whole entry: all but the last token
    assert same is not None and same.length == 5 and [c.size for c in same.cache] == [5, 5]
    assert cache.fetch([7, 8]) is None and cache.fetch([1]) is None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.cached_tokens) == (2, 2, 8)
    assert stats.entries == 1 and stats.bytes == 120  # the entry itself was never trimmed


def test_untrimmable_caches_get_exact_or_shorter_matches_only() -> None:
    cache = PromptCache(10_000)
    cache.save([1, 2, 3, 4, 5, 6], layers([1, 2, 3, 4, 5, 6], trimmable=False))
    assert cache.fetch([1, 2, 3, 9]) is None  # would need trimming
    cache.save([1, 2], layers([1, 2], trimmable=False))  # kept: it is not trimmable either
    hit = cache.fetch([1, 2, 3, 9])
    assert hit is not None and hit.length == 2
    exact = cache.fetch([1, 2, 3, 4, 5, 6, 7])
    assert exact is not None and exact.length == 6
    assert cache.fetch([1, 2, 3, 4, 5, 6]) is not None  # the shorter one: 2 tokens
    assert cache.stats().entries == 2


def test_a_trimmable_entry_replaces_its_prefixes() -> None:
    cache = PromptCache(10_000)
    cache.save([1, 2, 3], layers([1, 2, 3]))
    cache.save([1, 2, 3, 4, 5], layers([1, 2, 3, 4, 5]))
    cache.save([1, 2, 3, 4, 5], layers([1, 2, 3, 4, 5]))  # the same key again
    stats = cache.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (1, 100, 0)


def test_eviction_is_least_recently_used_and_within_the_bound() -> None:
    cache = PromptCache(250)  # room for two 6-token entries (120 bytes each)
    cache.save([1, 1, 1, 1, 1, 1], layers([0] * 6))
    cache.save([2, 2, 2, 2, 2, 2], layers([0] * 6))
    assert cache.fetch([1, 1, 1, 7]) is not None  # a hit makes entry 1 the most recent
    cache.save([3, 3, 3, 3, 3, 3], layers([0] * 6))
    stats = cache.stats()
    assert (stats.entries, stats.evictions, stats.bytes) == (2, 1, 240)
    assert cache.fetch([2, 2, 2, 7]) is None
    assert cache.fetch([1, 1, 1, 7]) is not None and cache.fetch([3, 3, 3, 7]) is not None
    cache.save(list(range(20)), layers(list(range(20))))  # larger than the bound: not kept
    assert cache.stats().entries == 2


class Watched(PromptCache):
    """A PromptCache that records by how much any write that raised its byte count passed
    its limit: the engine's stats thread may read the count between any two lines (a
    lowered bound is evicted down to before a reservation takes the room)."""

    worst = 0

    @property  # type: ignore[override]
    def _bytes(self) -> int:
        return self.__dict__["bytes"]

    @_bytes.setter
    def _bytes(self, value: int) -> None:
        if "_room" in self.__dict__ and value > self.__dict__["bytes"]:
            self.worst = max(self.worst, value - self.limit)
        self.__dict__["bytes"] = value


def test_the_budget_bound_holds_at_every_write_and_lets_the_cache_grow_back() -> None:
    cache = Watched(10_000)  # 6-token entries cost 120 bytes
    for first in range(1, 5):
        cache.save([first] * 6, layers([0] * 6))
    cache.bound(250)  # requests took the rest of the KV budget: the two newest stay
    assert (cache.limit, cache.nbytes, cache.stats().evictions) == (250, 240, 2)
    assert cache.fetch([3, 3, 3, 7]) is not None and cache.fetch([1, 1, 1, 7]) is None
    cache.save([5] * 6, layers([0] * 6))  # makes room before it is counted
    cache.save([3] * 6, layers([0] * 6))  # replaces itself: nothing else goes
    cache.save([5] * 8, layers([0] * 8))  # replaces its prefix, then makes room
    assert cache.nbytes == 280 - 120 and cache.fetch([4, 4, 4, 7]) is None
    cache.save(list(range(30)), layers(list(range(30))))  # alone past the bound: not kept
    assert cache.stats().entries == 1 and cache.worst <= 0
    cache.bound(20_000)  # the requests ended: the cache's own bound is the limit again
    assert cache.limit == 10_000
    cache.save(list(range(30)), layers(list(range(30))))
    assert cache.stats().entries == 2 and cache.worst <= 0


def test_a_hit_on_real_kv_shares_the_arrays_and_leaves_the_entry_whole() -> None:
    kv = KVCache()
    kv.update_and_fetch(mx.ones((1, 2, 8, 4)), mx.ones((1, 2, 8, 4)))
    cache = PromptCache(1 << 20)
    cache.save(list(range(8)), [kv])
    hit = cache.fetch([0, 1, 2, 3, 99])
    assert hit is not None and hit.length == 4
    view = hit.cache[0]
    assert view is not kv and view.offset == 4 and kv.offset == 8
    assert view.keys_and_values()[0].shape == (1, 2, 4, 4)


def test_a_prompt_is_split_at_its_last_message_boundary_only_inside_the_uncached_part() -> None:
    prompt = list(range(10))
    assert segments(prompt, 0, 6) == [list(range(6)), list(range(6, 10))]
    assert segments(prompt, 2, 6) == [list(range(2, 6)), list(range(6, 10))]
    assert segments(prompt, 6, 6) == [list(range(6, 10))]  # the cache already covers it
    assert segments(prompt, 0, 0) == [prompt]  # no boundary (not a chat, one message)
    assert segments(prompt, 0, 9) == [prompt]  # the last token alone is no segment
