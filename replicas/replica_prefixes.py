"""A replica's prompt prefixes from beyond its memory tier: read off its disk tier before a
request starts (`replicas.disk_reads`), pulled from another replica where that beats a
prefill (`replicas.kv_pull`), and handed to one that asks."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from replicas.contract import Finished, OutputEvent
from replicas.disk_reads import DiskReads
from replicas.engine.batch.local import LocalBatch
from replicas.engine.core import Engine
from replicas.engine.kv.transfer import PrefixKV, PrefixPull
from replicas.engine.sharded.lockstep import LockstepBatch
from replicas.kv_pull import KvPuller, PullResult, Ranks, Source
from replicas.options import PullOptions

log = logging.getLogger(__name__)


class PrefixMoves:
    """`on_pull`: told of every pull tried (the deployment's metrics); `ranks`: a sharded
    replica's other ranks, which move their parts of pulled KV themselves."""

    def __init__(self, model_id: str, options: PullOptions, engine: Engine,
                 on_pull: Callable[[PullResult], None], ranks: Ranks | None) -> None:
        self._model_id = model_id
        self._options = options
        self._engine = engine
        self._on_pull = on_pull
        self._ranks = ranks
        self._puller: KvPuller | None = None  # set at start where KV may move
        self._disk_reads: DiskReads | None = None  # set at start with a disk tier

    def open(self, batch: LocalBatch | LockstepBatch | None, fingerprint: str,
             sharded: bool) -> None:
        """After the load: the batch whose prefix cache they fill and read."""
        if batch is None or batch.cache is None:
            return
        if batch.cache.disk is not None:
            self._disk_reads = DiskReads(self._engine.call, batch.cache)
        if sharded and self._ranks is None:
            log.warning("%s: KV pulls are off (no transport to the other ranks)",
                        self._model_id)
            return
        self._puller = KvPuller(self._options, self._engine.call, batch, fingerprint,
                                self._ranks)

    async def before(self, cache_ids: Sequence[int], source: Source | None,
                     resumed: bool) -> None:
        """Before a request starts: its prefix read from disk, or pulled from `source`
        (never for a resume, whose ids end in sampled tokens)."""
        if self._disk_reads is not None:
            await self._disk_reads.before(cache_ids)  # off the engine thread
        if source is not None and self._puller is not None and not resumed:
            result = await self._puller.before(tuple(cache_ids), source)
            if result is not None:
                self._on_pull(result)

    def prefilled(self, last: list[OutputEvent], to_first: float) -> None:
        """Teach the puller this replica's prefill rate from a finished request."""
        finished = [e for e in last if isinstance(e, Finished)]
        if self._puller is not None and finished:
            usage = finished[-1].usage
            self._puller.prefilled(usage.prompt_tokens - usage.cached_tokens, to_first)

    async def export(self, pull: PrefixPull) -> PrefixKV | None:
        """Another replica's pull: the KV of the longest prefix of its prompt held here."""
        if self._puller is None:
            return None
        if self._disk_reads is not None:  # a prefix on disk is read off the engine thread
            await self._disk_reads.before(pull.tokens)
        return await self._puller.export(pull)

    def totals(self) -> dict[str, Any]:
        """Prefix pulls so far: outcomes, and the prompt tokens and bytes pulled."""
        puller = self._puller
        if puller is None:
            return {}
        return {"outcomes": dict(puller.outcomes), "tokens": puller.pulled_tokens,
                "bytes": puller.pulled_bytes}
