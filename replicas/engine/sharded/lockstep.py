"""One batch on every rank of a sharded replica.

A model sharded with `mx.distributed` (tensor or pipeline parallel) runs one forward pass
across all its ranks, so every rank must run the same batch operations in the same order:
the same rows inserted with the same cached prefixes, the same steps, the same rows
finished. Rank 0 decides everything (it owns the engine, the requests, the output pipeline,
grammars and budgets); the others only follow.

- `LockstepBatch` (rank 0) wraps the local batch: it applies each operation at once and
  records it; before every step it sends the record to the other ranks (one `all_sum` of
  its pickled bytes, as `mlx_lm.server` shares requests between ranks), then steps.
- `Follower` (ranks 1..N-1) receives each record, replays it on its own local batch and
  steps. A rank waiting inside a collective spins a CPU core, so when the batch empties
  rank 0 says so (`_Idle`) and the others sleep until it wakes them (`wake`, a call through
  the caller's own channel: Ray in `deployments.shards`) as work arrives. Its prompt cache makes the same decisions as rank 0's (same tokens, same cost), and
  it checks that every cached prefix it reuses has rank 0's length, so a divergence fails
  loudly instead of corrupting a collective.
- `LockstepSampler`: only rank 0 samples (its logits processors mask grammars, force budget
  ends and ban tokens); the token it picks reaches every rank through an `all_sum` inside
  the step's graph, where the others add zeros. Each rank's next forward pass then embeds
  the same token.

Every collective runs on the batch's own stream, so one rank's message and the step that
mlx-lm evaluates asynchronously never overtake each other: each rank issues the same
collectives in the same order.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import mlx.core as mx
import numpy as np

from replicas.engine.batch.local import LocalBatch, Prefill
from replicas.engine.batch.rows import Done, Exported, Row
from replicas.engine.sharded.kv_parts import KvParts
from replicas.engine.kv.budget import KvBudget
from replicas.engine.kv.transfer import encode
from replicas.errors import InternalError
from replicas.engine.sampling.logprobs import Picked
from replicas.engine.kv.prefix_cache import PromptCache
from replicas.engine.sampling.samplers import Sampler, SeededSampler
from replicas.engine.stats import DecodeCounts

log = logging.getLogger(__name__)


class LockstepError(RuntimeError):
    """The ranks no longer agree; the replica must be replaced."""


@dataclass(frozen=True)
class _RowSpec:
    """A row as the other ranks need it: no sampler or processors, only its sampler's key
    (rows that share a sampler on rank 0 share one on every rank: mlx-lm samples a batch in
    one call only when all rows hold the same sampler, and the calls must match)."""

    prompt_ids: tuple[int, ...]
    boundary: int
    max_tokens: int
    stop_ids: frozenset[int]
    sampler_key: int
    cached: int  # prompt tokens rank 0 reused from its prefix cache


@dataclass(frozen=True)
class _Insert:
    rows: tuple[_RowSpec, ...]


@dataclass(frozen=True)
class _Finish:
    done: tuple[Done, ...]


@dataclass(frozen=True)
class _Bound:
    nbytes: int  # the prefix cache holds at most this from now on (its cost: equal on all ranks)


@dataclass(frozen=True)
class _Score:
    """A prompt scored now (`echo`): its forward pass runs on every rank, and no step
    follows this record."""

    prompt_ids: tuple[int, ...]


@dataclass(frozen=True)
class _Export:
    """Another replica pulls a cached prefix: every rank looks it up as rank 0 did (a
    lookup moves the entry in the cache's order), and where rank 0 found `length` tokens,
    keeps its part under `export_id` for the transport (`replicas.engine.sharded.kv_parts`). No
    step follows this record."""

    tokens: tuple[int, ...]
    at_least: int
    export_id: str  # "" where rank 0 found too little
    length: int


@dataclass(frozen=True)
class _Adopt:
    """A pulled prefix, adopted by every rank: each its own part, staged beforehand."""

    tokens: tuple[int, ...]
    staged: str


@dataclass(frozen=True)
class _Idle:
    """The batch is empty: no step follows until rank 0 wakes the others."""


@dataclass(frozen=True)
class _Stop:
    pass


_Op = Union[_Insert, _Finish, _Bound, _Score, _Export, _Adopt, _Idle, _Stop]
# Records sent between steps: the other ranks apply them and take no step after.
_BETWEEN_STEPS = (_Score, _Export, _Adopt)


class Channel:
    """Rank 0's records to the other ranks: a size, then the pickled bytes, each one
    `all_sum` in which only rank 0 contributes. A step with nothing new costs the size only."""

    def __init__(self, group: mx.distributed.Group, stream: mx.Stream) -> None:
        self._group = group
        self._stream = stream

    def _sum(self, value: mx.array) -> mx.array:
        out = mx.distributed.all_sum(value, group=self._group, stream=self._stream)
        mx.eval(out)
        return out

    def send(self, ops: list[_Op]) -> None:
        data = pickle.dumps(ops) if ops else b""
        self._sum(mx.array([len(data)], dtype=mx.int32))
        if data:
            self._sum(mx.array(np.frombuffer(data, dtype=np.uint8)))

    def receive(self) -> list[_Op]:
        size = int(np.array(self._sum(mx.zeros((1,), dtype=mx.int32)))[0])
        if size == 0:
            return []
        data = np.array(self._sum(mx.zeros((size,), dtype=mx.uint8)), copy=False).tobytes()
        ops = pickle.loads(data)  # noqa: S301 - rank 0 of this same replica wrote it
        assert isinstance(ops, list)
        return ops


class LockstepSampler:
    """Rank 0 samples with `inner`; every rank gets rank 0's tokens."""

    def __init__(self, group: mx.distributed.Group, inner: Sampler | None) -> None:
        self._group = group
        self._inner = inner  # None on the other ranks

    @property
    def local(self) -> Sampler | None:
        return self._inner

    def __call__(self, logprobs: mx.array) -> mx.array:
        inner = self._inner
        if isinstance(inner, SeededSampler) and logprobs.shape[0] > 1:
            # A verifying pass's positions of one seeded row: drawn ahead, as unsharded
            # (`Generation` then advances the key by the tokens kept).
            mine = inner.ahead(logprobs).astype(mx.int32)
        elif inner is not None:
            mine = inner(logprobs).astype(mx.int32)
        else:
            # Zeros that still depend on this step's logits: the sum must come after the
            # step's own collectives, on every rank alike.
            mine = mx.depends(mx.zeros((logprobs.shape[0],), dtype=mx.int32), logprobs)
        return mx.distributed.all_sum(mine, group=self._group)


class LockstepBatch:
    """Rank 0's batch: a `LocalBatch` whose every operation the other ranks replay."""

    def __init__(self, local: LocalBatch, group: mx.distributed.Group,
                 wake: Callable[[], None], on_sync: Callable[[float], None] | None = None
                 ) -> None:
        self._local = local
        self._wake = wake
        self._group = group
        self._channel = Channel(group, local.stream)
        self._on_sync = on_sync
        self._log: list[_Op] = []
        # Rank 0's samplers, each wrapped once while any row holds it (keyed by identity).
        self._wrapped: weakref.WeakValueDictionary[int, _KeyedSampler] = \
            weakref.WeakValueDictionary()
        self._next_key = 0

    @property
    def cache(self) -> PromptCache | None:
        return self._local.cache

    @property
    def empty(self) -> bool:
        return self._local.empty

    def decode_counts(self) -> DecodeCounts:
        return self._local.decode_counts()

    def _wrap(self, sampler: Sampler) -> _KeyedSampler:
        wrapped = self._wrapped.get(id(sampler))
        if wrapped is None:  # the wrapper holds `sampler`, so its id is not reused meanwhile
            self._next_key += 1
            wrapped = _KeyedSampler(self._next_key, LockstepSampler(self._group, sampler))
            self._wrapped[id(sampler)] = wrapped
        return wrapped

    def begin(self, row: Row) -> Prefill | None:
        if row.embeddings is not None:  # never sent: a sharded replica reads text only
            raise InternalError("a sharded replica does not take prompt embeddings")
        return None

    def advance(self, prefill: Prefill) -> bool:
        raise InternalError("a sharded replica does not take prompt embeddings")

    def insert(self, rows: Sequence[Row]) -> list[tuple[int, int]]:
        if self._local.empty:
            self._wake()  # the others sleep since the batch emptied; the next step needs them
        wrapped = [self._wrap(r.sampler) for r in rows]
        placed = self._local.insert([_with_sampler(r, w) for r, w in zip(rows, wrapped)])
        self._log.append(_Insert(tuple(
            _RowSpec(r.prompt_ids, r.boundary, r.max_tokens, r.stop_ids, w.key, cached)
            for r, w, (_, cached) in zip(rows, wrapped, placed))))
        return placed

    def step(self) -> list[Any]:
        try:
            started = time.perf_counter()
            self._channel.send(self._log)
            self._log = []
            if self._on_sync is not None:
                self._on_sync(time.perf_counter() - started)
            return self._local.step()
        except Exception as exc:
            # A collective fails when a peer rank is gone (the ring sees its socket close),
            # often before the shard watch names the shard: say so to the clients.
            raise InternalError(f"a step with the model's other shards failed "
                                f"({type(exc).__name__}); a shard may be lost") from exc

    def finish(self, done: Sequence[Done]) -> None:
        self._local.finish(done)
        self._log.append(_Finish(tuple(done)))
        self._idle_if_empty()

    def recover(self) -> bool:
        """Never: after a failed step the other ranks may still be inside it, and any new
        collective would meet theirs out of order (garbage or a hang). The engine stops
        and the replica is replaced, every rank with it."""
        return False
        self._idle_if_empty()

    def page(self, kv: KvBudget, context_length: int) -> None:
        """A sharded replica keeps the padded batch (each rank paging its own part in
        lockstep is not built yet); `paged_kv: on` refuses to load."""
        if self._local._config.paged_kv == "on":  # noqa: SLF001 - the local batch's config
            raise ValueError("memory.paged_kv is on, but a sharded replica does not page yet")

    def bound_cache(self, nbytes: int) -> None:
        self._local.bound_cache(nbytes)
        self._log.append(_Bound(nbytes))

    def score(self, prompt_ids: Sequence[int], top: int,
              adapter: str | None = None) -> list[Picked]:
        if adapter is not None:  # a sharded replica loads no adapters (`replicas.replica`)
            raise ValueError("a sharded replica serves no LoRA adapters")
        self._send_now(_Score(tuple(prompt_ids)))
        picked = self._local.score(prompt_ids, top)
        self._idle_if_empty()
        return picked

    def held_length(self, tokens: Sequence[int]) -> int:
        return self._local.held_length(tokens)

    def export_prefix(self, tokens: Sequence[int], at_least: int) -> Exported | None:
        """Rank 0's part, and the other ranks told to keep theirs under its id."""
        exported = self._local.export_prefix(tokens, at_least)
        if exported is not None:
            exported = dataclasses.replace(exported, export_id=uuid.uuid4().hex)
        self._send_now(_Export(tuple(tokens), at_least, exported.export_id if exported else "",
                               len(exported.tokens) if exported else 0))
        self._idle_if_empty()
        return exported

    def adopt(self, tokens: Sequence[int], layers: list[Any], staged: str = "") -> None:
        """Rank 0's part, and every other rank's (staged beforehand), now: a part staged
        long before its record arrived would have expired (`kv_parts.PART_TTL_S`)."""
        if not staged:
            raise InternalError("a sharded replica adopts pulled KV from every rank")
        self._local.adopt(tokens, layers)
        self._send_now(_Adopt(tuple(tokens), staged))
        self._idle_if_empty()

    def _send_now(self, op: _Op) -> None:
        """`op` (and what is recorded before it) to the other ranks now, between steps."""
        if self._local.empty:
            self._wake()
        self._channel.send(self._log + [op])
        self._log = []

    def _idle_if_empty(self) -> None:
        if self._local.empty:  # the engine waits for work: let the others sleep meanwhile
            self._channel.send(self._log + [_Idle()])
            self._log = []

    def close(self) -> None:
        """Tell the other ranks to stop (they return from `Follower.run`)."""
        self._wake()
        self._channel.send(self._log + [_Stop()])
        self._log = []


class Follower:
    """Ranks 1..N-1: replay rank 0's records on a local batch until told to stop."""

    def __init__(self, local: LocalBatch, group: mx.distributed.Group,
                 wait_for_work: Callable[[], None], parts: KvParts | None = None) -> None:
        """`wait_for_work` returns once rank 0 has called its `wake` (at once if it did
        since the last wait). `parts`: where this rank's parts of moving KV wait for the
        transport (`replicas.engine.sharded.kv_parts`)."""
        self._local = local
        self._parts = parts if parts is not None else KvParts()  # empty is falsy
        self._encoder: ThreadPoolExecutor | None = None  # made at the first export
        self._group = group
        self._wait_for_work = wait_for_work
        self._channel = Channel(group, local.stream)
        self._samplers: weakref.WeakValueDictionary[int, _KeyedSampler] = \
            weakref.WeakValueDictionary()
        self.steps = 0

    def run(self) -> None:
        self._wait_for_work()  # the batch starts empty
        while True:
            ops = self._channel.receive()
            for op in ops:
                if isinstance(op, _Stop):
                    return
                self._apply(op)
            if ops and isinstance(ops[-1], _Idle):
                self._wait_for_work()
                continue
            if ops and isinstance(ops[-1], _BETWEEN_STEPS):
                continue  # rank 0 scored or exported between steps: no step follows
            self._local.step()
            self.steps += 1

    def _apply(self, op: _Op) -> None:
        if isinstance(op, _Insert):
            placed = self._local.insert([self._row(spec) for spec in op.rows])
            for spec, (_, cached) in zip(op.rows, placed):
                if cached != spec.cached:
                    raise LockstepError(f"prefix cache diverged: rank 0 reused {spec.cached} "
                                        f"prompt tokens, this rank {cached}")
        elif isinstance(op, _Finish):
            self._local.finish(op.done)
        elif isinstance(op, _Bound):
            self._local.bound_cache(op.nbytes)
        elif isinstance(op, _Score):
            self._local.score(op.prompt_ids, 0)
        elif isinstance(op, _Export):
            self._export(op)
        elif isinstance(op, _Adopt):
            layers = self._parts.take_import(op.staged)
            if layers is None:  # rank 0 adopts only after every rank staged its part
                raise LockstepError(f"pulled KV {op.staged} was never staged on this rank")
            self._local.adopt(op.tokens, layers)

    def _export(self, op: _Export) -> None:
        exported = self._local.export_prefix(op.tokens, op.at_least)
        found = len(exported.tokens) if exported else 0
        if found != op.length:
            raise LockstepError(f"prefix cache diverged: rank 0 exports {op.length} tokens, "
                                f"this rank {found}")
        if exported is not None:
            if self._encoder is None:
                self._encoder = ThreadPoolExecutor(1, thread_name_prefix="orchard-kv-encode")
            # Encoding a long prefix's part stalls no step: the next op may be a step.
            self._parts.export(op.export_id, self._encoder.submit(encode, exported.snap))

    def _row(self, spec: _RowSpec) -> Row:
        sampler = self._samplers.get(spec.sampler_key)
        if sampler is None:
            sampler = _KeyedSampler(spec.sampler_key, LockstepSampler(self._group, None))
            self._samplers[spec.sampler_key] = sampler
        return Row(spec.prompt_ids, spec.boundary, spec.max_tokens, spec.stop_ids, sampler)


class _KeyedSampler:
    """A lockstep sampler with the key that names it on every rank."""

    def __init__(self, key: int, sampler: LockstepSampler) -> None:
        self.key = key
        self._sampler = sampler

    @property
    def local(self) -> Sampler | None:
        """Rank 0's own sampler (None elsewhere), which runs without a collective."""
        return self._sampler.local

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._sampler(logprobs)


def _with_sampler(row: Row, sampler: Sampler) -> Row:
    return dataclasses.replace(row, sampler=sampler)
