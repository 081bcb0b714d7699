"""Tenant-aware routing (issue 61): a tenant's requests spread over the model's replicas, so
each replica's fair share (`replicas.engine.fair_share`) sees every busy tenant, and one
replica's queue does not fill with one tenant while another replica has none of it.

The router counts, per replica and tenant, the requests it sent that have not ended
(`TenantLoads`: Serve's `on_request_routed` and `on_request_completed`). A tenanted request
then goes first to the replicas where its tenant has the fewest, among those within
`max_imbalance` requests of the least loaded; a replica holding more of the tenant than the
emptiest by over `max_imbalance` loses a cache preference, as an overloaded one does.

The counts are this ingress replica's: each sees about 1/N of every tenant's requests
(Serve's proxies spread them), so spreading its own spreads the whole. Requests without a
tenant (none configured) are routed as before.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence


class TenantLoads:
    """Requests this router sent and that have not ended, by replica and tenant."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[str, str]] = {}  # request id -> (replica, tenant)
        self._counts: dict[str, Counter[str]] = {}  # replica -> tenant -> requests

    def sent(self, request_id: str, replica: str, tenant: str) -> None:
        self.done(request_id)  # a retry routed again: counted where it went last
        self._open[request_id] = (replica, tenant)
        self._counts.setdefault(replica, Counter())[tenant] += 1

    def done(self, request_id: str, replica: str | None = None) -> None:
        """The request ended (on `replica`, if given: a rejected try's end must not end the
        retry that went elsewhere)."""
        where = self._open.get(request_id)
        if where is None or replica is not None and where[0] != replica:
            return
        del self._open[request_id]
        counts = self._counts[where[0]]
        counts[where[1]] -= 1
        if counts[where[1]] <= 0:
            del counts[where[1]]

    def forget(self, live: set[str]) -> None:
        """Drop the replicas that left (their requests' ends may never be reported)."""
        for replica in [r for r in self._counts if r not in live]:
            del self._counts[replica]
        for request_id in [i for i, (r, _) in self._open.items() if r not in live]:
            del self._open[request_id]

    def of(self, tenant: str, replicas: Sequence[str]) -> dict[str, int]:
        return {r: self._counts.get(r, Counter())[tenant] for r in replicas}


def spread(ranks: list[list[str]], tenant: Mapping[str, int],
           loads: Mapping[str, int | None], max_imbalance: int) -> list[list[str]]:
    """`ranks` (the cache's and memory's preference; [] for none) refined by the tenant's
    requests on each replica (`tenant`): within each rank, the replicas near the least
    loaded go in ranks by fewest of the tenant's requests; a replica crowded with the
    tenant (over `max_imbalance` more than the emptiest) goes last. Unchanged where the
    tenant is even over the replicas."""
    if len(set(tenant.values())) <= 1:
        return ranks
    least = min(tenant.values())
    load = {r: n or 0 for r, n in loads.items()}
    out: list[list[str]] = []
    crowded: list[str] = []
    for rank in ranks or [list(tenant)]:
        kept = [r for r in rank if tenant.get(r, 0) - least <= max_imbalance]
        crowded += [r for r in rank if r not in kept]
        if not kept:
            continue
        lightest = min(load.get(r, 0) for r in kept)
        near = [r for r in kept if load.get(r, 0) - lightest <= max_imbalance]
        for count in sorted({tenant.get(r, 0) for r in near}):
            out.append([r for r in near if tenant.get(r, 0) == count])
        far = [r for r in kept if r not in near]
        if far:
            out.append(far)
    if crowded:
        out.append(sorted(crowded, key=lambda r: tenant.get(r, 0)))
    return out
