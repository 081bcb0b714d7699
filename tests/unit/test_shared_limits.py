"""Tenant limits shared by several HTTP replicas (issue 61): two apps (two ingress replicas)
over one `deployments.tenant_counts.TenantCounts`, as the Ray actor holds it (the actor
itself: tests/cluster/test_tenant_limits.py). A tenant's concurrency and tokens per minute
are counted across both, not per replica; a replica that died holding seats frees them;
with the shared counts down, each replica counts alone."""

from __future__ import annotations

import asyncio
import time
from typing import Mapping

import pytest
from fastapi.testclient import TestClient

from deployments.tenant_counts import HOLDER_TTL_S, TenantCounts
from ingress.app import create_app
from ingress.options import EdgeOptions
from ingress.tenancy.policy import TenantPolicy
from ingress.tenancy.shared import SharedLedger, TenantWindow
from replicas.errors import RateLimitedError
from tests.fakes import FakeClient
from tests.unit.test_tenants import ANSWER, CHAT, auth

KEY = "sk-ci-0123456789"
CI = TenantPolicy("ci", frozenset({KEY}), max_concurrent=2, tokens_per_minute=100)


class InProcess:
    """`SharedCounts` over a `TenantCounts` in this process (the actor's methods, unawaited)."""

    def __init__(self, counts: TenantCounts) -> None:
        self.counts = counts
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("the counts actor is gone")

    async def take_seat(self, holder: str, tenant: str, limit: int, ticket: str) -> bool:
        self._check()
        return self.counts.take_seat(holder, tenant, limit, ticket)

    async def free_seat(self, holder: str, tenant: str, ticket: str) -> None:
        self._check()
        self.counts.free_seat(holder, tenant, ticket)

    async def sync(self, holder: str, spent: Mapping[str, int]) -> dict[str, TenantWindow]:
        self._check()
        return self.counts.sync(holder, spent)


def test_seats_and_tokens_are_counted_across_replicas() -> None:
    async def run() -> None:
        shared = InProcess(TenantCounts())
        a, b = SharedLedger(shared), SharedLedger(shared)
        await a.admit(CI)
        await b.admit(CI)  # two in flight, one on each replica: the limit
        for ledger in (a, b):  # each alone would take a second
            with pytest.raises(RateLimitedError) as refused:
                await ledger.admit(CI)
            assert refused.value.retry_after_s == 1.0
        await b.sync()
        assert dict(b.headers(CI))[b"x-ratelimit-remaining-requests"] == b"0"
        a.leave("ci")
        await asyncio.sleep(0.05)  # the seat goes back in the background
        await b.admit(CI)  # a's seat, taken through b
        b.leave("ci")
        b.leave("ci")
        await asyncio.sleep(0.05)
        # Tokens: 70 spent through a, 40 through b; past 100 once both have synced.
        a.spend("ci", 70)
        b.spend("ci", 40)
        await a.sync()
        await b.sync()
        await a.sync()
        for ledger in (a, b):
            with pytest.raises(RateLimitedError) as refused:
                await ledger.admit(CI)
            assert 30 < refused.value.retry_after_s <= 60  # when the first 70 leave (60 s window)
            assert dict(ledger.headers(CI))[b"x-ratelimit-remaining-tokens"] == b"0"
        a._loop.cancel()  # type: ignore[union-attr]
        b._loop.cancel()  # type: ignore[union-attr]

    asyncio.run(run())


def test_an_idle_replica_stops_syncing_and_refreshes_before_its_next_check() -> None:
    """No calls to the shared counts while nothing is in flight or unsent; the first request
    after the pause waits for one sync, so it sees what other replicas spent meanwhile."""
    async def run() -> None:
        now = [1000.0]
        shared = InProcess(TenantCounts())
        ledger = SharedLedger(shared, clock=lambda: now[0], period_s=0.01)
        await ledger.admit(CI)
        ledger.spend("ci", 10)
        ledger.leave("ci")
        for _ in range(200):  # the loop sends the 10, then ends
            if ledger._loop is not None and ledger._loop.done():
                break
            await asyncio.sleep(0.01)
        assert ledger._loop is not None and ledger._loop.done() and ledger.idle()
        assert shared.counts.sync("other", {})["ci"].spent[0][1] == 10
        calls = ledger.syncs
        await asyncio.sleep(0.2)  # twenty periods idle: no call
        assert ledger.syncs == calls
        shared.counts.sync("other", {"ci": 95})  # another replica spends meanwhile
        now[0] += 5  # past STALE_S, within the minute
        with pytest.raises(RateLimitedError):  # 105 of 100: seen only by refreshing first
            await ledger.admit(CI)
        assert ledger.syncs == calls + 1
        assert ledger._loop is not None
        ledger._loop.cancel()

    asyncio.run(run())


def test_a_replica_that_died_holding_seats_frees_them() -> None:
    now = [0.0]
    counts = TenantCounts(clock=lambda: now[0])
    assert counts.take_seat("dead", "ci", 2, "t1") and counts.take_seat("dead", "ci", 2, "t2")
    assert not counts.take_seat("live", "ci", 2, "t3")
    now[0] = HOLDER_TTL_S / 2
    counts.sync("live", {})  # the live one syncs; the dead one never again
    now[0] = HOLDER_TTL_S + 1
    assert counts.sync("live", {"ci": 5})["ci"] == TenantWindow(((0.0, 5),), 0)
    assert counts.take_seat("live", "ci", 2, "t4")
    counts.free_seat("live", "ci", "t4")
    counts.free_seat("live", "ci", "t4")  # twice, or a ticket never granted: no debt
    counts.free_seat("live", "ci", "t9")
    assert counts.sync("live", {})["ci"].seats == 0
    now[0] += 61  # the minute slides: the 5 tokens leave
    assert counts.sync("live", {})["ci"].spent == ()


def test_with_the_shared_counts_down_each_replica_counts_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        shared = InProcess(TenantCounts())
        shared.down = True
        ledger = SharedLedger(shared)
        await ledger.admit(CI)
        await ledger.admit(CI)
        with pytest.raises(RateLimitedError):
            await ledger.admit(CI)  # the local limit still holds
        ledger.spend("ci", 30)
        await ledger.sync()  # fails: the 30 wait for the next
        shared.down = False
        await ledger.sync()
        assert shared.counts.sync("other", {})["ci"].spent[0][1] == 30
        ledger._loop.cancel()  # type: ignore[union-attr]

    asyncio.run(run())
    assert caplog.text.count("counting on this replica alone") == 1  # once per outage


def test_two_apps_share_one_tenants_limit() -> None:
    """Two ingress replicas' apps: a tenant's streams through both count against one limit."""
    shared = InProcess(TenantCounts())
    one, two = (TestClient(create_app(FakeClient(ANSWER, delay_s=0.5),
                                      EdgeOptions(tenants=(CI,)), tenant_counts=shared))
                for _ in range(2))
    with one, two:
        with one.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                        headers=auth(KEY)) as first, \
                two.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                           headers=auth(KEY)) as second:
            assert first.status_code == second.status_code == 200
            for client in (one, two):  # two in flight across the replicas: the limit
                refused = client.post("/v1/chat/completions", json=CHAT, headers=auth(KEY))
                assert refused.status_code == 429, refused.text
                assert refused.headers["retry-after"] == "1"
            first.read()
            second.read()
        # The seats come back as the streams end (in each app's loop, just after).
        deadline = time.monotonic() + 10
        while (ok := one.post("/v1/chat/completions", json=CHAT, headers=auth(KEY))
               ).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ok.status_code == 200, ok.text


def test_a_seat_whose_answer_came_too_late_is_given_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The actor granted the seat but its answer missed the deadline (or the request was
    cancelled meanwhile): the ticket is freed, so no seat leaks for good."""
    import ingress.tenancy.shared as shared_module

    monkeypatch.setattr(shared_module, "CALL_TIMEOUT_S", 0.1)

    class SlowAnswer(InProcess):
        async def take_seat(self, holder: str, tenant: str, limit: int, ticket: str) -> bool:
            granted = await super().take_seat(holder, tenant, limit, ticket)
            await asyncio.sleep(1.0)
            return granted

    async def run() -> int:
        shared = SlowAnswer(TenantCounts())
        ledger = SharedLedger(shared)
        await ledger.admit(CI)  # timed out: admitted by the local count
        await asyncio.sleep(0.1)
        windows = shared.counts.sync("x", {})
        taken = windows["ci"].seats if "ci" in windows else 0  # none held: not listed
        assert ledger._loop is not None
        ledger._loop.cancel()
        return taken

    assert asyncio.run(run()) == 0
