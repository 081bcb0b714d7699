"""Pull instead of recompute: before a request starts, fetch its prompt's prefix KV from
another replica of the same model, when that pays.

Two sources (`Source`): a replica the router names as holding the prefix (the cluster
prefix directory), asked when moving the KV is estimated faster than prefilling it here;
and a prefill replica (`role: prefill`), asked for every long prompt, which prefills it
there and hands its KV over, so that long prefills never stall this replica's decoding
streams. The deployment turns either into a `Fetch` over Ray (`KvPuller.export` or
`ModelReplica.prefill_prefix` answers it). This module decides and moves bytes only: no
Ray, no HTTP.

The decision compares two estimates per missing token: its KV bytes over the link's rate
(measured on this replica's earlier pulls; `link_bytes_per_s` until then) against its
share of a prefill (this replica's own prefills, timed from submit to first token). Both
are linear in the tokens, so `min_tokens` stands for the fixed cost of asking: a short
prefix is simply recomputed. Until a prefill has been timed, a long prefix is pulled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

from replicas.engine.disk_cache import snapshot
from replicas.engine.kv_transfer import PrefixKV, PrefixPull, decode, encode
from replicas.engine.prompt_cache import PromptCache
from replicas.options import PullOptions

log = logging.getLogger(__name__)

# Ask the holder for the KV of the longest prefix of these tokens it has, if it serves at
# least `at_least` of them.
Fetch = Callable[[tuple[int, ...], int], Awaitable[PrefixKV | None]]
EngineCall = Callable[[Callable[[], Any]], Any]  # `Engine.call`: a concurrent Future
Outcome = Literal["pulled", "declined", "failed", "recomputed"]
SourceKind = Literal["holder", "prefill"]


@dataclass(frozen=True)
class Source:
    """Where a request's prefix KV may come from, and when to ask."""

    fetch: Fetch
    min_tokens: int  # ask when at least this many prompt tokens are missing here
    # A holder is asked only where moving beats prefilling here; a prefill replica always
    # (its point is to keep long prefills off this replica's decode steps).
    estimate: bool = True
    kind: SourceKind = "holder"


@dataclass(frozen=True)
class PullResult:
    outcome: Outcome  # declined: the holder no longer had enough; recomputed: not worth it
    tokens: int = 0  # prompt tokens the pulled KV saved from prefill
    nbytes: int = 0
    seconds: float = 0.0
    source: SourceKind = "holder"


class Rate:
    """A moving average of amount per second (recent samples weigh 30%)."""

    def __init__(self, initial: float | None = None) -> None:
        self.value = initial

    def observe(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        sample = amount / seconds
        self.value = sample if self.value is None else 0.7 * self.value + 0.3 * sample


class KvPuller:
    """One replica's side of pulling: the asker's (`before`) and the holder's (`export`).
    `cache` gives the batch's prefix cache, on the engine thread only (through `call`)."""

    def __init__(self, options: PullOptions, call: EngineCall,
                 cache: Callable[[], PromptCache | None], fingerprint: str) -> None:
        self.options = options
        self._call = call
        self._cache = cache
        self.fingerprint = fingerprint
        self.link = Rate(options.link_bytes_per_s)  # bytes per second
        self.prefill = Rate()  # prompt tokens per second
        self.token_bytes: float | None = None  # KV bytes per token, from pulls
        self.pulled_tokens = 0
        self.pulled_bytes = 0
        self.outcomes: dict[str, int] = {}

    def faster(self, missing: int) -> bool:
        """Whether moving `missing` tokens' KV is estimated faster than prefilling them."""
        if self.prefill.value is None or self.token_bytes is None or not self.link.value:
            return True  # nothing measured yet: a long prefix is worth a try
        return missing * self.token_bytes / self.link.value < missing / self.prefill.value

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A request prefilled `tokens` prompt tokens and its first token came `seconds`
        after it was submitted (queueing included, which only favours pulling)."""
        if tokens >= self.options.min_tokens:
            self.prefill.observe(tokens, seconds)

    async def _on_engine(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._call(fn))

    # ---- the asker ----------------------------------------------------------------------

    async def before(self, prompt: tuple[int, ...], source: Source) -> PullResult | None:
        """Pull `prompt`'s prefix into this replica's cache from `source` when it pays;
        None when this replica lacks too little of it to ask."""
        if len(prompt) - 1 < source.min_tokens:
            return None  # too short to ask whatever is cached: no engine round trip
        have: int = await self._on_engine(lambda: self._held(prompt))
        missing = len(prompt) - 1 - have  # the last token is always computed
        if missing < source.min_tokens:
            return None
        if source.estimate and not self.faster(missing):
            return self._count(PullResult("recomputed", source=source.kind))
        started = time.monotonic()

        def ended(outcome: Outcome) -> PullResult:
            return self._count(PullResult(outcome, seconds=time.monotonic() - started,
                                          source=source.kind))

        try:
            kv = await asyncio.wait_for(source.fetch(prompt, have + source.min_tokens),
                                        self.options.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed pull costs a prefill, not the request
            log.warning("pulling %d prompt tokens' KV from a %s replica failed (%s: %s); "
                        "prefilling them", missing, source.kind, type(exc).__name__, exc)
            return ended("failed")
        if kv is None:
            return ended("declined")
        if kv.fingerprint != self.fingerprint or prompt[:len(kv.tokens)] != kv.tokens:
            log.warning("a pulled KV prefix is for another model or prompt; not used")
            return ended("failed")
        layers = await asyncio.to_thread(decode, kv.payload)
        await self._on_engine(lambda: self._adopt(kv.tokens, layers))
        seconds = time.monotonic() - started
        saved = len(kv.tokens) - have
        self.link.observe(kv.payload.nbytes, seconds)
        self.token_bytes = kv.payload.nbytes / len(kv.tokens)
        self.pulled_tokens += saved
        self.pulled_bytes += kv.payload.nbytes
        log.info("pulled the KV of %d prompt tokens (%d bytes) from a %s replica in %.3f s",
                 saved, kv.payload.nbytes, source.kind, seconds)
        return self._count(PullResult("pulled", saved, kv.payload.nbytes, seconds, source.kind))

    def _held(self, prompt: tuple[int, ...]) -> int:
        cache = self._cache()
        return cache.held_length(list(prompt)) if cache is not None else len(prompt)

    def _adopt(self, tokens: tuple[int, ...], layers: list[Any]) -> None:
        cache = self._cache()
        if cache is not None:
            cache.adopt(list(tokens), layers)

    def _count(self, result: PullResult) -> PullResult:
        name = result.outcome if result.source == "holder" else f"{result.source} {result.outcome}"
        self.outcomes[name] = self.outcomes.get(name, 0) + 1
        return result

    # ---- the holder ---------------------------------------------------------------------

    async def export(self, pull: PrefixPull) -> PrefixKV | None:
        """The KV of the longest prefix of `pull.tokens` this replica holds (memory or
        disk), encoded off the engine thread; None under `pull.at_least` tokens."""
        def take() -> tuple[tuple[int, ...], Any] | None:
            cache = self._cache()
            hit = cache.fetch(list(pull.tokens), count=False) if cache is not None else None
            if hit is None or hit.length < pull.at_least:
                return None
            return pull.tokens[:hit.length], snapshot(hit.cache)

        found = await self._on_engine(take)
        if found is None:
            return None
        tokens, snap = found
        return PrefixKV(tokens, await asyncio.to_thread(encode, snap), self.fingerprint)
