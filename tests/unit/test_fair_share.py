"""Weighted fair queuing over tenants in the replica's waiting queue (`fair_share`), and the
preemption victim: the lowest priority, youngest row."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from replicas.contract import SamplingParams, Tenancy
from replicas.engine.config import EngineConfig
from replicas.engine.fair_share import RESERVE_S, FairShare, tenanted, victim
from replicas.engine.kv.budget import KvBudget
from replicas.engine.kv.layout import KvLayout
from replicas.engine.request import EngineRequest, Submitted
from replicas.engine.scheduling import Active, Waiting


@dataclass(frozen=True)
class Item:
    name: str
    tenancy: Tenancy


def _items(tenant: str, count: int, share: float = 1.0, priority: int = 0) -> list[Item]:
    return [Item(f"{tenant}{i}", Tenancy(tenant, priority, share)) for i in range(count)]


def test_shares_three_to_one_split_rows_three_to_one() -> None:
    heavy, light = _items("a", 40, share=3), _items("b", 40, share=1)
    order = FairShare().order([*heavy, *light], lambda i: i.tenancy, ())
    first = Counter(i.tenancy.tenant for i in order[:32])
    assert first == {"a": 24, "b": 8}
    assert len(order) == 80  # every waiting one, once
    assert {id(i) for i in order} == {id(i) for i in [*heavy, *light]}


def test_rows_in_the_batch_count() -> None:
    # `a` already holds 3 rows: with equal shares the next 3 go to `b`.
    waiting = [*_items("a", 4), *_items("b", 4)]
    order = FairShare().order(waiting, lambda i: i.tenancy, [Tenancy("a")] * 3)
    assert [i.tenancy.tenant for i in order[:4]] == ["b", "b", "b", "a"]


def test_take_orders_only_the_first_picks() -> None:
    """`take`: the same first picks as a full order, the rest in arrival order, each once."""
    heavy, light = _items("a", 30, share=3), _items("b", 10, share=1)
    waiting = [*heavy, *light]
    full = FairShare().order(waiting, lambda i: i.tenancy, [Tenancy("a")] * 6)
    for take in (1, 2, 5):
        part = FairShare().order(waiting, lambda i: i.tenancy, [Tenancy("a")] * 6, take)
        assert part[:take] == full[:take]
        assert part[take:] == [i for i in waiting if i not in part[:take]]
    assert full[0].tenancy.tenant == "b"  # below its share: first
    assert FairShare().order(waiting, lambda i: i.tenancy, (), 0) == waiting


def test_a_lone_tenant_keeps_arrival_order() -> None:
    waiting = _items("a", 5, share=0.5)
    assert FairShare().order(waiting, lambda i: i.tenancy, ()) == waiting


def test_priority_within_a_tenant_then_arrival() -> None:
    low, high = _items("a", 2, priority=5), _items("a", 2, priority=0)
    order = FairShare().order([*low, *high], lambda i: i.tenancy, ())
    assert order == [*high, *low]


def test_ties_go_to_the_tenant_served_least() -> None:
    share = FairShare()
    share.admitted([Tenancy("a")] * 5)
    order = share.order([*_items("a", 1), *_items("b", 1)], lambda i: i.tenancy, ())
    assert order[0].tenancy.tenant == "b"


def test_victim_is_lowest_priority_then_youngest() -> None:
    rows = [(Tenancy("a", 0), 1), (Tenancy("b", 9), 2), (Tenancy("b", 9), 3),
            (Tenancy("a", 0), 4)]
    assert victim(rows, lambda r: r[0], lambda r: r[1]) == (Tenancy("b", 9), 3)
    plain = [(Tenancy(), 1), (Tenancy(), 7), (Tenancy(), 3)]
    assert victim(plain, lambda r: r[0], lambda r: r[1])[1] == 7  # the youngest, as before


def test_tenanted_only_with_a_tenant() -> None:
    assert not tenanted([Tenancy(), Tenancy()])
    assert tenanted([Tenancy(), Tenancy("ci")])


class _Output:
    sink = None


def _submitted(rid: str, tenancy: Tenancy) -> Submitted:
    request = EngineRequest(rid, (1, 2, 3), 8, SamplingParams(), frozenset(), tenancy=tenancy)
    return Submitted(request, _Output())  # type: ignore[arg-type]


def _waiting(max_batch_size: int) -> Waiting:
    kv = KvBudget(budget_bytes=1 << 30, layout=KvLayout(per_token=10), max_waiting=64)
    return Waiting(kv, EngineConfig(max_batch_size=max_batch_size))


def _rows(*tenancies: Tenancy) -> dict[int, Active]:
    return {uid: Active(uid, _submitted(f"row{uid}", t), None, 0, uid)
            for uid, t in enumerate(tenancies)}


def test_waiting_admits_tenants_by_share_up_to_the_free_rows() -> None:
    waiting = _waiting(max_batch_size=4)
    heavy = [_submitted(f"h{i}", Tenancy("heavy", 0, 3)) for i in range(8)]
    light = [_submitted(f"l{i}", Tenancy("light", 0, 1)) for i in range(8)]
    admitted = waiting.admit([*heavy, *light], lambda _: False, lambda _: None)
    tenants = Counter(q.sub.request.tenancy.tenant for q in admitted)
    assert tenants == {"heavy": 3, "light": 1}
    assert len(waiting) == 12  # the rest wait for a row, in Orchard's queue
    # A light row leaves: its place goes to light again (3:1 held), not to the older heavy.
    again = waiting.admit([], lambda _: False, lambda _: None,
                          _rows(*[Tenancy("heavy", 0, 3)] * 3))
    assert [q.sub.request.tenancy.tenant for q in again] == ["light"]


def test_displace_moves_rows_to_a_tenant_below_its_share_only() -> None:
    share = FairShare()
    heavy, light = Tenancy("heavy", 0, 3), Tenancy("light", 0, 1)
    assert share.displace([light, light], [heavy] * 4) == ["heavy"]  # to 3:1, not past it
    assert share.displace([Tenancy("b")] * 3, [Tenancy("a")] * 16) == ["a"] * 3
    assert share.displace([Tenancy("a")], [Tenancy("a"), Tenancy("b")]) == []
    assert share.displace([Tenancy("b")], [Tenancy("a"), Tenancy("b")]) == []  # equals


def test_a_full_batch_preempts_a_row_for_a_tenant_below_its_share() -> None:
    waiting = _waiting(max_batch_size=4)
    rows = _rows(*[Tenancy("heavy")] * 4)
    out: list[Active] = []
    admitted = waiting.admit([_submitted("light", Tenancy("light"))], lambda _: False,
                             lambda _: None, rows, out.append)
    assert [a.uid for a in out] == [3]  # the youngest heavy row
    assert [q.request_id for q in admitted] == ["light"]
    # The preempted row waits first among the heavy tenant's, and resumes when a row frees.
    assert [q.request_id for q in waiting.queue] == ["row3"] and waiting.queue[0].resumed
    assert {c.tenant: c.preempted for c in waiting.tally.snapshot()}["heavy"] == 1
    # Light holds a row now: the free one goes to heavy's preempted request.
    rows = _rows(Tenancy("heavy"), Tenancy("heavy"), Tenancy("light"))
    assert [q.request_id for q in waiting.admit([], lambda _: False, lambda _: None,
                                                 rows, out.append)] == ["row3"]
    assert len(out) == 1


def test_the_last_row_is_held_for_a_tenant_seen_lately_not_for_a_lone_one() -> None:
    share = FairShare()
    share.seen([Tenancy("heavy")], now=100.0)
    assert not share.holds_last_row("heavy", set(), now=100.0)  # alone: the whole batch
    share.seen([Tenancy("light")], now=100.0)
    assert share.holds_last_row("heavy", {"heavy"}, now=101.0)  # light has no row
    assert not share.holds_last_row("heavy", {"heavy", "light"}, now=101.0)  # it has one
    assert not share.holds_last_row("light", {"heavy"}, now=101.0)  # light may take it
    assert not share.holds_last_row("heavy", {"heavy"}, now=100.0 + RESERVE_S + 0.1)


def test_without_tenancy_nothing_waits_for_a_row() -> None:
    waiting = _waiting(max_batch_size=2)
    admitted = waiting.admit([_submitted(f"r{i}", Tenancy()) for i in range(6)],
                             lambda _: False, lambda _: None)
    assert [q.request_id for q in admitted] == [f"r{i}" for i in range(6)]
    assert len(waiting) == 0


def test_the_tally_counts_waits_and_preemptions_per_tenant() -> None:
    waiting = _waiting(max_batch_size=8)
    waiting.admit([_submitted("a", Tenancy("ci", 0, 1)), _submitted("b", Tenancy("ci", 0, 1)),
                   _submitted("c", Tenancy("agents", 0, 3))], lambda _: False, lambda _: None)
    counts = {c.tenant: c for c in waiting.tally.snapshot()}
    assert counts["ci"].admitted == 2 and counts["agents"].admitted == 1
    assert counts["ci"].waited_s >= 0 and counts["ci"].preempted == 0
    waiting.tally.preempted("ci")
    assert {c.tenant: c.preempted for c in waiting.tally.snapshot()} == {"ci": 1, "agents": 0}
