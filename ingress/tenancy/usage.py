"""Usage per tenant and model: requests, prompt, cached and completion tokens, preemptions.

Kept in the Responses store's database (`deployments/responses/usage.py`: SQLite by
default, Redis on a cluster) so it survives restarts; `MemoryUsageStore` is the default of an
app built without one. `GET /v1/usage` reports it to admin keys.
"""

from __future__ import annotations

import typing
from dataclasses import asdict, dataclass, fields
from typing import Any

from fastapi import APIRouter, Request

from ingress.errors import OPENAI_ERRORS, error_response
from ingress.tenancy.seat import current_seat
from ingress.wire_json import JSONBody
from replicas.contract import ErrorKind


@dataclass(frozen=True)
class UsageCounts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = 0  # times the replica took its requests out of the batch for KV

    def __add__(self, other: "UsageCounts") -> "UsageCounts":
        return UsageCounts(*(getattr(self, f.name) + getattr(other, f.name)
                             for f in fields(self)))


COUNTS = tuple(f.name for f in fields(UsageCounts))


class UsageStore(typing.Protocol):
    async def add(self, tenant: str, model: str, counts: UsageCounts) -> None: ...

    async def report(self) -> dict[tuple[str, str], UsageCounts]:
        """(tenant, model) -> the counts since the store began."""
        ...


class MemoryUsageStore:
    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], UsageCounts] = {}

    async def add(self, tenant: str, model: str, counts: UsageCounts) -> None:
        key = (tenant, model)
        self._counts[key] = self._counts.get(key, UsageCounts()) + counts

    async def report(self) -> dict[tuple[str, str], UsageCounts]:
        return dict(self._counts)


router = APIRouter()


@router.get("/v1/usage")
async def usage(request: Request) -> Any:
    seat = current_seat()
    if not request.app.state.tenants:
        return error_response(ErrorKind.NOT_FOUND, "usage is kept per tenant: configure "
                              "`tenants` to count it", OPENAI_ERRORS)
    if seat is None or not seat.policy.admin:
        return error_response(ErrorKind.UNAUTHORIZED, "GET /v1/usage needs an admin tenant's key",
                              OPENAI_ERRORS, status=403)
    store: UsageStore = request.app.state.usage
    data = [{"tenant": tenant, "model": model, **asdict(counts)}
            for (tenant, model), counts in sorted((await store.report()).items())]
    return JSONBody({"object": "list", "data": data})
