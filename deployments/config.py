"""The typed shape of `serve_config.yaml`'s `args:`; unknown keys are errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from ray.serve.config import AutoscalingConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSettings(_Strict):
    max_batch_size: int = Field(32, ge=1, description="Sequences decoded together per replica.")
    prefill_batch_size: int = Field(8, ge=1, description="Prompts prefilled together.")
    prefill_step_size: int = Field(2048, ge=16, description="Prompt tokens per prefill step.")


class PlacementSettings(_Strict):
    """Where a model's replicas may start. The default pins nothing, so one machine works."""

    pin: bool = Field(False, description="Request `resource`, so replicas start only on nodes "
                                         "that advertise it (Mac workers).")
    resource: str = Field("apple_silicon", min_length=1,
                          description="Custom Ray resource Mac workers advertise.")
    resource_per_replica: float = Field(1.0, gt=0, description="Units of `resource` one "
                                        "replica takes: 1 on nodes advertising 1 = one per Mac.")
    require_metal: bool | None = Field(None, description="Fail a replica's start where mlx has "
                                       "no Metal GPU; unset: the same as `pin`.")

    @property
    def metal_required(self) -> bool:
        return self.pin if self.require_metal is None else self.require_metal


class ClusterSettings(_Strict):
    placement: PlacementSettings = Field(
        default_factory=PlacementSettings,
        description="Every model's placement; a model's `placement` overrides keys it sets.")


class ModelSettings(_Strict):
    id: str = Field(min_length=1, description="The name clients send as `model`.")
    source: str = Field(min_length=1,
                        description="Local path, Hugging Face repo id, or builtin:NAME.")
    aliases: list[str] = Field(default_factory=list)
    default_stops: list[str] = Field(default_factory=list,
                                     description="Merged with each request's stops.")
    max_stops: int = Field(16, ge=1, description="Most stop strings one request may use.")
    channel_format: Literal["think_tags", "harmony", "none"] | None = Field(
        None, description="Reasoning format; detected from the tokenizer when unset.")
    thinking_budget: int | None = Field(None, ge=1, description="Default reasoning budget.")
    stream_flush_ms: float = Field(5.0, ge=0, description="After the first event, stream "
                                   "chunks leave at most this often (0: as soon as ready).")
    num_replicas: int | Literal["auto"] = 1
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(-1, ge=-1, description="-1: unbounded (Ray's default).")
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    placement: PlacementSettings | None = Field(
        None, description="Keys set here override `cluster.placement` for this model.")
    graceful_shutdown_timeout_s: float = Field(
        300.0, ge=0, description="How long a replica being replaced or scaled down keeps "
                                 "serving its in-flight generations.")

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling_known(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # Ray accepts unknown keys silently; a typo would leave the default in force.
        if value is not None:
            unknown = sorted(set(value) - set(AutoscalingConfig.model_fields))
            if unknown:
                raise ValueError(f"unknown autoscaling_config keys: {', '.join(unknown)}")
            AutoscalingConfig.model_validate(value)
        return value

    def with_placement(self, cluster: PlacementSettings) -> "ModelSettings":
        """These settings with the effective placement: the cluster's, overridden by ours."""
        own = self.placement.model_dump(exclude_unset=True) if self.placement else {}
        return self.model_copy(update={"placement": cluster.model_copy(update=own)})

    @model_validator(mode="after")
    def _stops_non_empty(self) -> "ModelSettings":
        if any(not s for s in self.default_stops):
            raise ValueError("default_stops must be non-empty strings")
        if self.num_replicas == "auto" and self.autoscaling_config is None:
            return self
        if self.autoscaling_config is not None and self.num_replicas not in (1, "auto"):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self


class IngressSettings(_Strict):
    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)
    request_timeout_s: float | None = Field(
        600.0, gt=0, description="Wall-clock limit for one HTTP request, queueing included: "
        "a 504, or an error event ending a stream that outlives it. null: no limit.")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024,
                                description="Larger request bodies are a 413.")
    max_stops: int = Field(16, ge=1, description="Most stop strings plus stop token ids per "
                           "request, checked before any replica time.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string, in characters.")
    cors_origins: list[str] = Field(default_factory=list, description="Origins allowed to "
                                    "call from a browser (`*` for any); empty: CORS off.")
    replica_wait_s: float | None = Field(
        15.0, gt=0, description="How long a request waits for a model replica to accept it "
        "(none running, all busy starting) before a 503/529. null: wait without limit.")
    colocate: bool = Field(False, description="Serve HTTP from the model's own replicas (one "
                           "model only): one process and one Ray hop fewer per token. Scaling "
                           "then follows the model's settings, and `num_replicas`, "
                           "`max_ongoing_requests` and `replica_wait_s` here are unused.")


class AppArgs(_Strict):
    models: list[ModelSettings] = Field(min_length=1)
    ingress: IngressSettings = Field(default_factory=IngressSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    api_keys: list[SecretStr] = Field(default_factory=list, description="Accepted API keys; "
                                      "with none here or in `api_keys_env`, no auth.")
    api_keys_env: str | None = Field(None, min_length=1, description="Environment variable "
                                     "with comma-separated API keys, read where the ingress "
                                     "runs (e.g. ORCHARD_API_KEYS); unset or empty is an error.")

    @field_validator("api_keys")
    @classmethod
    def _keys_non_empty(cls, keys: list[SecretStr]) -> list[SecretStr]:
        if any(not key.get_secret_value().strip() for key in keys):
            raise ValueError("api_keys must be non-empty strings")
        return keys

    @model_validator(mode="after")
    def _colocate_one_model(self) -> "AppArgs":
        if self.ingress.colocate and len(self.models) != 1:
            raise ValueError("ingress.colocate serves exactly one model; "
                             f"{len(self.models)} are configured")
        return self

    @model_validator(mode="after")
    def _names_unique(self) -> "AppArgs":
        seen: set[str] = set()
        for model in self.models:
            for name in (model.id, *model.aliases):
                if name in seen:
                    raise ValueError(f"model name '{name}' is used twice")
                seen.add(name)
        return self
