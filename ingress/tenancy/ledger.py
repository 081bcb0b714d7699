"""Each tenant's limits as this HTTP replica counts them: requests in flight, and tokens
(prompt + completion) over a sliding minute, spent as they stream.

These counts are this process's. With several HTTP replicas the deployments layer hands
the app a `SharedLedger` (`ingress.tenancy.shared`) instead, which keeps the same counts
cluster-wide, so N replicas do not give a tenant N times its limits.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ingress.tenancy.policy import TenantPolicy
from replicas.errors import RateLimitedError

WINDOW_S = 60.0


@dataclass
class _Account:
    in_flight: int = 0
    spent: deque[tuple[float, int]] = field(default_factory=deque)  # (when, tokens)
    total: int = 0  # tokens in `spent`


class Ledger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._accounts: dict[str, _Account] = {}

    def _account(self, tenant: str) -> _Account:
        account = self._accounts.setdefault(tenant, _Account())
        cutoff = self._clock() - WINDOW_S
        while account.spent and account.spent[0][0] <= cutoff:
            account.total -= account.spent.popleft()[1]
        return account

    def enter(self, policy: TenantPolicy) -> None:
        """Count a request in, or raise the 429 of the limit it is past."""
        account = self._account(policy.name)
        limit = policy.max_concurrent
        if limit is not None and account.in_flight >= limit:
            raise busy(policy.name, account.in_flight, limit)
        self._check_tokens(policy, account)
        account.in_flight += 1

    async def admit(self, policy: TenantPolicy) -> None:
        """`enter`, for a ledger whose counts may live elsewhere (`SharedLedger`)."""
        self.enter(policy)

    def _check_tokens(self, policy: TenantPolicy, account: _Account) -> None:
        tpm = policy.tokens_per_minute
        if tpm is not None and account.total >= tpm:
            raise RateLimitedError(
                f"tenant '{policy.name}' used {account.total} tokens in the last minute, its "
                f"limit ({tpm} per minute)", retry_after_s=self._reset_s(account, tpm))

    def _in_flight(self, tenant: str, account: _Account) -> int:
        """Requests in flight as the headers report them (`SharedLedger`: cluster-wide)."""
        return account.in_flight

    def leave(self, tenant: str) -> None:
        account = self._account(tenant)
        account.in_flight = max(0, account.in_flight - 1)

    def spend(self, tenant: str, tokens: int) -> None:
        if tokens > 0:
            account = self._account(tenant)
            account.spent.append((self._clock(), tokens))
            account.total += tokens

    def _reset_s(self, account: _Account, limit: int) -> float:
        """Seconds until the window holds less than `limit` tokens again."""
        over, now = account.total - limit + 1, self._clock()
        for when, tokens in account.spent:
            over -= tokens
            if over <= 0:
                return max(0.0, when + WINDOW_S - now)
        return WINDOW_S

    def headers(self, policy: TenantPolicy) -> list[tuple[bytes, bytes]]:
        """OpenAI's `x-ratelimit-*` headers for the tenant's configured limits ("requests":
        requests in flight, Orchard's request limit)."""
        account = self._account(policy.name)
        out: list[tuple[bytes, bytes]] = []
        if policy.max_concurrent is not None:
            left = max(0, policy.max_concurrent - self._in_flight(policy.name, account))
            out += [(b"x-ratelimit-limit-requests", str(policy.max_concurrent).encode()),
                    (b"x-ratelimit-remaining-requests", str(left).encode()),
                    (b"x-ratelimit-reset-requests", b"0s" if left else b"1s")]
        if policy.tokens_per_minute is not None:
            tpm = policy.tokens_per_minute
            reset = self._reset_s(account, tpm) if account.total >= tpm else 0.0
            out += [(b"x-ratelimit-limit-tokens", str(tpm).encode()),
                    (b"x-ratelimit-remaining-tokens", str(max(0, tpm - account.total)).encode()),
                    (b"x-ratelimit-reset-tokens", f"{math.ceil(reset)}s".encode())]
        return out


def busy(tenant: str, in_flight: int, limit: int) -> RateLimitedError:
    return RateLimitedError(f"tenant '{tenant}' has {in_flight} requests in flight, its limit "
                            f"({limit}); retry when one ends", retry_after_s=1.0)
