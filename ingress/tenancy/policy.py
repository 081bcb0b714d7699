"""A tenant as the edge holds it: its keys, priority, share and limits.

Plain data, built by `deployments/` from `serve_config.yaml`'s `tenants:` with the keys read
from the environment; tests build it directly. With no tenants configured the edge has
none, and every request is the default tenancy (`replicas.contract.Tenancy()`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The header a client lowers its priority with on any API (OpenAI's body has `priority`).
PRIORITY_HEADER = b"x-orchard-priority"


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    # Kept out of repr so logging a policy never logs a key.
    keys: frozenset[str] = field(default=frozenset(), repr=False)
    # vLLM's convention: lower runs sooner. A request may ask for a higher value (less
    # urgent), never a lower one.
    priority: int = 0
    share: float = 1.0  # weight in the replica's fair share of the batch
    max_concurrent: int | None = None  # requests in flight at once; None: no bound
    tokens_per_minute: int | None = None  # prompt + completion, sliding minute; None: none
    models: frozenset[str] | None = None  # names it may use (ids or aliases); None: all
    admin: bool = False  # may read `GET /v1/usage`

    def effective_priority(self, asked: int | None) -> int:
        """The priority a request runs at: its own if it asked for a lower one."""
        return self.priority if asked is None else max(self.priority, asked)
