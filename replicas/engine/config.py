"""What an engine is configured with: plain values, no MLX, so `replicas.options` and the
deployments' config read them without loading the model stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["tensor", "pipeline"]
Backend = Literal["ring", "jaccl"]
# How a vector is pooled from the hidden states (`replicas.engine.embedding`).
Pooling = Literal["last_token", "mean", "cls"]


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32  # sequences decoded together
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    stuck_after_s: float = 120.0  # a step longer than this marks the engine unhealthy
    # KV bytes for running requests plus the prefix cache (`replicas.engine.memory`); None: a
    # share of the machine's memory less the weights.
    kv_budget_bytes: int | None = None
    max_memory_waiting: int = 64  # requests waiting for KV memory before overload errors
    # "grow": a request reserves its prompt and grows a cache step at a time, the youngest
    # preempted when memory runs out; "whole": it reserves prompt + max_tokens at once and
    # is never preempted (fewer requests run together).
    kv_reservation: Literal["grow", "whole"] = "grow"
    # A request waiting this long for KV memory gets the overloaded error (None: no bound);
    # set below the ingress's request deadline, so the client hears "retry" rather than 504.
    max_memory_wait_s: float | None = None
    # KV of earlier prompts kept for reuse, bytes per replica (0: off). Sequences in the
    # batch are not counted: this is what stays resident between requests.
    prompt_cache_bytes: int = 2 * 1024**3
    # The prefix cache's disk tier (`replicas.engine.disk_cache`): a directory for the KV
    # memory evicts and all of it at shutdown, bounded by bytes; None: memory only.
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 16 * 1024**3


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
    # order); None: mlx-lm's even split (`replicas.engine.stages`).
    layers: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        return f"shard {self.rank + 1} of {self.size} ({self.mode})"
