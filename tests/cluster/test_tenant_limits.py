"""Tenant limits across HTTP replicas through the real Ray actor
(`deployments.tenant_counts`), in a private local Ray in this process: two replicas'
ledgers (`ingress.tenancy.shared.SharedLedger`), each with its own handle to the named
actor as each replica gets it, count one tenant's seats and tokens together. The same
ledgers over an in-process `TenantCounts`: tests/unit/test_shared_limits.py."""

from __future__ import annotations

import asyncio
from typing import Iterator

import pytest
import ray

from deployments.tenant_counts import _ACTOR_NAME, RayTenantCounts
from ingress.tenancy.policy import TenantPolicy
from ingress.tenancy.shared import SharedLedger
from replicas.errors import RateLimitedError

pytestmark = pytest.mark.cluster
CI = TenantPolicy("ci", frozenset({"sk-ci-0123456789"}), max_concurrent=1,
                  tokens_per_minute=50)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(address="local", include_dashboard=False, num_cpus=1, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_two_replicas_count_one_tenant_through_the_actor(local_ray: None) -> None:
    async def run() -> None:
        a = SharedLedger(RayTenantCounts("limits-test"))
        b = SharedLedger(RayTenantCounts("limits-test"))  # found by name, not a second
        await a.admit(CI)
        with pytest.raises(RateLimitedError):
            await b.admit(CI)  # the one seat is a's
        a.leave("ci")
        await asyncio.sleep(0.5)
        await b.admit(CI)
        b.spend("ci", 60)
        b.leave("ci")
        await b.sync()
        await a.sync()
        with pytest.raises(RateLimitedError) as refused:
            await a.admit(CI)  # b's 60 tokens: past 50 a minute, seen by a
        assert "60 tokens in the last minute" in str(refused.value)
        for ledger in (a, b):
            assert ledger._loop is not None
            ledger._loop.cancel()

    asyncio.run(run())
    ray.kill(ray.get_actor(_ACTOR_NAME.format(app="limits-test"), namespace="orchard"))
