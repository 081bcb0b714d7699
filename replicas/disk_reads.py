"""Read instead of recompute: before a request starts, the prefix its prompt shares with an
entry of the prefix cache's disk tier is read into memory, as a pull brings one from
another replica (`replicas.kv_pull`): the engine thread only decides (a trie lookup) and
adopts; reading the file, checking its SHA-256 and evaluating the arrays happen on a
worker thread. A 10 GiB entry would otherwise stall every decoding stream for seconds.
No Ray, no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

from replicas.engine.kv.prefix_cache import PromptCache

log = logging.getLogger(__name__)

EngineCall = Callable[[Callable[[], Any]], Any]  # `Engine.call`: a concurrent Future


class DiskReads:
    """One replica's reads from its disk tier; `cache` is reached on the engine thread
    only (through `call`), except for its thread-safe `read_disk`."""

    def __init__(self, call: EngineCall, cache: PromptCache) -> None:
        self._call = call
        self._cache = cache
        self.tokens = 0  # prompt tokens read from disk ahead of their requests

    async def _on_engine(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._call(fn))

    async def before(self, prompt: Sequence[int]) -> int:
        """Read `prompt`'s prefix from the disk tier into memory where that pays: the
        prompt tokens it serves (0: nothing read)."""
        tokens = list(prompt)
        cache = self._cache
        found = await self._on_engine(lambda: cache.disk_wanted(tokens))
        if found is None:
            return 0
        try:
            layers = await asyncio.to_thread(cache.read_disk, found)
            if layers is None:  # the file failed its check: dropped, prefilled instead
                return 0
            await self._on_engine(lambda: cache.take_disk(found, layers))
        except Exception:  # noqa: BLE001 - a failed read costs a prefill, not the request
            log.exception("reading %d prompt tokens' KV from disk failed; prefilling them",
                          found.length)
            return 0
        self.tokens += found.length
        return int(found.length)
