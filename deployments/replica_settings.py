"""The per-model parts of `serve_config.yaml` that configure a replica's engine, memory,
routing, placement and sharding (`deployments.config` composes them into `ModelSettings`).
Defaults are read lazily from `replicas.engine.config.EngineConfig` and
`replicas.options.ReplicaOptions`, which import mlx."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from replicas.engine.config import SpeculativeConfig
    from replicas.options import PullOptions


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _engine_default(name: str) -> Callable[[], Any]:
    def default() -> Any:
        from replicas.engine.config import EngineConfig

        return getattr(EngineConfig(), name)

    return default


def _replica_default(name: str, scale: float = 1.0) -> Callable[[], Any]:
    def default() -> Any:
        from replicas.options import ReplicaOptions

        return getattr(ReplicaOptions(model_id="", source=""), name) * scale

    return default


class EngineSettings(_Strict):
    """Defaults are `replicas.engine.config.EngineConfig`'s (32 / 8 / 2048 as of writing)."""

    max_batch_size: int = Field(default_factory=_engine_default("max_batch_size"), ge=1,
                                description="Sequences decoded together per replica.")
    prefill_batch_size: int = Field(default_factory=_engine_default("prefill_batch_size"),
                                    ge=1, description="Prompts prefilled together.")
    prefill_step_size: int = Field(default_factory=_engine_default("prefill_step_size"),
                                   ge=16, description="Prompt tokens per prefill step.")
    stuck_after_s: float = Field(default_factory=_engine_default("stuck_after_s"), gt=0,
                                 description="A batch step running longer than this fails "
                                 "the replica's health check, and Serve replaces it.")
    kv_bits: Literal[4, 8] | None = Field(
        default_factory=_engine_default("kv_bits"), description="Quantize the KV cache to 4 or 8 bits (about 0.28x / 0.53x the "
        "bytes of a 16-bit cache with groups of 64): more sequences and longer contexts in "
        "the same memory, at some cost in accuracy. Unset: the model's dtype.")
    kv_group_size: Literal[32, 64, 128] = Field(
        default_factory=_engine_default("kv_group_size"), description="Values sharing one scale and bias in the quantized KV cache.")

    @model_validator(mode="after")
    def _batch_holds_a_prefill(self) -> "EngineSettings":
        # mlx-lm silently decodes max(max_batch_size, prefill_batch_size) sequences at once,
        # so a smaller max_batch_size would not be the limit it says it is.
        if self.prefill_batch_size > self.max_batch_size:
            raise ValueError(f"engine.prefill_batch_size ({self.prefill_batch_size}) must not "
                             f"exceed engine.max_batch_size ({self.max_batch_size})")
        return self


class PromptCacheSettings(_Strict):
    """The replica's KV prefix cache; the default is `replicas.engine.config.EngineConfig`'s."""

    max_bytes: int = Field(default_factory=_engine_default("prompt_cache_bytes"), ge=0,
                           description="KV of earlier prompts kept for reuse, in bytes per "
                                       "replica (LRU); 0 turns the cache off.")
    disk_path: str | None = Field(
        None, description="A directory on local SSD for the cache's disk tier: each entry "
        "a request leaves is written there as it is saved (and what the memory tier evicts, "
        "and all of it at shutdown), and a restart finds them, however the server was "
        "stopped; `auto`: `kv/` under Orchard's cache directory. Unset: memory only.")
    disk_bytes: int = Field(default_factory=_engine_default("disk_cache_bytes"), ge=1,
                            description="Bound of the disk tier, bytes per model (LRU).")

    def disk_dir(self) -> str | None:
        """`disk_path` resolved (`auto`: Orchard's cache directory, read where it runs)."""
        if self.disk_path != "auto":
            return self.disk_path
        from replicas.builtin.build import orchard_cache

        return str(orchard_cache("kv"))


class SpeculativeSettings(_Strict):
    """Speculative decoding inside the batch (`replicas.engine.spec.drafter`), vLLM's names.
    Greedy output is unchanged and sampled output keeps the model's distribution; it pays
    where outputs repeat their context (code edits, quoted files, JSON echoes)."""

    method: Literal["ngram", "draft", "mtp"] = Field(
        "ngram", description="`ngram`: prompt lookup, drafts copied from the sequence itself "
        "after its newest tokens' earlier occurrence (no draft model); `draft`: what "
        "`draft_model` writes; `mtp`: what the checkpoint's own multi-token-prediction "
        "layer writes (DeepSeek V3, Kimi K2, GLM-4.5, GLM-4.7-Flash as published, not "
        "quantized conversions).")
    draft_model: str | None = Field(
        None, description="`method: draft`: a smaller model with the same tokenizer, named "
        "as `source` is (a Hugging Face repo, a path, builtin:NAME); loaded beside the model.")
    num_speculative_tokens: int = Field(4, ge=1, le=16,
                                        description="Most draft tokens a row verifies per pass.")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest suffix looked up.")
    prompt_lookup_min: int = Field(2, ge=1, description="Shortest suffix looked up.")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="No drafts while more rows than this decode (a large batch "
        "is compute-bound, where verifying costs more than it saves); unset: any size.")
    disable_when_slower: bool = Field(
        True, description="No drafts at a batch size where the engine measured them making "
        "fewer tokens a second than plain steps (it compares the two a window of steps at a "
        "time, and re-checks now and then); false: draft whenever rows have drafts.")

    @model_validator(mode="after")
    def _lookup_range(self) -> "SpeculativeSettings":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("speculative.draft_model goes with method: draft, and only there")
        return self

    def engine(self) -> "SpeculativeConfig":
        """As the engine takes it (`replicas.engine.config.SpeculativeConfig`)."""
        from replicas.engine.config import SpeculativeConfig

        return SpeculativeConfig(**self.model_dump(exclude={"method"}), mtp=self.method == "mtp")


class MemorySettings(_Strict):
    """KV memory admission (`replicas.engine.kv.budget`): a request joins the batch when its
    prompt's KV fits and grows a cache step at a time; when memory runs out the youngest is
    preempted and resumed later. What cannot join waits, then gets the overloaded error."""

    budget_bytes: int | None = Field(
        None, ge=1, description="KV bytes per Mac for running requests plus the prefix "
        "cache (each rank of a sharded replica holds its own); unset: the machine's memory "
        "(a Mac's recommended GPU working set; elsewhere 75% of RAM) less the weights and a "
        "5% activation reserve (docs/architecture.md, 'KV memory').")
    max_waiting: int = Field(default_factory=_engine_default("max_memory_waiting"), ge=0,
                             description="Requests that may wait for KV memory; past it, the "
                             "newest get the API's overloaded error.")
    max_wait_s: float | None = Field(
        None, gt=0, description="Seconds a request may wait for KV memory before it gets "
        "the overloaded error (with Retry-After); unset: 90% of ingress.request_timeout_s, "
        "so a client hears 'retry' rather than the deadline's 504.")
    reservation: Literal["grow", "whole"] = Field(
        default_factory=_engine_default("kv_reservation"), description="'grow': reserve the "
        "prompt and grow a cache step at a time, preempting the youngest request when memory "
        "runs out (more requests run together); 'whole': reserve prompt + max_tokens up "
        "front and never preempt.")
    paged_kv: Literal["off", "on", "auto"] = Field(
        default_factory=_engine_default("paged_kv"), description="Paged KV: the batch "
        "holds the sum of its rows' KV blocks instead of every row padded to the longest. "
        "'auto': where the model qualifies (every layer plain attention; no kv_bits, no "
        "speculation, not sharded), else the padded batch, said in the log; 'on': refuse to "
        "load where it does not; 'off' (the default until it is proven on more models).")


# Of the request deadline, what a request may spend waiting for KV memory: the rest is for
# the overloaded error to reach the client before the deadline's 504 would.
MEMORY_WAIT_SHARE = 0.9

RoutingPolicy = Literal["auto", "prefix", "session", "none"]


def _pull_default(name: str) -> Callable[[], Any]:
    def default() -> Any:
        from replicas.options import PullOptions

        return getattr(PullOptions(), name)

    return default


class PullSettings(_Strict):
    """Pulling a prompt's prefix KV from the replica the router says holds it, instead of
    prefilling it (`replicas.kv_pull`). Defaults are `replicas.options.PullOptions`'."""

    min_tokens: int = Field(default_factory=_pull_default("min_tokens"), ge=1,
                            description="Fewer missing prompt tokens than this are "
                            "prefilled where the request runs.")
    link_bytes_per_s: float = Field(default_factory=_pull_default("link_bytes_per_s"), gt=0,
                                    description="The link's rate until a pull has measured "
                                    "it (bytes a second; 10 GbE's line rate by default).")
    timeout_s: float = Field(default_factory=_pull_default("timeout_s"), gt=0,
                             description="How long to wait for the holder's KV; then the "
                             "prefix is prefilled.")

    def options(self) -> PullOptions:
        from replicas.options import PullOptions

        return PullOptions(**self.model_dump())


class RoutingSettings(_Strict):
    """Cache-aware routing across a model's replicas (`deployments.routing.prefix`)."""

    policy: RoutingPolicy = Field(
        "auto", description="`prefix`: a request goes to the replica that served its "
        "session (`prompt_cache_key`, Anthropic `metadata.user_id`) or the start of its "
        "prompt; `session`: only requests with a session key are steered; `none`: Ray's "
        "power-of-two choice; `auto`: `prefix` when the model may run more than one replica.")
    max_keys: int = Field(65536, ge=1, description="Prefix and session keys remembered per "
                          "ingress replica (LRU).")
    max_imbalance: int = Field(8, ge=0, description="A request leaves its cache-holding "
                               "replica for the least-loaded one when the first has more "
                               "than this many ongoing requests over the second.")
    stats_period_s: float = Field(1.0, gt=0, description="How often Serve asks each replica "
                                  "for its KV memory and the prefixes it holds (routing "
                                  "stats), which the router weighs and sheds load by.")
    pull: PullSettings | None = Field(
        default_factory=PullSettings, description="A request the router sends away from "
        "the replica holding its prefix pulls that KV from it when faster than a prefill; "
        "null: never.")


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


class DistributedSettings(_Strict):
    """How the processes of a sharded replica (`shards` > 1) find and talk to each other."""

    backend: Literal["ring", "jaccl"] = Field(
        "ring", description="MLX's backend: `ring` (TCP, over Ethernet or a Thunderbolt "
        "bridge) or `jaccl` (RDMA over Thunderbolt, where every node has it).")
    host: str | None = Field(None, min_length=1, description="Address every rank listens "
                             "on; unset: its node's IP as Ray knows it.")
    port_range: tuple[int, int] | None = Field(
        None, description="[low, high]: ports a rank may listen on (the first free one); "
        "unset: any free port. With `jaccl`, rank 0's port is the coordinator's.")
    rdma_devices: list[list[str | None]] | None = Field(
        None, description="`jaccl` only: the RDMA device from rank i to rank j (null on the "
        "diagonal), `shards` x `shards`, as in an `mlx.launch` hostfile.")
    placement_strategy: Literal["auto", "STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"] = \
        Field("auto", description="Ray placement of a replica's shards; `auto`: one per node "
              "(STRICT_SPREAD) when the model is pinned to Macs, else PACK.")
    collective_timeout_s: float = Field(
        30.0, gt=0, description="A batch step that has not returned after this long (a "
        "collective whose peer is gone, a link that stalled) fails the replica; Serve then "
        "replaces it and its streams resume elsewhere. Keep it above the longest prefill "
        "step (`engine.prefill_step_size` tokens) the model takes on these Macs.")
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, description="A shard that has not answered rank 0's heartbeat (every "
        "second or two, busy or idle) for this long is lost: a Mac that froze, slept or "
        "left. The replica fails at once, as for `collective_timeout_s`.")
    pipeline_layers: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="`sharding: pipeline` only: layers per rank, rank 0 first (rank 0 "
        "runs the last layers, mlx-lm's order), summing to the model's layers; unset: in "
        "proportion to each node's memory (`node_memory_bytes`).")
    node_memory_bytes: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="Memory each rank's node has for the model, rank 0 first, which "
        "sizes pipeline stages; unset: what each rank's machine reports (a Mac's "
        "recommended GPU working set, elsewhere its RAM).")

    @field_validator("port_range")
    @classmethod
    def _range_ordered(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1024 <= value[0] <= value[1] <= 65535:
            raise ValueError("port_range must be [low, high] with 1024 <= low <= high <= 65535")
        return value


class ClusterSettings(_Strict):
    placement: PlacementSettings = Field(
        default_factory=PlacementSettings,
        description="Every model's placement; a model's `placement` overrides keys it sets.")
