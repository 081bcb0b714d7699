"""Tenant-aware routing (`deployments.routing.tenants`, issue 61), through the real
`PrefixAffinityRouter` on fake replicas: a tenant's requests spread over the replicas (the
next goes where the tenant has fewest), within the load bound; a replica crowded with the
tenant loses a session's preference; ends are counted back; untenanted requests are routed
as before."""

from __future__ import annotations

from typing import Any

from deployments.routing.tenants import TenantLoads, spread
from replicas.contract import GenerationRequest, Tenancy, TextPrompt
from tests.unit.test_prefix_router import (FakeId, FakeMetadata, FakePending, FakeReplica,
                                           choose, router)

HEAVY, LIGHT = Tenancy("heavy", 0, 1.0), Tenancy("light", 0, 1.0)
REPLICAS = [FakeReplica(FakeId("r1")), FakeReplica(FakeId("r2")), FakeReplica(FakeId("r3"))]


def request(n: int, tenancy: Tenancy, session: str | None = None) -> FakePending:
    generation = GenerationRequest(f"req-{n}", "m", TextPrompt(f"question {n}"),
                                   tenancy=tenancy, session_key=session)
    return FakePending([generation], FakeMetadata("stream", f"internal-{n}"))


def names(ranks: Any) -> list[list[str]]:
    return [sorted(x.replica_id.name for x in rank) for rank in ranks]


def test_a_tenants_next_request_goes_where_it_has_fewest() -> None:
    r = router({"r1": 3, "r2": 3, "r3": 3})
    for n in range(3):  # three heavy streams on r1 (say, its sessions' cache was there)
        r.on_request_routed(request(n, HEAVY), FakeId("r1"), None)  # type: ignore[arg-type]
    r.on_request_routed(request(3, LIGHT), FakeId("r2"), None)  # type: ignore[arg-type]
    r.on_request_routed(request(4, LIGHT), FakeId("r3"), None)  # type: ignore[arg-type]
    # Equal loads: the heavy tenant's next goes to r2 or r3 (Serve takes the less loaded).
    assert names(choose(r, REPLICAS, request(5, HEAVY))) == [["r2", "r3"], ["r1"]]
    # The light tenant has one on r2 and r3 each, none on r1.
    assert names(choose(r, REPLICAS, request(6, LIGHT))) == [["r1"], ["r2", "r3"]]
    # Two heavy streams end on r1: one left there, none elsewhere, still r2/r3 first.
    r.on_request_completed(FakeId("r1"), "internal-0")  # type: ignore[arg-type]
    r.on_request_completed(FakeId("r1"), "internal-1")  # type: ignore[arg-type]
    assert names(choose(r, REPLICAS, request(7, HEAVY))) == [["r2", "r3"], ["r1"]]
    r.on_request_completed(FakeId("r1"), "internal-2")  # type: ignore[arg-type]
    # Even again: no tenant preference, power-of-two's pair.
    even = choose(r, REPLICAS, request(8, HEAVY))
    assert len(even) == 1 and len(even[0]) == 2


def test_load_still_bounds_the_spread() -> None:
    # r3 holds none of the tenant but 10 more requests in all than the least loaded:
    # the tenant's spread does not send it there first.
    r = router({"r1": 2, "r2": 2, "r3": 12})
    r.on_request_routed(request(0, HEAVY), FakeId("r1"), None)  # type: ignore[arg-type]
    assert names(choose(r, REPLICAS, request(1, HEAVY))) == [["r2"], ["r1"], ["r3"]]


def test_a_replica_crowded_with_the_tenant_loses_a_sessions_preference() -> None:
    r = router({"r1": 0, "r2": 0, "r3": 0})  # max_imbalance 4
    first = request(0, HEAVY, session="agent-7")
    ranks = choose(r, REPLICAS, first)
    home = ranks[0][0].replica_id.name  # a new session's rendezvous replica
    r.on_request_routed(first, FakeId(home), None)  # type: ignore[arg-type]
    for n in range(1, 4):  # within the bound: the session keeps its replica
        assert names(choose(r, REPLICAS, request(n, HEAVY, "agent-7")))[0] == [home]
        r.on_request_routed(request(n, HEAVY), FakeId(home), None)  # type: ignore[arg-type]
    r.on_request_routed(request(4, HEAVY), FakeId(home), None)  # type: ignore[arg-type]
    # Five of the tenant there, none elsewhere: past the bound, its replica goes last.
    ranks = names(choose(r, REPLICAS, request(5, HEAVY, "agent-7")))
    assert ranks[-1] == [home] and home not in ranks[0]


def test_untenanted_requests_are_routed_as_before() -> None:
    r = router({"r1": 0, "r2": 0, "r3": 0})
    for n in range(3):
        r.on_request_routed(request(n, Tenancy()), FakeId("r1"), None)  # type: ignore[arg-type]
    ranks = choose(r, REPLICAS, request(3, Tenancy()))
    assert len(ranks) == 1 and len(ranks[0]) == 2  # power-of-two's pair, no tenant counts


def test_a_rejected_tries_end_does_not_end_the_retry() -> None:
    loads = TenantLoads()
    loads.sent("a", "r1", "heavy")
    loads.sent("a", "r2", "heavy")  # r1 rejected it; the retry went to r2
    loads.done("a", "r1")  # the rejected try's end, reported late
    assert loads.of("heavy", ["r1", "r2"]) == {"r1": 0, "r2": 1}
    loads.done("a", "r2")
    assert loads.of("heavy", ["r1", "r2"]) == {"r1": 0, "r2": 0}
    loads.sent("b", "r3", "heavy")
    loads.forget({"r1", "r2"})  # r3 left: its requests' ends may never come
    assert loads.of("heavy", ["r3"]) == {"r3": 0}


def test_spread_keeps_memory_ranks_in_order() -> None:
    # Memory put r2 and r3 first, r1 last; the tenant is on r2: r3, r2, then r1.
    ranks = spread([["r2", "r3"], ["r1"]], {"r1": 0, "r2": 2, "r3": 0},
                   {"r1": 0, "r2": 2, "r3": 0}, max_imbalance=4)
    assert ranks == [["r3"], ["r2"], ["r1"]]
    assert spread([], {"r1": 1, "r2": 1}, {"r1": 0, "r2": 0}, 4) == []

