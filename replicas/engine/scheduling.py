"""Who joins the batch, and who leaves it when KV memory runs out (engine thread only).

A request waits in `Waiting` until its prompt fits (`replicas.engine.kv.budget`); in the batch
its reservation grows a cache step at a time. On a paged batch a request that hits the
prefix cache reserves only the blocks it will own: the hit's full blocks count once among
every row that shares them (`KvBudget.shares`, looked up at admission and settled to what
the batch holds before each step). When a reservation cannot grow, the youngest
request is preempted, vLLM's recompute preemption: it leaves the batch and waits first in
line as its prompt plus the tokens it generated, with fewer left to generate and its
sampler's count moved on, so when it rejoins it goes on exactly where it stopped. The
engine (`core.py`) does the batch operations; this module decides.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping, Sequence

from replicas.contract import ErrorKind, Failed, Tenancy
from replicas.engine.config import EngineConfig
from replicas.engine.delivery import deliver
from replicas.engine.fair_share import FairShare, TenantTally, tenanted, victim
from replicas.engine.kv.budget import Bound, KvBudget
from replicas.engine.kv.shared_blocks import NO_BLOCKS
from replicas.engine.kv.layout import CACHE_STEP
from replicas.engine.request import EngineRequest, RequestOutput, Submitted
from replicas.engine.batch.local import Prefill
from replicas.engine.batch.rows import Row
from replicas.engine.sampling.penalties import Penalties
from replicas.engine.sampling.samplers import GuardedProcessors, guarded_processors, \
    make_request_sampler

log = logging.getLogger(__name__)

_MEMORY_FULL = "this replica's KV memory is taken and too many requests wait for it; retry later"
_MEMORY_WAIT = ("this replica's KV memory stayed taken for {:g}s while the request waited; "
                "retry later")
# A row's KV grows by the token fed in the step and by the one mlx-lm computes ahead,
# and by its drafts in a speculative step.
_STEP_GROWTH = 2


@dataclass
class Active:
    """A request in the batch."""

    uid: int
    sub: Submitted
    guard: GuardedProcessors | None
    cached: int  # prompt tokens the prefix cache served, for its usage
    order: int  # when it first joined: the highest is the youngest, preempted first
    preemptions: int = 0  # times it left the batch for KV memory (its usage reports them)
    # Tokens generated since it (re)joined: a preempted request's prompt grows by them.
    tokens: list[int] = field(default_factory=list)

    @property
    def output(self) -> RequestOutput:
        return self.sub.output

    @property
    def request_id(self) -> str:
        return self.sub.request_id


@dataclass(frozen=True)
class Queued:
    """A request waiting to join the batch: new (`resumed` None), or preempted."""

    sub: Submitted
    since: float  # monotonic time it started waiting
    resumed: Active | None = None  # what it was when preempted

    @property
    def request_id(self) -> str:
        return self.sub.request_id


def reach(request: EngineRequest, length: int, whole: bool, growth: int = _STEP_GROWTH) -> int:
    """The KV tokens a request of `length` tokens must hold through the next step (`whole`:
    all it may ever reach, the reservation that never preempts), never more than all it
    may reach, which admission's cap guarantees fits alone."""
    total = len(request.prompt_ids) + request.max_tokens
    return total if whole else min(length + growth, total)


def preempted(active: Active) -> Queued:
    """`active` as it waits to rejoin: its prompt grown by what it generated."""
    request, done = active.sub.request, len(active.tokens)
    resumed = replace(request, prompt_ids=request.prompt_ids + tuple(active.tokens),
                      max_tokens=request.max_tokens - done,
                      sampled_before=request.sampled_before + done, score_prompt=False)
    return Queued(Submitted(resumed, active.sub.output), time.monotonic(),
                  replace(active, tokens=[], preemptions=active.preemptions + 1))


class Waiting:
    """The queue for KV memory, and the admission and growth decisions over the budget."""

    def __init__(self, kv: KvBudget, config: EngineConfig) -> None:
        self.kv = kv
        self._config = config
        self._whole = config.kv_reservation == "whole"
        spec = config.speculative
        self._growth = _STEP_GROWTH + (spec.num_speculative_tokens if spec else 0)
        self.queue: deque[Queued] = deque()
        self._share = FairShare()
        self.tally = TenantTally()  # per tenant: admitted, queue waits, preempted
        rows = kv.budget_bytes // max(1, kv.layout.bytes_for(CACHE_STEP))
        if kv.paging is None and rows < config.max_batch_size:
            # mlx-lm's padded batch holds a row at least a cache step: short requests past
            # these rows wait for memory however little KV they use (issue 58).
            log.warning("the KV budget (%d bytes) holds %d rows of the padded batch (a row "
                        "takes at least a %d-token cache step, %d bytes), fewer than "
                        "max_batch_size %d: short requests past them wait for memory. "
                        "memory.paged_kv: auto holds what the rows use, where the model "
                        "qualifies", kv.budget_bytes, rows, CACHE_STEP,
                        kv.layout.bytes_for(CACHE_STEP), config.max_batch_size)

    def __len__(self) -> int:
        return len(self.queue)

    def admit(self, submits: Iterable[Submitted], cancelled: Callable[[str], bool],
              bound: Bound, active: Mapping[int, Active] | None = None,
              preempt: Callable[[Active], None] | None = None) -> list[Queued]:
        """Those that join the batch now, in order: the preempted first, then the rest while
        each fits. A cancelled one is dropped; past the waiting bound or the waiting time,
        new ones get the overloaded error (a preempted one has streamed: it keeps its place).
        Requests with a tenancy wait here for a free row of the batch (`active`) and join in
        fair-share order (`fair_share`), not in mlx-lm's first-come queue; with the batch
        full, a tenant below its share gets a row `preempt`ed from one above its own."""
        now = time.monotonic()
        pending = [q for q in (*self.queue, *(Queued(s, now) for s in submits))
                   if not cancelled(q.request_id)]
        pending = self._expire(pending, now)
        later: list[Queued] = []
        if tenanted(q.sub.request.tenancy for q in pending):
            rows = dict(active or {})
            if preempt is not None:
                pending += self._displace(pending, rows, preempt)
            pending, later = self._fair(pending, [a.sub.request.tenancy for a in rows.values()],
                                        now)
        admitted, queue, refused = self.kv.take(
            pending, lambda q: q.request_id,
            lambda q: reach(q.sub.request, len(q.sub.request.prompt_ids), self._whole,
                            self._growth),
            bound, keep=lambda q: q.resumed is not None,
            shares=self._shares if self.kv.shares is not None else None)
        self.queue = deque([*queue, *later])
        while later and len(self.queue) > self.kv.max_waiting and self.queue[-1].resumed is None:
            refused.append(self.queue.pop())
            self.kv.refused += 1
        self._share.admitted(q.sub.request.tenancy for q in admitted)
        for q in admitted:
            if q.resumed is None:
                self.tally.admitted(q.sub.request.tenancy.tenant, now - q.since)
        deliver([(q.sub.output.sink, [Failed(ErrorKind.OVERLOADED, _MEMORY_FULL)])
                 for q in refused])
        return admitted

    def _shares(self, q: Queued) -> frozenset[int]:
        """The prefix cache's blocks `q` would share in the batch (paged). None for a prompt
        with images (its hit is decided by `begin`) or one the engine scores first (the
        score's save may evict what a lookup now finds): they reserve every block."""
        request, shares = q.sub.request, self.kv.shares
        if shares is None or request.embeddings is not None or \
                (request.score_prompt and request.logprobs is not None):
            return NO_BLOCKS
        try:
            return shares.would_share(request.prompt_ids, request.adapter)
        except Exception:  # noqa: BLE001 - an adapter gone, say: reserve every block
            return NO_BLOCKS

    def _fair(self, pending: list[Queued], in_batch: Sequence[Tenancy],
              now: float) -> tuple[list[Queued], list[Queued]]:
        """(those that may join now, in order; those that wait for a row). Within a tenant
        its preempted requests go first: they have streamed."""
        resumed = [q for q in pending if q.resumed is not None]
        free = max(0, self._config.max_batch_size - len(in_batch))
        # Only the rows free now are picked fairly (fair share: the rest wait in arrival
        # order), unless the queue is past its bound: its fair order then says who is refused.
        take = None if len(pending) > self.kv.max_waiting else free
        ordered = self._share.order(resumed + [q for q in pending if q.resumed is None],
                                    lambda q: q.sub.request.tenancy, in_batch, take)
        self._share.seen((q.sub.request.tenancy for q in pending), now)
        if free and len(ordered) >= free:  # the last row would be taken: may it be?
            holders = {t.tenant for t in in_batch} | \
                {q.sub.request.tenancy.tenant for q in ordered[:free - 1]}
            if self._share.holds_last_row(ordered[free - 1].sub.request.tenancy.tenant,
                                          holders, now):
                free -= 1
        return ordered[:free], ordered[free:]

    def _displace(self, pending: list[Queued], rows: dict[int, Active],
                  preempt: Callable[[Active], None]) -> list[Queued]:
        """With the batch full, the rows preempted for waiting tenants below their share
        (taken out of `rows`), queued again."""
        if len(rows) < self._config.max_batch_size:
            return []
        donors = self._share.displace((q.sub.request.tenancy for q in pending),
                                      (a.sub.request.tenancy for a in rows.values()))
        queued = []
        for donor in donors:
            row = victim([a for a in rows.values() if a.sub.request.tenancy.tenant == donor],
                         lambda a: a.sub.request.tenancy, lambda a: a.order)
            preempt(row)
            del rows[row.uid]
            self.kv.preempted += 1
            self.tally.preempted(donor)
            log.info("request %s preempted after %d tokens (fair share): it resumes by "
                     "prefill", row.request_id, len(row.tokens))
            queued.append(preempted(row))
        return queued

    def _expire(self, pending: list[Queued], now: float) -> list[Queued]:
        limit = self._config.max_memory_wait_s
        if limit is None:
            return pending
        late = [q for q in pending if q.resumed is None and now - q.since > limit]
        if not late:
            return pending
        deliver([(q.sub.output.sink, [Failed(ErrorKind.OVERLOADED, _MEMORY_WAIT.format(limit))])
                 for q in late])
        return [q for q in pending if q not in late]

    def grow(self, active: dict[int, Active], bound: Bound,
             preempt: Callable[[Active], None]) -> None:
        """Before a step: every row's reservation covers the KV the step adds; where it
        cannot, `preempt` the lowest-priority, youngest row (`fair_share.victim`; the engine
        takes it out of the batch) and queue it first, until it can. Paged: first every
        row's shared blocks are settled to what the batch holds; where that passes the
        pool, the youngest are preempted until it fits."""
        if (shares := self.kv.shares) is not None:
            for row in active.values():
                held = shares.shared_by(row.uid)
                if held is not None:
                    self.kv.settle(row.request_id, held)
            while active and self.kv.over and not self._whole:
                self._preempt_youngest(active, preempt)
        if self._whole:
            return
        for row in sorted(active.values(), key=lambda a: a.order):
            need = reach(row.sub.request, len(row.sub.request.prompt_ids) + len(row.tokens),
                         False, self._growth)
            while row.uid in active and need > self.kv.reserved(row.request_id) and \
                    not self.kv.reserve(row.request_id, need, bound):
                self._preempt_youngest(active, preempt)

    def _preempt_youngest(self, active: dict[int, Active],
                          preempt: Callable[[Active], None]) -> None:
        youngest = victim(active.values(), lambda a: a.sub.request.tenancy, lambda a: a.order)
        preempt(youngest)
        self.kv.preempted += 1
        self.tally.preempted(youngest.sub.request.tenancy.tenant)
        log.info("request %s preempted after %d tokens (KV memory): it resumes by prefill",
                 youngest.request_id, len(youngest.tokens))
        self.queue.appendleft(preempted(youngest))


# A request ready to join the batch: its row, and the guard over its logits processors.
Ready = tuple[Queued, Row, GuardedProcessors | None]


def row_for(request: EngineRequest, eos: frozenset[int]) -> tuple[Row, GuardedProcessors | None]:
    """The batch row a request runs as (EOS ids are the model's), and its guard. Its bias
    and penalties come first (the batch applies them to all rows at once), then its own
    processors: a grammar sees penalised logits."""
    guard = guarded_processors(list(request.logits_processors))
    penalties = Penalties.of(request.sampling)
    processors = tuple(p for p in (penalties, guard) if p is not None)
    row = Row(request.prompt_ids, request.boundary, request.max_tokens,
              eos | request.stop_token_ids,
              make_request_sampler(request.sampling, request.sampled_before),
              processors, request.embeddings, request.adapter)
    return row, guard


class Prefills:
    """Requests whose prompt starts with embeddings (an image prefix), prefilled about a
    prefill step's worth of tokens per engine loop before they join the batch, oldest
    first, so the rows already decoding go on between chunks (`Batch.begin`, `advance`)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Ready, Prefill]] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def add(self, ready: Ready, prefill: Prefill) -> None:
        self._queue.append((ready, prefill))

    def advance(self, advance: Callable[[Prefill], bool],
                budget: int) -> tuple[list[Ready], list[Ready]]:
        """A chunk of each, oldest first, until about `budget` prompt tokens are prefilled in
        this loop (at least one chunk): many short image prefixes finish together, a long
        one takes its turns. Returns the ones done and the ones that failed (gone, logged)."""
        done: list[Ready] = []
        failed: list[Ready] = []
        spent = 0
        for entry in list(self._queue):
            if spent >= budget:
                break
            ready, prefill = entry
            before = prefill.done
            try:
                finished = advance(prefill)
            except Exception:  # noqa: BLE001 - the tower or the prefill: this request only
                log.exception("request %s: prefilling its image prefix failed",
                              ready[0].request_id)
                self._queue.remove(entry)
                failed.append(ready)
                continue
            spent += max(1, prefill.done - before)
            if finished:
                self._queue.remove(entry)
                done.append(ready)
        return done, failed

    def cancel(self, cancelled: Callable[[str], bool], kv: KvBudget) -> None:
        """Drop the cancelled ones, their KV reservations released."""
        for entry in [e for e in self._queue if cancelled(e[0][0].request_id)]:
            self._queue.remove(entry)
            kv.release(entry[0][0].request_id)

    def drain(self) -> list[Queued]:
        """All of them, gone (the engine stops)."""
        queued = [ready[0] for ready, _ in self._queue]
        self._queue.clear()
        return queued
