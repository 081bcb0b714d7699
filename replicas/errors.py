"""Errors a replica raises before generation starts, tagged with the shared taxonomy.

The ingress renders them in each protocol's own shape; the kind picks the status code.
"""

from __future__ import annotations

from replicas.contract import ErrorKind, Failed


class ReplicaError(Exception):
    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def as_event(self) -> Failed:
        return Failed(self.kind, self.message, self.param)


class InvalidRequestError(ReplicaError):
    kind = ErrorKind.INVALID_REQUEST


class NotFoundError(ReplicaError):
    kind = ErrorKind.NOT_FOUND


class ContextLengthError(ReplicaError):
    kind = ErrorKind.CONTEXT_LENGTH


class OverloadedError(ReplicaError):
    kind = ErrorKind.OVERLOADED


class UnauthorizedError(ReplicaError):
    kind = ErrorKind.UNAUTHORIZED


class RateLimitedError(ReplicaError):
    """Past a tenant's limit at the edge (`ingress/tenancy/`): a 429 with `Retry-After`."""

    kind = ErrorKind.RATE_LIMITED

    def __init__(self, message: str, *, retry_after_s: float = 1.0,
                 param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class DeadlineError(ReplicaError):
    """A deadline passed (the request's own, or the wait for a replica)."""

    kind = ErrorKind.TIMEOUT


class InternalError(ReplicaError):
    kind = ErrorKind.INTERNAL


_BY_KIND = {cls.kind: cls for cls in (InvalidRequestError, NotFoundError, ContextLengthError,
                                      OverloadedError, UnauthorizedError, RateLimitedError,
                                      DeadlineError,
                                      InternalError)}


def from_event(failed: Failed) -> ReplicaError:
    """The exception for a failure that arrived as an event (e.g. across a Ray handle)."""
    return _BY_KIND[failed.kind](failed.message, param=failed.param)
