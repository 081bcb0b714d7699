"""Tenant limits counted across every HTTP replica (issue 61): with N replicas each counting
on its own, a tenant would get N times its limits.

`SharedCounts` is what the edge needs from the one place the counts live (the deployments
layer implements it with a Ray actor, `deployments.tenant_counts`; the edge never imports
Ray). `SharedLedger` is the `Ledger` the app then uses:

- a request of a tenant with `max_concurrent` takes a seat there (one call per such request,
  none per token) and gives it back when it ends;
- tokens are spent locally as they stream and sent there in one batch every `SYNC_PERIOD_S`;
  the answer is every replica's tokens over the sliding minute, which this replica's limit
  checks and headers read until the next sync (a cache). So the tokens-per-minute limit may
  be passed by what the other replicas spent since the last sync, as it already may by what
  admitted requests spend as they stream;
- the syncs run only while this replica has something to send or hold (a request in flight,
  tokens unsent): an idle replica does not call the shared place at all. The first request
  after a pause older than `STALE_S` waits for one sync before its check, so a long-idle
  replica never admits on a stale minute.

Should the shared place not answer (within `CALL_TIMEOUT_S`), this replica counts on its own
(logged), as without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

from ingress.tenancy.ledger import Ledger, _Account, busy
from ingress.tenancy.policy import TenantPolicy

log = logging.getLogger(__name__)

SYNC_PERIOD_S = 0.5
CALL_TIMEOUT_S = 2.0
# Windows older than this are refreshed before a request's check (after an idle pause).
STALE_S = 2 * SYNC_PERIOD_S


@dataclass(frozen=True)
class TenantWindow:
    """One tenant cluster-wide, as the shared counts know it."""

    spent: tuple[tuple[float, int], ...]  # (age in seconds, tokens) over the last minute
    seats: int  # requests in flight that hold a seat


class SharedCounts(Protocol):
    """The counts every HTTP replica shares. `holder` names the calling replica: its seats
    are freed if it stops syncing (it died holding them). A seat is named by its `ticket`,
    so freeing one whose taking was cut short (its answer never read) is safe either way."""

    async def take_seat(self, holder: str, tenant: str, limit: int, ticket: str) -> bool:
        """One more request in flight for `tenant`, unless `limit` are already."""
        ...

    async def free_seat(self, holder: str, tenant: str, ticket: str) -> None: ...

    async def sync(self, holder: str, spent: Mapping[str, int]) -> Mapping[str, TenantWindow]:
        """Add `spent` (tokens by tenant, since the last sync) and answer every tenant's
        window, this call's tokens included."""
        ...


class SharedLedger(Ledger):
    def __init__(self, shared: SharedCounts, clock: Callable[[], float] = time.monotonic,
                 period_s: float = SYNC_PERIOD_S) -> None:
        super().__init__(clock)
        self._shared = shared
        self._period_s = period_s
        self.holder = uuid.uuid4().hex
        self._unsynced: Counter[str] = Counter()  # tokens spent here since the last sync
        self._seats: dict[str, list[str]] = {}  # tickets of the seats held here, by tenant
        self._others: dict[str, int] = {}  # other replicas' seats at the last sync
        self._loop: asyncio.Task[None] | None = None
        self._frees: set[asyncio.Task[None]] = set()
        self._failing = False
        self._tried_at: float | None = None  # the last sync's start, answered or not
        self._refresh: asyncio.Task[None] | None = None  # the sync an admission waits for
        self.syncs = 0  # calls made, for the tests and the curious

    async def admit(self, policy: TenantPolicy) -> None:
        await self._fresh()
        self._start()
        account = self._account(policy.name)
        self._check_tokens(policy, account)  # cluster-wide, as of the last sync
        limit = policy.max_concurrent
        if limit is not None:
            ticket = uuid.uuid4().hex
            try:
                seated = await asyncio.wait_for(
                    self._shared.take_seat(self.holder, policy.name, limit, ticket),
                    CALL_TIMEOUT_S)
            except BaseException as exc:
                self._free_later(policy.name, ticket)  # in case it was taken after all
                if not isinstance(exc, Exception):
                    raise  # cancelled: the request is gone
                self._down("taking a seat", exc)
                self.enter(policy)  # the limit holds on this replica, if not across
                return
            if not seated:
                raise busy(policy.name, limit, limit)
            self._seats.setdefault(policy.name, []).append(ticket)
        account.in_flight += 1

    def leave(self, tenant: str) -> None:
        super().leave(tenant)
        tickets = self._seats.get(tenant)
        if tickets:  # seats are alike: any one of the tenant's goes back
            self._free_later(tenant, tickets.pop())

    def _free_later(self, tenant: str, ticket: str) -> None:
        task = asyncio.get_running_loop().create_task(self._free(tenant, ticket))
        self._frees.add(task)
        task.add_done_callback(self._frees.discard)

    async def _free(self, tenant: str, ticket: str) -> None:
        try:
            await asyncio.wait_for(self._shared.free_seat(self.holder, tenant, ticket),
                                   CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a lost free: the seat is the actor's to end
            self._down("freeing a seat", exc)

    def spend(self, tenant: str, tokens: int) -> None:
        super().spend(tenant, tokens)
        if tokens > 0:
            self._unsynced[tenant] += tokens

    def _in_flight(self, tenant: str, account: _Account) -> int:
        return self._others.get(tenant, 0) + account.in_flight

    async def _fresh(self) -> None:
        """One sync now, unless the cached windows are recent (the loop keeps them so while
        this replica is busy); requests arriving together wait for the same one. A failed
        one counts as tried: while the shared place is down nobody waits on it twice."""
        if self._tried_at is not None and self._clock() - self._tried_at <= STALE_S:
            return
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self.sync())
        await asyncio.shield(self._refresh)

    async def sync(self) -> None:
        """Send the tokens spent here since the last sync; take every replica's window."""
        self._tried_at = self._clock()
        self.syncs += 1
        spent = dict(self._unsynced)
        self._unsynced.clear()
        try:
            windows = await asyncio.wait_for(self._shared.sync(self.holder, spent),
                                             CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - counted here until it answers again
            self._unsynced.update(spent)
            self._down("syncing", exc)
            return
        if self._failing:
            log.info("tenant limits: the shared counts answer again")
            self._failing = False
        now = self._clock()
        for tenant in set(self._accounts) | set(windows):
            window = windows.get(tenant, TenantWindow((), 0))
            account = self._accounts.setdefault(tenant, _Account())
            # Tokens spent here while the sync was away are not in its answer yet.
            account.spent = deque([*((now - age, n) for age, n in window.spent),
                                   *([(now, self._unsynced[tenant])]
                                     if self._unsynced[tenant] else [])])
            account.total = sum(n for _, n in account.spent)
            self._others[tenant] = max(0, window.seats - len(self._seats.get(tenant, ())))

    def _start(self) -> None:
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._syncing())

    async def _syncing(self) -> None:
        """Every period while busy; it ends once idle, after the sync that sent the last
        tokens, and the next admission starts it again."""
        while True:
            await asyncio.sleep(self._period_s)
            await self.sync()
            if self.idle():
                return

    def idle(self) -> bool:
        """Nothing here for the shared place: no request in flight (so no seat held, none
        whose holder must stay alive there) and no tokens unsent."""
        return not +self._unsynced and not any(self._seats.values()) and \
            not any(account.in_flight for account in self._accounts.values())

    def _down(self, what: str, exc: BaseException) -> None:
        if not self._failing:  # once per outage, not per request
            log.warning("tenant limits: the shared counts failed %s (%r); counting on this "
                        "replica alone until they answer", what, exc)
            self._failing = True
