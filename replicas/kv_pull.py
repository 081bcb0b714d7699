"""Pull instead of recompute: before a request starts, fetch its prompt's prefix KV from
another replica of the same model, when that pays.

Two sources (`Source`): a replica the router names as holding the prefix (the cluster
prefix directory), asked when moving the KV is estimated faster than prefilling it here;
and a prefill replica (`role: prefill`), asked for every long prompt, which prefills it
there and hands its KV over, so that long prefills never stall this replica's decoding
streams. The deployment turns either into a `Fetch` over Ray (`KvPuller.export` or
`ModelReplica.prefill_prefix` answers it). This module decides and moves bytes only: no
Ray, no HTTP.

A sharded replica moves its KV rank to rank: rank 0's part travels in the answer, and the
other ranks' parts as handles (`PrefixKV.ranks`) that the asker's rank r fetches from the
holder's rank r (`Ranks`, the deployment's transport), staged on every rank before rank 0
adopts the prefix for all of them (`replicas.engine.sharded.kv_parts`).

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
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal, Protocol, Sequence

from replicas.engine.batch.rows import Exported
from replicas.engine.kv.transfer import PrefixKV, PrefixPull, decode, encode
from replicas.options import PullOptions

log = logging.getLogger(__name__)

# Ask the holder for the KV of the longest prefix of these tokens it has, if it serves at
# least `at_least` of them.
Fetch = Callable[[tuple[int, ...], int], Awaitable[PrefixKV | None]]
EngineCall = Callable[[Callable[[], Any]], Any]  # `Engine.call`: a concurrent Future
Outcome = Literal["pulled", "declined", "failed", "recomputed"]
SourceKind = Literal["holder", "prefill"]


class KvHome(Protocol):
    """Where exported KV comes from and pulled KV lands: the replica's batch
    (`replicas.engine.batch.local.Batch`), on the engine thread only."""

    def held_length(self, tokens: Sequence[int]) -> int: ...
    def export_prefix(self, tokens: Sequence[int], at_least: int) -> Exported | None: ...
    def adopt(self, tokens: Sequence[int], layers: list[Any], staged: str = "") -> None: ...


class Ranks(Protocol):
    """A sharded replica's other ranks, as the deployment reaches them."""

    def attach(self, kv: PrefixKV) -> PrefixKV:
        """The holder: `kv` with handles to the other ranks' parts of `kv.export_id`."""
        ...

    async def stage(self, staged: str, kv: PrefixKV) -> None:
        """The asker: rank r fetches part r of `kv` and keeps it under `staged`; raises
        unless every rank did."""
        ...

    def discard(self, staged: str) -> None:
        """The asker gave up on `staged`: every rank frees its part."""
        ...


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
    `home` is the batch, reached on the engine thread only (through `call`); `ranks` a
    sharded replica's other ranks."""

    def __init__(self, options: PullOptions, call: EngineCall, home: KvHome,
                 fingerprint: str, ranks: Ranks | None = None) -> None:
        self.options = options
        self._call = call
        self._home = home
        self._ranks = ranks
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
        have: int = await self._on_engine(lambda: self._home.held_length(prompt))
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
            log.warning("a pulled KV prefix is for another model, sharding or prompt; "
                        "not used")
            return ended("failed")
        staged = await self._stage(kv)
        if staged is None:
            return ended("failed")
        try:
            layers = await asyncio.to_thread(decode, kv.payload)
            await self._on_engine(lambda: self._home.adopt(kv.tokens, layers, staged))
        except Exception as exc:  # noqa: BLE001 - a failed pull costs a prefill: it must
            # not escape `stream`, where it would look like a dead replica and be resumed
            log.warning("a pulled KV prefix could not be decoded or adopted (%s: %s); "
                        "prefilling it", type(exc).__name__, exc)
            if self._ranks is not None and staged:
                self._ranks.discard(staged)
            return ended("failed")
        seconds = time.monotonic() - started
        saved = len(kv.tokens) - have
        self.link.observe(kv.payload.nbytes, seconds)
        self.token_bytes = kv.payload.nbytes / len(kv.tokens)
        self.pulled_tokens += saved
        self.pulled_bytes += kv.payload.nbytes
        log.info("pulled the KV of %d prompt tokens (%d bytes) from a %s replica in %.3f s",
                 saved, kv.payload.nbytes, source.kind, seconds)
        return self._count(PullResult("pulled", saved, kv.payload.nbytes, seconds, source.kind))

    async def _stage(self, kv: PrefixKV) -> str | None:
        """The other ranks' parts fetched and staged under a new id ("" unsharded); None
        when a rank failed, with every staged part freed."""
        if self._ranks is None:
            return ""
        staged = uuid.uuid4().hex
        try:
            await self._ranks.stage(staged, kv)
        except Exception as exc:  # noqa: BLE001 - a failed pull costs a prefill
            log.warning("a rank could not take its part of a pulled prefix (%s: %s); "
                        "prefilling", type(exc).__name__, exc)
            self._ranks.discard(staged)
            return None
        return staged

    def _count(self, result: PullResult) -> PullResult:
        name = result.outcome if result.source == "holder" else f"{result.source} {result.outcome}"
        self.outcomes[name] = self.outcomes.get(name, 0) + 1
        return result

    # ---- the holder ---------------------------------------------------------------------

    async def export(self, pull: PrefixPull) -> PrefixKV | None:
        """The KV of the longest prefix of `pull.tokens` this replica holds (memory or
        disk), encoded off the engine thread; None under `pull.at_least` tokens."""
        found: Exported | None = await self._on_engine(
            lambda: self._home.export_prefix(pull.tokens, pull.at_least))
        if found is None:
            return None
        kv = PrefixKV(found.tokens, await asyncio.to_thread(encode, found.snap),
                      self.fingerprint, found.export_id)
        return self._ranks.attach(kv) if self._ranks is not None else kv
