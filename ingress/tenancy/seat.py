"""The current request's tenant (its "seat"), set by the tenant middleware for the rest of
the request; a module of its own so the routes can read it without importing the door."""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar
from dataclasses import dataclass

from ingress.tenancy.policy import TenantPolicy


@dataclass(frozen=True)
class Seat:
    """The current request's tenant, and the priority it asked for (None: its tenant's)."""

    policy: TenantPolicy
    asked_priority: int | None = None


SEAT: ContextVar[Seat | None] = ContextVar("orchard_tenant", default=None)


def current_seat() -> Seat | None:
    return SEAT.get()


def asked_priority(value: int | None) -> None:
    """A priority the request's body asked for (OpenAI's `priority`), over the header's."""
    seat = SEAT.get()
    if seat is not None and value is not None:
        SEAT.set(dataclasses.replace(seat, asked_priority=value))
