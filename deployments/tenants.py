"""`tenants:` in `serve_config.yaml`: who shares the cluster, and on what terms.

Each tenant names the environment variable that holds its keys (comma-separated), read
where the HTTP replicas run; keys never sit in the file. With no tenants, `api_keys` /
`api_keys_env` decide who may call and every request is the default tenant.
"""

from __future__ import annotations

from typing import Mapping

from pydantic import Field

from deployments.replica_settings import _Strict
from ingress.tenancy.policy import TenantPolicy


class TenantSettings(_Strict):
    keys_env: str = Field(min_length=1, description="Environment variable with the tenant's "
                          "comma-separated API keys; unset or empty where the HTTP replicas "
                          "run is an error.")
    priority: int = Field(0, description="vLLM's convention: lower runs sooner, in the batch "
                          "and when KV runs out (the highest is preempted first). A request "
                          "may ask for a higher value (OpenAI's `priority`, the "
                          "`x-orchard-priority` header), never a lower one.")
    share: float = Field(1.0, gt=0, description="Weight in each replica's fair share of its "
                         "batch: tenants that all keep a replica busy get its rows in "
                         "proportion; one alone gets them all.")
    max_concurrent: int | None = Field(None, ge=1, description="Requests in flight at once, "
                                       "across every HTTP replica (`deployments."
                                       "tenant_counts`); past it a 429. null: no bound.")
    tokens_per_minute: int | None = Field(None, ge=1, description="Prompt plus completion "
                                          "tokens over a sliding minute, across every HTTP "
                                          "replica (synced every 0.5 s), spent as they "
                                          "stream; past it a 429.")
    models: list[str] | None = Field(None, description="Model names (ids or aliases) it may "
                                     "use; any other is a 404. null: all.")
    admin: bool = Field(False, description="Its keys may read `GET /v1/usage`.")

    def policy(self, name: str, environ: Mapping[str, str]) -> TenantPolicy:
        keys = frozenset(k.strip() for k in environ.get(self.keys_env, "").split(",")
                         if k.strip())
        if not keys:
            raise ValueError(f"tenant '{name}': keys_env is {self.keys_env}, but that variable "
                             "is unset or empty where the HTTP replicas run")
        return TenantPolicy(name, keys, self.priority, self.share, self.max_concurrent,
                            self.tokens_per_minute,
                            None if self.models is None else frozenset(self.models), self.admin)


def tenant_policies(tenants: Mapping[str, TenantSettings],
                    environ: Mapping[str, str]) -> tuple[TenantPolicy, ...]:
    policies = tuple(settings.policy(name, environ) for name, settings in tenants.items())
    seen: dict[str, str] = {}
    for policy in policies:
        for key in policy.keys:  # one key, one tenant: a key in two would pick one silently
            if key in seen:
                raise ValueError(f"tenants '{seen[key]}' and '{policy.name}' share a key")
            seen[key] = policy.name
    return policies
