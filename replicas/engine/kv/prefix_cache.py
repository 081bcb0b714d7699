"""A replica's KV prefix cache: the longest cached token prefix of a prompt, LRU under a
byte bound. Used only on the engine thread (it holds MLX arrays).

mlx-lm's `LRUPromptCache` (what `mlx_lm.server` uses) is the model, and its trim helpers
are used as they are. The index is our own (`replicas.engine.kv.trie`: theirs walks
every entry below a prompt's divergence on each lookup), and so is the LRU, because theirs
does not serve here: a hit does not refresh an entry's recency (a prefix every conversation
shares would age out first), it reports no evictions, it deep-copies every hit (a second
copy of a long prefix's KV, which the batch merge copies once more anyway), and an exact
match leaves nothing to prefill, which `BatchGenerator.insert` refuses.

On a paged replica (`attach`) the entries live in the batch's block pool as block refs
(`replicas.engine.kv.rows`): an entry saved from the batch shares the row's blocks, a hit
shares the entry's, entries with a common prefix share its blocks, and an entry counts only
the blocks no row holds (`cache_only`: rows count the ones they hold), so a block counts
once. Evicting an entry drops its refs; a block goes back to the pool at zero. Keeping,
counting and evicting the entries is `replicas.engine.kv.prefix_entries`; this module
looks them up.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, trim_prompt_cache

from replicas.engine.kv.disk import DiskHit, DiskTier
from replicas.engine.kv.directory import HeldBlocks
from replicas.engine.kv.prefix_entries import PrefixEntries
from replicas.engine.kv.quantized import QuantizedRowKVCache
from replicas.engine.kv.rows import plain

log = logging.getLogger(__name__)

_SUMMARY_EVERY = 100  # lookups between INFO summaries
_CLOSE_WAIT_S = 60.0  # at shutdown, the longest wait for room in the disk tier's queue
DISK_MIN_TOKENS = 32  # the fewest prompt tokens a disk hit must save over memory's


@dataclass(frozen=True)
class CacheHit:
    cache: list[Any]  # one cache per layer, for `BatchGenerator.insert(caches=...)`
    length: int  # the prompt tokens it holds; the rest must be prefilled


@dataclass(frozen=True)
class PromptCacheStats:
    hits: int
    misses: int
    evictions: int
    bytes: int
    entries: int
    cached_tokens: int  # prompt tokens served from the cache, all requests together
    disk_hits: int = 0  # hits the disk tier served (counted in `hits` too)
    disk_bytes: int = 0
    disk_entries: int = 0

    def engine_fields(self) -> dict[str, int]:
        """These stats under `replicas.engine.EngineStats`' names."""
        return dict(cache_hits=self.hits, cache_misses=self.misses,
                    cache_evictions=self.evictions, cache_bytes=self.bytes,
                    cache_entries=self.entries, cached_tokens=self.cached_tokens,
                    disk_hits=self.disk_hits, disk_bytes=self.disk_bytes,
                    disk_entries=self.disk_entries)


class PromptCache(PrefixEntries):
    """The entries (`PrefixEntries`: saving, counting, evicting) and their lookups: a
    request's (`fetch`), admission's (`peek`), a pull's, the disk tier's reads, and a
    pulled or read prefix kept for its one request (`adopt`)."""

    def __init__(self, max_bytes: int, cost_scale: tuple[int, int] = (1, 1),
                 disk: DiskTier | None = None, held: HeldBlocks | None = None) -> None:
        super().__init__(max_bytes, cost_scale, disk, held)
        # A pulled prefix too big for the bound, waiting for its request (`adopt`).
        self._adopted: tuple[tuple[int, ...], list[Any]] | None = None
        self._hits = 0
        self._misses = 0
        self._cached_tokens = 0

    @property
    def disk(self) -> DiskTier | None:
        return self._disk

    def stats(self) -> PromptCacheStats:
        disk = self._disk
        return PromptCacheStats(self._hits, self._misses, self._evictions, self.nbytes,
                                len(self._lru), self._cached_tokens,
                                disk.hits if disk else 0, disk.nbytes if disk else 0,
                                len(disk) if disk else 0)

    def fetch(self, tokens: list[int], count: bool = True) -> CacheHit | None:
        """The longest usable cached prefix of `tokens`, as a cache the caller may own, or
        None. At least the last token is always left out: its logits start generation.
        `count`: a request's lookup (the stats count it); False for another replica's
        pull (`replicas.kv_pull`)."""
        # The disk tier is read before a request starts, off the engine thread
        # (`disk_wanted`, `read_disk`, `take_disk`), never here.
        hit = self._lookup(tokens[:-1]) if len(tokens) > 1 else None
        if count:
            hit = self._from_adopted(tokens, hit)
        else:  # a pull sends it elsewhere: a copy, not this pool's blocks
            return CacheHit(plain(hit.cache), hit.length) if hit is not None else None
        if hit is None:
            self._misses += 1
        else:
            self._hits += 1
            self._cached_tokens += hit.length
            log.debug("prompt cache hit: %d of %d prompt tokens", hit.length, len(tokens))
        if (self._hits + self._misses) % _SUMMARY_EVERY == 0:
            log.info("prompt cache: %d hits, %d misses, %d prompt tokens reused, %d entries, "
                     "%d of %d bytes, %d evictions", self._hits, self._misses,
                     self._cached_tokens, len(self._lru), self._bytes, self.max_bytes,
                     self._evictions)
        return hit

    def adopt(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep a prefix another replica sent (`replicas.kv_pull`) for the request about to
        start: as an entry where it fits the bound, else for that request's lookup alone
        (one at a time, outside the bound, as the disk tier serves an entry too big for
        memory; a request cancelled before its lookup leaves it until the next pull)."""
        self.save(tokens, cache, spill=False)
        if tuple(tokens) not in self._lru:
            self._adopted = (tuple(tokens), cache)

    def _from_adopted(self, tokens: list[int], hit: CacheHit | None) -> CacheHit | None:
        """`hit`, or the adopted prefix where `tokens` start with it (used once; another
        request's lookup in between leaves it for its own)."""
        if self._adopted is None:
            return hit
        key, cache = self._adopted
        if len(key) >= len(tokens) or tuple(tokens[:len(key)]) != key:
            return hit
        self._adopted = None
        return hit if hit is not None and hit.length >= len(key) else CacheHit(cache, len(key))

    def peek(self, tokens: list[int]) -> CacheHit | None:
        """What `fetch` would serve from memory now, as its entry holds it (to read, never
        to keep: no copy, no refs), uncounted and its recency untouched; None also where the
        adopted prefix would serve instead (admission's lookup: `batch/paging.py`)."""
        found = self._find(tokens[:-1]) if len(tokens) > 1 else None
        if found is None:
            return None
        adopted = self._adopted[0] if self._adopted is not None else None
        if adopted is not None and found[1] < len(adopted) < len(tokens) \
                and tuple(tokens[:len(adopted)]) == adopted:
            return None
        return CacheHit(self._lru[found[0]].cache, found[1])

    def held_length(self, tokens: list[int]) -> int:
        """The most prompt tokens `fetch` could serve now from either tier (a disk entry
        it would not read counts too), with no side effect: what a replica has before it
        asks another for more."""
        found = self._find(tokens[:-1]) if len(tokens) > 1 else None
        disk = self._disk.lookup(tokens) if self._disk is not None else None
        return max(found[1] if found else 0, disk.length if disk else 0)

    def _lookup(self, usable: list[int]) -> CacheHit | None:
        found = self._find(usable)
        return self._hit(*found) if found else None

    def _find(self, usable: list[int]) -> tuple[tuple[int, ...], int] | None:
        """The entry serving the longest prefix of `usable`, and that prefix's length. A
        longer entry serves a prefix only where every layer can drop its tail; recurrent
        state cannot, so hybrid models get exact or shorter matches."""
        return self._trie.longest_prefix(
            usable, lambda key: can_trim_prompt_cache(self._lru[key].cache))

    def disk_wanted(self, tokens: list[int]) -> DiskHit | None:
        """The disk entry worth reading before a request for `tokens` starts, or None. On
        the engine thread; no file is read here."""
        if self._disk is None:
            return None
        found = self._disk.lookup(tokens)
        held = self._find(tokens[:-1]) if len(tokens) > 1 else None
        if self._adopted is not None and len(self._adopted[0]) < len(tokens) \
                and tuple(tokens[:len(self._adopted[0])]) == self._adopted[0]:
            held = (self._adopted[0], len(self._adopted[0]))
        # Reading a file costs its whole size: worth it when it saves a real prefill and
        # most of what is read is used (not a shared system prompt of a long entry).
        if found is None or found.length - (held[1] if held else 0) < DISK_MIN_TOKENS \
                or found.length * 4 < len(found.key):
            return None
        return found

    def read_disk(self, found: DiskHit) -> list[Any] | None:
        """On a worker thread: the entry's KV, read, checked against its sum and evaluated
        (None when the file failed its check: it is dropped)."""
        assert self._disk is not None
        return self._disk.load(found)

    def take_disk(self, found: DiskHit, cache: list[Any]) -> None:
        """On the engine thread: a read entry joins memory, for the request about to start
        (one larger than the bound waits for that request's lookup, as a pulled one)."""
        self.save(list(found.key), cache, spill=False)
        if found.key not in self._lru:
            self._adopted = (found.key[:found.length],
                             prefix_view(cache, len(found.key) - found.length))

    def close(self) -> None:
        """Every entry to the disk tier (a restart finds them there), written before this
        returns; nothing without a disk tier."""
        if self._disk is None:
            return
        for key, entry in self._lru.items():  # no batch waits for this memory: queue all
            self._disk.put(key, plain(entry.cache), wait_s=_CLOSE_WAIT_S)
        if not self._disk.flush():
            log.warning("disk KV cache: writes still pending at shutdown")

    def _hit(self, key: tuple[int, ...], length: int) -> CacheHit:
        entry = self._lru[key]
        self._lru.move_to_end(key)
        return CacheHit(prefix_view(entry.cache, len(key) - length), length)

    def save_boundaries(self, gen: Any, prefilled: list[Any],
                        key: Callable[[int, list[int]], list[int]]) -> None:
        """Keep the KV of prompts whose first segment (`segments`) the batch step just
        prefilled, as mlx-lm's server does: a retry, an edit of the last message or a
        request arriving meanwhile reuses it even before (or without) a finished save.
        `gen` is the `BatchGenerator`, `prefilled` its step's prompt responses, `key` a
        row's tokens as this cache keys them (`LocalBatch._key`)."""
        done = [r.uid for r in prefilled if r.end_of_segment and not r.end_of_prompt]
        if not done:
            return
        try:
            for uid, (cache, tokens) in gen.extract_cache(done).items():
                self.save(key(uid, list(tokens)), cache, persist=False)  # its request's will
        except Exception:  # noqa: BLE001 - the cache is an optimisation
            log.exception("saving a prompt cache entry at a message boundary failed")



def segments(prompt: list[int], cached: int, boundary: int) -> list[list[int]]:
    """What a request prefills after its cached `cached` tokens, split at its last message
    boundary when that falls inside: the batch then reports the boundary (`end_of_segment`)
    and `PromptCache.save_boundaries` keeps the KV there."""
    if cached < boundary < len(prompt) - 1:
        return [prompt[cached:boundary], prompt[boundary:]]
    return [prompt[cached:]]


def prefix_view(cache: list[Any], drop: int) -> list[Any]:
    """A cache the batch may own, holding all but the last `drop` tokens of `cache`.

    The batch's merge only reads a plain KVCache's (or a quantized row's) arrays, so a new
    cache over the same arrays suffices (no copy of a long prefix); other types are
    deep-copied, as mlx-lm does.
    """
    out: list[Any] = []
    for layer in cache:
        if type(layer) is KVCache:
            view = KVCache()
            view.keys, view.values, view.offset = layer.keys, layer.values, layer.offset - drop
            out.append(view)
        elif type(layer) is QuantizedRowKVCache:
            out.append(layer.view(layer.offset - drop))
        else:
            out.append(copy.deepcopy(layer))
    deep = [i for i, layer in enumerate(cache) if type(layer) not in (KVCache, QuantizedRowKVCache)]
    if drop and deep:
        trim_prompt_cache([out[i] for i in deep], drop)
    return out
