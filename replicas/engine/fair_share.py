"""Whose request joins the batch next, and whose row leaves it first (engine thread only).

Tenants share the batch's rows by weight (`Tenancy.share`): when a row frees, the next one
goes to the waiting tenant whose rows in the batch, per unit of share, are fewest, so two
tenants with shares 3:1 that both keep the replica busy hold its rows 3:1 (and, each row
decoding a token a step, get its tokens 3:1), while a tenant alone gets every row. That is
weighted fair queuing with the batch row as the resource; ties go to the tenant served least
so far per unit of share, then to the oldest request. Within a tenant the lowest `priority`
value goes first (vLLM's convention), then the oldest. Preemption is the reverse: the row
with the highest priority value, and of those the youngest, leaves first. When the batch is
full and a waiting tenant is below its share, a row of the tenant furthest above its own is
preempted for it (`displace`): a light tenant waits a step, not until a long row ends. To
spare most of those preemptions, the batch's last row is kept free while another tenant
that was here in the last `RESERVE_S` has none (`holds_last_row`).

With no tenancy on any request (no tenants configured) the order is arrival order, as before.
`TenantTally` counts, per tenant, the requests admitted, their queue waits and the rows
preempted, for the metrics.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, TypeVar

from replicas.contract import Tenancy

Item = TypeVar("Item")

NO_TENANCY = Tenancy()
# How long a tenant that was here keeps a row held back for it (`holds_last_row`).
RESERVE_S = 2.0


def tenanted(tenancies: Iterable[Tenancy]) -> bool:
    """Whether fair share is in play: some request carries a tenant from the edge."""
    return any(t != NO_TENANCY for t in tenancies)


class FairShare:
    """The order over tenants; remembers how many rows each tenant was given (per share),
    which breaks ties toward the one served least."""

    def __init__(self) -> None:
        self._given: Counter[str] = Counter()
        self._seen: dict[str, float] = {}  # tenant -> when it last had a request here

    def seen(self, tenancies: Iterable[Tenancy], now: float) -> None:
        for t in tenancies:
            self._seen[t.tenant] = now

    def holds_last_row(self, taker: str, in_batch: set[str], now: float) -> bool:
        """Whether the batch's last free row is kept from `taker` for another tenant that
        had a request here within `RESERVE_S` and has no row now: a light tenant between
        two requests finds a row free instead of preempting one. A tenant alone (none
        other seen lately) fills the batch."""
        return any(name != taker and name not in in_batch and now - when <= RESERVE_S
                   for name, when in self._seen.items())

    def order(self, waiting: Sequence[Item], tenancy: Callable[[Item], Tenancy],
              in_batch: Iterable[Tenancy], take: int | None = None) -> list[Item]:
        """`waiting` (in arrival order) in the order they should join the batch, given the
        rows in it now: each pick counts as a row of its tenant for the picks after it.
        `take`: only the first that many are picked in that order, the rest follow in
        arrival order (the engine asks every step, with rarely more than a row or two
        free: ordering a long queue it will not admit cost it about 4% of its time)."""
        if take is not None and take <= 0:
            return list(waiting)
        rows: Counter[str] = Counter(t.tenant for t in in_batch)
        # By identity: two queued requests may compare equal as dataclasses.
        arrival = {id(item): index for index, item in enumerate(waiting)}
        queues: dict[str, list[Item]] = {}
        shares: dict[str, float] = {}
        for item in waiting:
            t = tenancy(item)
            queues.setdefault(t.tenant, []).append(item)
            shares[t.tenant] = max(t.share, 1e-9)
        for name, queue in queues.items():  # stable: the oldest first within a priority
            queue.sort(key=lambda item: tenancy(item).priority)
        ordered: list[Item] = []
        heads = {name: 0 for name in queues}
        while heads and (take is None or len(ordered) < take):
            name = min(heads, key=lambda n: (rows[n] / shares[n], self._given[n] / shares[n],
                                             arrival[id(queues[n][heads[n]])]))
            ordered.append(queues[name][heads[name]])
            rows[name] += 1
            heads[name] += 1
            if heads[name] == len(queues[name]):
                del heads[name]
        if heads:  # `take` reached: the rest as they came
            picked = {id(item) for item in ordered}
            ordered += [item for item in waiting if id(item) not in picked]
        return ordered

    def displace(self, waiting: Iterable[Tenancy], in_batch: Iterable[Tenancy]) -> list[str]:
        """With the batch full: the tenants to take a row from, one name per row, so that
        waiting tenants below their share get one now rather than when a row ends. A row
        moves from the tenant with the most rows per share to the waiting one with the
        fewest, while that leaves the taker still below the giver (no row moves back and
        forth between equals)."""
        rows: Counter[str] = Counter()
        shares: dict[str, float] = {}
        for t in in_batch:
            rows[t.tenant] += 1
            shares[t.tenant] = max(t.share, 1e-9)
        wanting: Counter[str] = Counter()
        for t in waiting:
            wanting[t.tenant] += 1
            shares[t.tenant] = max(t.share, 1e-9)
        donors: list[str] = []
        while wanting and rows:
            taker = min(wanting, key=lambda n: rows[n] / shares[n])
            giver = max(rows, key=lambda n: rows[n] / shares[n])
            if giver == taker or \
                    (rows[taker] + 1) / shares[taker] >= rows[giver] / shares[giver] - 1e-9:
                break
            donors.append(giver)
            rows[giver] -= 1
            if not rows[giver]:
                del rows[giver]
            rows[taker] += 1
            wanting[taker] -= 1
            if not wanting[taker]:
                del wanting[taker]
        return donors

    def admitted(self, tenancies: Iterable[Tenancy]) -> None:
        """Count rows given, for the tie-break."""
        for t in tenancies:
            self._given[t.tenant] += 1


def victim(rows: Iterable[Item], tenancy: Callable[[Item], Tenancy],
           order: Callable[[Item], int]) -> Item:
    """The row to preempt: the lowest priority (highest value), and of those the youngest
    (highest join `order`)."""
    return max(rows, key=lambda row: (tenancy(row).priority, order(row)))


@dataclass(frozen=True)
class TenantCounts:
    """One tenant's totals in this engine since it started (`EngineStats.tenants`)."""

    tenant: str
    admitted: int  # requests that joined the batch (a preempted one again: not counted)
    waited_s: float  # their waits in the queue, summed: / admitted is the mean wait
    preempted: int  # rows that left the batch when KV ran out


class TenantTally:
    """Counts per tenant, written on the engine thread, read by the metrics poll."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[float]] = {}

    def admitted(self, tenant: str, waited_s: float) -> None:
        with self._lock:
            counts = self._counts.setdefault(tenant, [0, 0.0, 0])
            counts[0] += 1
            counts[1] += waited_s

    def preempted(self, tenant: str) -> None:
        with self._lock:
            self._counts.setdefault(tenant, [0, 0.0, 0])[2] += 1

    def snapshot(self) -> tuple[TenantCounts, ...]:
        with self._lock:
            return tuple(TenantCounts(t, int(c[0]), c[1], int(c[2]))
                         for t, c in self._counts.items())
