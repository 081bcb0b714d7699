"""What an engine reports about itself: its batch, its queue, its prefix cache, its KV
memory (read by the replica's metrics and health)."""

from __future__ import annotations

from dataclasses import dataclass

from replicas.engine.fair_share import TenantCounts
from replicas.engine.kv.budget import KvBudget, MemoryStats
from replicas.engine.kv.prefix_cache import PromptCache, PromptCacheStats

_CONSISTENT_READS = 8  # `memory_figures`: reads until the cache's bytes hold still


@dataclass(frozen=True)
class EngineStats:
    active: int
    waiting: int
    steps: int
    finished: int
    submitted: int  # requests that reached the batch (a request cancelled in the queue never does)
    cancel_latency_steps: tuple[int, ...]  # decode steps between a cancel and the slot freeing
    cache_hits: int = 0  # requests that reused a cached prefix
    cache_misses: int = 0
    cache_evictions: int = 0
    cache_bytes: int = 0
    cache_entries: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled thanks to the cache
    disk_hits: int = 0  # cache hits the disk tier served
    disk_bytes: int = 0
    disk_entries: int = 0
    memory: MemoryStats | None = None  # KV admission (None until the model has loaded)
    decode: DecodeCounts | None = None  # None until the model has loaded
    tenants: tuple[TenantCounts, ...] = ()  # per tenant: admitted, queue waits, preempted


@dataclass(frozen=True)
class DecodeCounts:
    """The decoding passes (`replicas.engine.batch.decode`) and their speculation."""

    speculative: bool  # drafts configured and possible for this model
    passes: int  # rows' decoding passes (a pass counts once per row in it)
    tokens: int  # tokens emitted: tokens / passes is a sequence's tokens per pass
    drafted: int
    accepted: int
    forced: int  # drafts a grammar forced
    rows_off_path: int  # row-steps whose logits took a per-row Python call
    method: str = ""  # speculative.method where speculative: "ngram", "draft" or "mtp"


def memory_figures(cache: PromptCache | None, kv: KvBudget | None, waiting: int
                   ) -> tuple[PromptCacheStats | None, MemoryStats | None]:
    """The prefix cache's and the reservations' figures as of one moment, from another
    thread than the engine's. The engine moves bytes from one to the other (it evicts, then
    reserves): two plain reads could straddle that and count the same bytes twice, so the
    cache is read again until it held still around the reservations' read."""
    for _ in range(_CONSISTENT_READS):
        figures = cache.stats() if cache is not None else None
        memory = kv.stats(waiting) if kv is not None else None
        if cache is None or figures is None or figures.bytes == cache.nbytes:
            break
    return figures, memory
