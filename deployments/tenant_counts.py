"""Tenant limits shared by every HTTP replica: one named Ray actor per application holds the
seats (requests in flight) and the tokens of the sliding minute of each tenant, and each
replica's `ingress.tenancy.shared.SharedLedger` reaches it through `RayTenantCounts`.

`TenantCounts` is the bookkeeping, plain (tested without Ray). A replica that stops syncing
for `HOLDER_TTL_S` died holding its seats: they are freed. The actor is restarted by Ray if
it dies, empty: the seats in flight then go uncounted until they end, and the minute's
tokens start again (no limit is stricter for it, only briefly looser). Seats are named
by tickets, so a free whose take was cut short (or came after a restart) is harmless.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, Callable, Mapping

import ray

from ingress.tenancy.shared import SharedCounts, TenantWindow

WINDOW_S = 60.0  # as `ingress.tenancy.ledger`
HOLDER_TTL_S = 30.0
# Tokens spent within this long of each other share one entry of the window: a minute of
# streams is then at most 60 entries a tenant on the wire, and leaves up to this much early.
BUCKET_S = 1.0
_ACTOR_NAME = "orchard-tenants-{app}"


class TenantCounts:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seats: dict[str, dict[str, set[str]]] = {}  # holder -> tenant -> tickets
        self._seen: dict[str, float] = {}  # holder -> its last call
        self._spent: dict[str, deque[list[float]]] = {}  # tenant -> [when, tokens]

    def take_seat(self, holder: str, tenant: str, limit: int, ticket: str) -> bool:
        self._touch(holder)
        if sum(len(seats.get(tenant, ())) for seats in self._seats.values()) >= limit:
            return False
        self._seats.setdefault(holder, {}).setdefault(tenant, set()).add(ticket)
        return True

    def free_seat(self, holder: str, tenant: str, ticket: str) -> None:
        """A ticket not held (never granted, freed already, or lost in a restart): nothing."""
        self._touch(holder)
        self._seats.get(holder, {}).get(tenant, set()).discard(ticket)

    def sync(self, holder: str, spent: Mapping[str, int]) -> dict[str, TenantWindow]:
        now = self._touch(holder)
        for tenant, tokens in spent.items():
            window = self._spent.setdefault(tenant, deque())
            if window and now - window[-1][0] < BUCKET_S:
                window[-1][1] += tokens
            elif tokens > 0:
                window.append([now, tokens])
        answer: dict[str, TenantWindow] = {}
        seats = Counter[str]()
        for held in self._seats.values():
            seats.update({t: len(tickets) for t, tickets in held.items()})
        for tenant in set(self._spent) | {t for t, n in seats.items() if n}:
            window = self._spent.get(tenant, deque())
            while window and window[0][0] <= now - WINDOW_S:
                window.popleft()
            answer[tenant] = TenantWindow(tuple((now - at, int(n)) for at, n in window),
                                          seats[tenant])
        return answer

    def _touch(self, holder: str) -> float:
        now = self._clock()
        self._seen[holder] = now
        for gone in [h for h, at in self._seen.items() if now - at > HOLDER_TTL_S]:
            del self._seen[gone]
            self._seats.pop(gone, None)
        return now


@ray.remote(num_cpus=0, max_restarts=-1)
class _CountsActor:
    """`TenantCounts` in one actor; its methods never await, so each call is atomic."""

    def __init__(self) -> None:
        self._counts = TenantCounts()

    async def take_seat(self, holder: str, tenant: str, limit: int, ticket: str) -> bool:
        return self._counts.take_seat(holder, tenant, limit, ticket)

    async def free_seat(self, holder: str, tenant: str, ticket: str) -> None:
        self._counts.free_seat(holder, tenant, ticket)

    async def sync(self, holder: str, spent: Mapping[str, int]) -> dict[str, TenantWindow]:
        return self._counts.sync(holder, spent)


class RayTenantCounts:
    """`SharedCounts` over the application's actor (`ingress.tenancy.shared`)."""

    def __init__(self, app: str) -> None:
        # As the Responses store's actor: the first replica creates it, the others find
        # it; detached, so it outlives the replica that created it.
        self._actor: Any = _CountsActor.options(  # type: ignore[attr-defined]
            name=_ACTOR_NAME.format(app=app), namespace="orchard", get_if_exists=True,
            lifetime="detached").remote()

    async def take_seat(self, holder: str, tenant: str, limit: int, ticket: str) -> bool:
        seated: bool = await self._actor.take_seat.remote(holder, tenant, limit, ticket)
        return seated

    async def free_seat(self, holder: str, tenant: str, ticket: str) -> None:
        await self._actor.free_seat.remote(holder, tenant, ticket)

    async def sync(self, holder: str, spent: Mapping[str, int]) -> dict[str, TenantWindow]:
        windows: dict[str, TenantWindow] = await self._actor.sync.remote(holder, dict(spent))
        return windows


def shared_counts(http_replicas: int | str | None, limited: bool, app: str
                  ) -> SharedCounts | None:
    """The shared counts where more than one replica may serve HTTP (`http_replicas`:
    a count, "auto" or None when autoscaled) and some tenant has a limit; else None: the
    one replica counts alone."""
    if http_replicas == 1 or not limited:
        return None
    return RayTenantCounts(app)
