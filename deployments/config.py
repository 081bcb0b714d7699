"""The typed shape of `serve_config.yaml`'s `args:`; unknown keys are errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSettings(_Strict):
    max_batch_size: int = Field(32, ge=1, description="Sequences decoded together per replica.")
    prefill_batch_size: int = Field(8, ge=1, description="Prompts prefilled together.")
    prefill_step_size: int = Field(2048, ge=16, description="Prompt tokens per prefill step.")


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
    num_replicas: int | Literal["auto"] = 1
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    max_queued_requests: int = Field(-1, ge=-1, description="-1: unbounded (Ray's default).")
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)
    engine: EngineSettings = Field(default_factory=EngineSettings)

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


class AppArgs(_Strict):
    models: list[ModelSettings] = Field(min_length=1)
    ingress: IngressSettings = Field(default_factory=IngressSettings)

    @model_validator(mode="after")
    def _names_unique(self) -> "AppArgs":
        seen: set[str] = set()
        for model in self.models:
            for name in (model.id, *model.aliases):
                if name in seen:
                    raise ValueError(f"model name '{name}' is used twice")
                seen.add(name)
        return self
