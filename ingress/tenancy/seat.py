"""The current request's tenant (its "seat"), set by the tenant middleware for the rest of
the request; a module of its own so the routes can read it (and check its models) without
importing the door."""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ingress.tenancy.policy import TenantPolicy
from replicas.errors import NotFoundError

if TYPE_CHECKING:
    from ingress.client import ModelCard


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


def refuse_outside(resolve: Callable[[str], ModelCard | None], policy: TenantPolicy,
                   model: str) -> None:
    """The 404 of a model (a served card's id) outside the tenant's `models`, OpenAI's
    answer for a model a key cannot see; nothing for one inside it, or with no list."""
    if policy.models is not None and not any(
            card is not None and card.id == model for card in map(resolve, policy.models)):
        raise NotFoundError(f"model '{model}' is not available to this key", param="model")


def check_tenant_model(resolve: Callable[[str], ModelCard | None], model: str) -> None:
    """`refuse_outside` for the current request's tenant; nothing on an open path or
    without tenants. For routes that read a model's facts without a generation."""
    seat = SEAT.get()
    if seat is not None:
        refuse_outside(resolve, seat.policy, model)
