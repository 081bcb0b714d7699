"""`ReplicaOptions`: what one model replica is configured with (the deployment builds it
from the model's settings; `deployments.config` reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from replicas.engine.config import EngineConfig, Pooling, ShardPlan

# `rerank`: a decoder scored as Qwen3-Reranker (replicas/reranker.py); it reads text.
ModelKind = Literal["auto", "text", "vision", "rerank"]


@dataclass(frozen=True)
class PullOptions:
    """When a replica pulls a prompt's prefix KV from another (`replicas.kv_pull`)."""

    min_tokens: int = 512  # fewer missing prompt tokens than this are prefilled here
    link_bytes_per_s: float = 1.25e9  # the first estimate of the link (10 GbE's line rate)
    timeout_s: float = 30.0  # for the holder's answer; then the prefix is prefilled


@dataclass(frozen=True)
class ReplicaOptions:
    model_id: str
    source: str
    default_stops: tuple[str, ...] = ()
    max_stops: int = 16
    channel_format: str | None = None  # None: detected from the tokenizer
    thinking_budget: int | None = None  # default budget for reasoning, in tokens
    tool_format: str | None = None  # None: detected from the chat template and vocabulary
    # Caps the model's context (vLLM's max_model_len): KV memory grows with it, and a Mac
    # with little memory can serve a long-context model at a shorter length.
    max_model_len: int | None = None
    # A max_tokens past the context: "clamp" lowers it to what is left, "reject" is a 400.
    max_tokens_past_context: str = "clamp"
    engine: EngineConfig = field(default_factory=EngineConfig)
    # A first download of a model of a few hundred GB at a home connection's speed.
    load_timeout_s: float = 3600.0
    # After the first chunk, a stream's chunks leave at most this often, so one carries
    # several tokens when decode is fast: each costs about 1.5 ms of CPU through Ray's
    # replica bridge and proxy, whatever it holds (load/RESULTS.md, issue 23). 50 a second
    # still reads as smooth streaming; a slower model sends one token per chunk as before.
    flush_interval_s: float = 0.02
    # Chunks per second the replica's streams send together, at most (0: no bound). With
    # many streams each chunk waits longer and carries more tokens; one stream alone stays
    # at `flush_interval_s`.
    max_chunks_per_s: float = 500.0
    # Pulling prefix KV from the replica that holds it (`replicas.kv_pull`): when it pays.
    pull: PullOptions = field(default_factory=PullOptions)
    # This process's part of a sharded replica (rank 0 here); None: the whole model.
    shard: ShardPlan | None = None
    # `/v1/embeddings`: the pooling a chat model opts in with (or that overrides an
    # embedding checkpoint's own files); None: what the files say (`replicas.embedding_files`).
    embeddings: Pooling | None = None
    # The model was trained Matryoshka-style: a request's `dimensions` truncates its vectors.
    embedding_dimensions: bool = False
    # "auto": a vision-language checkpoint Orchard can serve takes images (`replicas.vision`);
    # "text": never; "vision": must (a load error otherwise).
    kind: ModelKind = "auto"
    # LoRA adapters in mlx-lm's format, (name, directory), chosen per request by name and
    # decoded side by side in one batch (`replicas.engine.model.adapters`).
    adapters: tuple[tuple[str, str], ...] = ()
