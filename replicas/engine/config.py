"""What an engine is configured with: plain values, no MLX, so `replicas.options` and the
deployments' config read them without loading the model stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["tensor", "pipeline"]
Backend = Literal["ring", "jaccl"]
# How a vector is pooled from the hidden states (`replicas.engine.model.embedding`).
Pooling = Literal["last_token", "mean", "cls"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's names: draft up to `num_speculative_tokens` tokens
    after the longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens that
    occurred before (prompt lookup, `replicas.engine.spec.ngram`), or, with `draft_model`
    (a source, as a model's), what that model writes (`replicas.engine.spec.draft_model`), or
    with `mtp`, what the checkpoint's own MTP layer writes (`replicas.engine.model.mtp`); no
    drafts while more than `disable_by_batch_size` rows decode (None: at any size), nor,
    with `disable_when_slower`, at a batch size where the engine measured drafting making
    fewer tokens a second than not (`replicas.engine.spec.gate`)."""

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    draft_model: str | None = None
    mtp: bool = False
    disable_when_slower: bool = True

    def __post_init__(self) -> None:
        if self.mtp and self.draft_model:
            raise ValueError("an MTP layer and a draft model cannot both draft")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")

    @property
    def method(self) -> str:
        """The config's `method`, as metrics label it."""
        return "mtp" if self.mtp else "draft" if self.draft_model else "ngram"


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32  # sequences decoded together
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    stuck_after_s: float = 120.0  # a step longer than this marks the engine unhealthy
    # KV bytes for running requests plus the prefix cache (`replicas.engine.kv.budget`); None: a
    # share of the machine's memory less the weights.
    kv_budget_bytes: int | None = None
    max_memory_waiting: int = 64  # requests waiting for KV memory before overload errors
    # "grow": a request reserves its prompt and grows a cache step at a time, the youngest
    # preempted when memory runs out; "whole": it reserves prompt + max_tokens at once and
    # is never preempted (fewer requests run together).
    kv_reservation: Literal["grow", "whole"] = "grow"
    # Paged KV (`replicas.engine.kv.paged`): a batch holds the sum of its rows' blocks, not
    # rows x the longest. "auto": where the model qualifies (every layer plain attention, no
    # kv_bits, no speculation, one process), else mlx-lm's padded batch; "on": refuse to
    # load where it does not; "off": the padded batch.
    paged_kv: Literal["off", "on", "auto"] = "off"
    # A request waiting this long for KV memory gets the overloaded error (None: no bound);
    # set below the ingress's request deadline, so the client hears "retry" rather than 504.
    max_memory_wait_s: float | None = None
    # KV of earlier prompts kept for reuse, bytes per replica (0: off). Sequences in the
    # batch are not counted: this is what stays resident between requests.
    prompt_cache_bytes: int = 2 * 1024**3
    # The prefix cache's disk tier (`replicas.engine.kv.disk`): a directory for the KV
    # memory evicts and all of it at shutdown, bounded by bytes; None: memory only.
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 16 * 1024**3
    # KV cache quantized to this many bits (4 or 8; `replicas.engine.kv.quantized`) in
    # groups of `kv_group_size` values; None: the model's dtype.
    kv_bits: int | None = None
    kv_group_size: int = 64
    # Speculative decoding inside the batch (`replicas.engine.spec.drafter`); None: off.
    speculative: SpeculativeConfig | None = None


@dataclass(frozen=True)
class ShardPlan:
    """One rank's part in a sharded replica."""

    mode: Mode
    rank: int
    size: int
    backend: Backend
    # Ring: "ip:port" where each rank listens, by rank. JACCL: rank 0's is the coordinator.
    addresses: tuple[str, ...]
    # JACCL only: RDMA device from rank i to rank j (None on the diagonal), as `mlx.launch`
    # writes it.
    rdma_devices: tuple[tuple[str | None, ...], ...] | None = None
    # Pipeline only: layers per rank, rank 0 first (rank 0 runs the last ones, mlx-lm's
    # order); None: mlx-lm's even split (`replicas.engine.sharded.stages`).
    layers: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        return f"shard {self.rank + 1} of {self.size} ({self.mode})"
