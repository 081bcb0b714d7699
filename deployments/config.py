"""The typed shape of `serve_config.yaml`'s `args:`; unknown keys are errors.

Each value has one home. Engine defaults live in `replicas.engine.config.EngineConfig`, replica
defaults in `replicas.options.ReplicaOptions`, the valid format names in the replica's
registries; the settings here read them (engine and replica defaults lazily: those modules
import mlx, which the cluster CLI that reads these settings must not need).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from ray.serve.config import AutoscalingConfig

from replicas.engine.config import Pooling
from replicas.families.registry import CHANNEL_FORMATS, TOOL_FORMATS


from deployments.replica_settings import (  # noqa: F401 - part of this module's API
    _Strict,
    _engine_default,
    _replica_default,
    EngineSettings,
    PromptCacheSettings,
    PullSettings,
    SpeculativeSettings,
    MemorySettings,
    MEMORY_WAIT_SHARE,
    RoutingPolicy,
    RoutingSettings,
    PlacementSettings,
    DistributedSettings,
    ClusterSettings,
)
from deployments.edge_settings import (  # noqa: F401 - part of this module's API
    ImageSettings,
    IngressSettings,
    ObservabilitySettings,
    ResponsesSettings,
)
from deployments.roles import check_roles, served
from deployments.tenants import TenantSettings


class AdapterSettings(_Strict):
    """One LoRA adapter of a model (`adapters:`), in mlx-lm's format."""

    path: str = Field(min_length=1, description="A directory as `mlx_lm.lora` writes it: "
                      "adapter_config.json and adapters.safetensors (LoRA or DoRA).")
    aliases: list[str] = Field(default_factory=list, description="Names a request may send "
                               "as `model` for this model with this adapter.")


class ModelSettings(_Strict):
    id: str = Field(min_length=1, description="The name clients send as `model`.")
    source: str = Field(min_length=1,
                        description="Local path, Hugging Face repo id, or builtin:NAME.")
    aliases: list[str] = Field(default_factory=list)
    default_stops: list[str] = Field(default_factory=list,
                                     description="Merged with each request's stops.")
    channel_format: str | None = Field(
        None, description="Reasoning format, a name in replicas.families.registry."
                          "CHANNEL_FORMATS; detected from the tokenizer when unset.")
    tool_format: str | None = Field(
        None, description="Tool-call syntax, a name in replicas.families.registry."
                          "TOOL_FORMATS; detected from the chat template when unset.")
    thinking_budget: int | None = Field(None, ge=1, description="Default reasoning budget.")
    max_model_len: int | None = Field(
        None, ge=16, description="Cap on prompt plus output tokens, below the model's own "
                                 "context (less KV memory); unset: the model's context.")
    max_tokens_past_context: Literal["clamp", "reject"] = Field(
        "clamp", description="A max_tokens past what the context has left: `clamp` lowers "
                             "it to what is left, `reject` answers 400.")
    embeddings: Pooling | None = Field(
        None, description="Serve `/v1/embeddings` with this pooling of the hidden states "
        "(`last_token`: the last token's; `mean`: the mean over the input's tokens; `cls`: "
        "the first token's, as BERT-style encoders pool), "
        "normalized: opts a chat model in, or overrides an embedding checkpoint's own "
        "sentence-transformers files. Unset: only a checkpoint whose files name a pooling "
        "(Qwen3-Embedding's) serves embeddings; any other model answers 400.")
    kind: Literal["auto", "text", "vision", "rerank"] = Field(
        "auto", description="`auto`: a vision-language checkpoint of a type Orchard serves "
        "with images (replicas/vision.py) takes them, any other model reads text (images "
        "become placeholders); `text`: always text; `vision`: must take images (the replica "
        "fails to load otherwise); `rerank`: a decoder that also serves `/v1/rerank` by its "
        "\"yes\"/\"no\" logits, as Qwen3-Reranker (replicas/reranker.py; a cross-encoder "
        "with a classification head reranks without it).")
    embedding_dimensions: bool = Field(
        False, description="The model was trained Matryoshka-style (Qwen3-Embedding): a "
        "request's `dimensions` keeps the first N values and re-normalizes. False: "
        "`dimensions` is a 400.")
    load_timeout_s: float = Field(
        default_factory=_replica_default("load_timeout_s"), gt=0,
        description="Seconds a replica may take to fetch and load its model before it "
                    "gives up; the first download of a big model is the long one.")
    stream_flush_ms: float = Field(
        default_factory=_replica_default("flush_interval_s", 1000.0), ge=0,
        description="After the first event, stream chunks leave at most this often "
                    "(0: as soon as ready).")
    stream_chunks_per_s: float = Field(
        default_factory=_replica_default("max_chunks_per_s"), ge=0,
        description="Chunks per second a replica's streams send together, at most (0: no "
                    "bound): with many streams, each chunk carries several tokens.")
    num_replicas: int | Literal["auto"] = 1
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(-1, ge=-1, description="-1: unbounded (Ray's default).")
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    prompt_cache: PromptCacheSettings = Field(default_factory=PromptCacheSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    speculative: SpeculativeSettings | None = Field(
        None, description="Speculative decoding and grammar fast-forward (README: Faster "
        "decoding); unset: off.")
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    placement: PlacementSettings | None = Field(
        None, description="Keys set here override `cluster.placement` for this model.")
    graceful_shutdown_timeout_s: float = Field(
        300.0, ge=0, description="How long a replica being replaced or scaled down keeps "
                                 "serving its in-flight generations.")
    shards: int = Field(1, ge=1, le=64, description="Processes (Macs) one replica's model is "
                        "split over with mx.distributed; `num_replicas` x `shards` nodes.")
    sharding: Literal["auto", "tensor", "pipeline"] = Field(
        "auto", description="How the model is split: `tensor` (every rank a slice of every "
        "layer), `pipeline` (each rank a run of layers); `auto`: tensor where mlx-lm can, "
        "else pipeline. Checked against the architecture at deploy.")
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="Prefill/decode split: a `decode` model and a `prefill` entry "
        "of the same id and source; the decode replicas hand each prompt with at least "
        "`prefill_min_tokens` uncached tokens to the prefill replicas, take its KV back "
        "and stream (docs/cluster.md). `both`: every replica does both.")
    prefill_min_tokens: int = Field(1024, ge=1, description="On a `decode` model: prompts "
                                    "missing at least this many cached tokens are prefilled "
                                    "on the prefill replicas; shorter ones here.")
    adapters: dict[str, AdapterSettings] = Field(
        default_factory=dict, description="LoRA adapters by name, each a directory in "
        "mlx-lm's format (or {path, aliases}): a request picks one with `model: ID:NAME` "
        "or an alias; rows with different adapters, or none, decode in one batch "
        "(docs/architecture/adapters.md).")

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapter_paths(cls, value: Any) -> Any:
        # `name: path` is the short form of `name: {path: ...}`.
        if isinstance(value, dict):
            return {k: {"path": v} if isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _adapters_servable(self) -> "ModelSettings":
        for name in self.adapters:
            if not name or ":" in name:
                raise ValueError(f"adapter name '{name}' must be non-empty, without ':'")
        if self.adapters and (self.shards > 1 or self.role != "both"):
            raise ValueError(f"model '{self.id}': LoRA adapters are served by whole-model "
                             "replicas that prefill and decode (shards: 1, role: both)")
        return self

    def adapter_names(self) -> list[str]:
        """Every name a request may pick one of its adapters by: `ID:NAME`, then aliases."""
        return [*(f"{self.id}:{n}" for n in self.adapters),
                *(a for s in self.adapters.values() for a in s.aliases)]

    @field_validator("channel_format", "tool_format")
    @classmethod
    def _format_known(cls, value: str | None, info: ValidationInfo) -> str | None:
        # The registries are the one list of names; the config only looks them up.
        registry = CHANNEL_FORMATS if info.field_name == "channel_format" else TOOL_FORMATS
        if value is not None and value not in registry:
            raise ValueError(f"unknown {info.field_name} '{value}'; valid: "
                             f"{', '.join(sorted(registry))}")
        return value

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_bound(cls, value: int) -> int:
        # Ray refuses 0 only when the app deploys, after `serve run` has started.
        if value == 0:
            raise ValueError("max_queued_requests is -1 (unbounded) or at least 1")
        return value

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

    @property
    def routing_policy(self) -> RoutingPolicy:
        """The policy in force: `auto` resolved by whether more than one replica may run."""
        if self.routing.policy != "auto":
            return self.routing.policy
        scales = self.num_replicas != 1 or self.autoscaling_config is not None
        return "prefix" if scales else "none"

    def with_memory_wait(self, request_timeout_s: float | None) -> "ModelSettings":
        """These settings with `memory.max_wait_s` derived from the ingress's deadline
        unless it is set."""
        if self.memory.max_wait_s is not None or request_timeout_s is None:
            return self
        memory = self.memory.model_copy(
            update={"max_wait_s": request_timeout_s * MEMORY_WAIT_SHARE})
        return self.model_copy(update={"memory": memory})

    def with_placement(self, cluster: PlacementSettings) -> "ModelSettings":
        """These settings with the effective placement: the cluster's, overridden by ours."""
        own = self.placement.model_dump(exclude_unset=True) if self.placement else {}
        return self.model_copy(update={"placement": cluster.model_copy(update=own)})

    @model_validator(mode="after")
    def _rdma_matrix(self) -> "ModelSettings":
        devices = self.distributed.rdma_devices
        if self.distributed.backend == "jaccl" and self.shards > 1:
            if devices is None or len(devices) != self.shards or any(
                    len(row) != self.shards for row in devices):
                raise ValueError(f"distributed.rdma_devices must be a {self.shards} x "
                                 f"{self.shards} matrix with backend jaccl (shards: "
                                 f"{self.shards})")
        return self

    @model_validator(mode="after")
    def _one_per_rank(self) -> "ModelSettings":
        for name in ("pipeline_layers", "node_memory_bytes"):
            values = getattr(self.distributed, name)
            if values is not None and len(values) != self.shards:
                raise ValueError(f"distributed.{name} needs one value per rank: {self.shards} "
                                 f"(shards), got {len(values)}")
        if self.distributed.pipeline_layers is not None and self.sharding == "tensor":
            raise ValueError("distributed.pipeline_layers needs sharding: pipeline (tensor "
                             "parallel gives every rank an equal share)")
        if self.prompt_cache.disk_path is not None and self.shards > 1:
            raise ValueError("prompt_cache.disk_path needs shards: 1 (a sharded replica's "
                             "ranks keep their caches in lockstep, in memory only)")
        if self.kind == "vision" and self.shards > 1:
            raise ValueError("kind: vision needs shards: 1 (a sharded replica reads text only)")
        if self.kind == "rerank" and self.shards > 1:
            raise ValueError("kind: rerank needs shards: 1 (a sharded replica does not rerank)")
        return self

    @property
    def placement_strategy(self) -> str:
        """Ray's strategy for a sharded replica's bundles (`distributed.placement_strategy`)."""
        chosen = self.distributed.placement_strategy
        if chosen != "auto":
            return chosen
        return "STRICT_SPREAD" if self.placement is not None and self.placement.pin else "PACK"

    @model_validator(mode="after")
    def _stops_non_empty(self) -> "ModelSettings":
        if any(not s for s in self.default_stops):
            raise ValueError("default_stops must be non-empty strings")
        if self.num_replicas == "auto" and self.autoscaling_config is None:
            return self
        if self.autoscaling_config is not None and self.num_replicas not in (1, "auto"):
            raise ValueError("set either num_replicas or autoscaling_config, not both")
        return self


def replica_max_stops(request_max: int, model: ModelSettings) -> int:
    """The replica's cap on merged stops: what a request may send plus the model's defaults.

    The one stop limit a user sets is `ingress.max_stops`; the replica's check (which counts
    after merging) is derived from it, so the two can never disagree."""
    return request_max + len(model.default_stops)


class AppArgs(_Strict):
    models: list[ModelSettings] = Field(min_length=1)
    ingress: IngressSettings = Field(default_factory=IngressSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    api_keys: list[SecretStr] = Field(default_factory=list, description="Accepted API keys; "
                                      "with none here or in `api_keys_env`, no auth.")
    api_keys_env: str | None = Field(None, min_length=1, description="Environment variable "
                                     "with comma-separated API keys, read where the ingress "
                                     "runs (e.g. ORCHARD_API_KEYS); unset or empty is an error.")
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    tenants: dict[str, TenantSettings] = Field(
        default_factory=dict, description="Who shares the cluster (deployments/tenants.py): "
        "each tenant's keys (from the environment), priority, share and limits. With "
        "tenants, a key in none is a 401; `api_keys` and `api_keys_env` must be unset.")

    @model_validator(mode="after")
    def _tenants_own_the_keys(self) -> "AppArgs":
        if self.tenants and (self.api_keys or self.api_keys_env):
            raise ValueError("with tenants, every key belongs to one: move api_keys / "
                             "api_keys_env into a tenant's keys_env")
        names = {name for m in self.served_models for name in (m.id, *m.aliases)}
        for tenant, settings in self.tenants.items():
            unknown = sorted(set(settings.models or ()) - names)
            if unknown:
                raise ValueError(f"tenant '{tenant}' names models not served: "
                                 f"{', '.join(unknown)}")
        return self

    @field_validator("api_keys")
    @classmethod
    def _keys_non_empty(cls, keys: list[SecretStr]) -> list[SecretStr]:
        if any(not key.get_secret_value().strip() for key in keys):
            raise ValueError("api_keys must be non-empty strings")
        return keys

    @model_validator(mode="after")
    def _colocate_one_model(self) -> "AppArgs":
        if self.ingress.colocate is True and len(self.models) != 1:
            raise ValueError("ingress.colocate serves exactly one model; "
                             f"{len(self.models)} are configured")
        return self

    @property
    def colocated(self) -> bool:
        """Whether HTTP is served from the model's replicas (the `ingress.colocate` rule)."""
        if self.ingress.colocate != "auto":
            return self.ingress.colocate
        # Several replicas want the ingress's cache-aware routing, several models its
        # dispatch, and a scaled ingress was asked for; one model on one replica gains
        # nothing from a hop in front of it.
        if len(self.models) != 1 or self.ingress.num_replicas != 1:
            return False
        model = self.models[0]
        return model.num_replicas == 1 and model.autoscaling_config is None

    @property
    def http_replicas(self) -> int | None:
        """How many replicas serve HTTP at most (None: autoscaled without a bound)."""
        if not self.colocated:
            return self.ingress.num_replicas
        model = self.models[0]
        if model.autoscaling_config is not None:
            return model.autoscaling_config.get("max_replicas")
        return None if model.num_replicas == "auto" else model.num_replicas

    @model_validator(mode="after")
    def _names_unique(self) -> "AppArgs":
        seen: set[str] = set()
        for model in self.served_models:
            for name in (model.id, *model.aliases, *model.adapter_names()):
                if name in seen:
                    raise ValueError(f"model name '{name}' is used twice")
                seen.add(name)
        return self

    @model_validator(mode="after")
    def _roles_paired(self) -> "AppArgs":
        check_roles(self.models)
        return self

    @property
    def served_models(self) -> list[ModelSettings]:
        """The models clients name: every entry but the prefill replicas of a split one."""
        return served(self.models)
