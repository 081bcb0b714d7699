"""A sharded replica as the deployment that places its ranks sees it: the split a model
takes, the stages sized to the Macs, a rank's memory, and a rank's life after loading.

`deployments/` starts the ranks on Macs (Ray actors) and calls only these, never the
engine's `sharded/` or `kv/` rooms (an import contract in `pyproject.toml`), so the engine
can move its insides without the deployments following. The engine's `sharded/rank.py`
loads mlx-lm's model classes, so it is imported only when a function here runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from replicas.engine.config import EngineConfig, Mode, ShardPlan
from replicas.engine.sharded.kv_parts import KvParts
from replicas.engine.sharded.stages import plan_stages

__all__ = ["follow", "layer_count", "machine_bytes", "plan_stages", "sharding_mode",
           "sharding_problem"]


def sharding_mode(config: dict[str, Any], shards: int, requested: str = "auto",
                  pipeline_layers: Sequence[int] | None = None) -> Mode:
    """The split (`tensor` or `pipeline`) for `shards` ranks of a model with this
    config.json; a `ValueError` naming the field when it cannot take them."""
    from replicas.engine.sharded.rank import sharding_mode as mode

    return mode(config, shards, requested, pipeline_layers)


def sharding_problem(config: dict[str, Any], shards: int, requested: str = "auto",
                     pipeline_layers: Sequence[int] | None = None) -> str | None:
    """What is wrong with these `shards`/`sharding` values for this model, naming the
    field; None when it takes them. Reads the config and the model class, no weights."""
    from replicas.engine.sharded.rank import ShardingError, sharding_mode as mode

    try:
        mode(config, shards, requested, pipeline_layers)
    except ShardingError as exc:
        return str(exc)
    return None


def layer_count(config: dict[str, Any]) -> int:
    """The model's transformer layers (a pipeline's stages split these)."""
    from replicas.engine.sharded.rank import layer_count as count

    return count(config)


def machine_bytes() -> int:
    """This Mac's memory for a model: its recommended GPU working set (elsewhere its RAM),
    what pipeline stages are sized by."""
    from replicas.engine.kv.budget import machine  # MLX: only where a rank runs

    return machine().bytes


def follow(source: str, resolved: Path | str, plan: ShardPlan, engine: EngineConfig,
           wait_for_work: Callable[[], None], parts: KvParts | None = None) -> int:
    """Ranks 1..N-1: load this rank's shard, then replay rank 0's batch until it stops.
    Returns the steps run. `parts`: this rank's parts of KV moving between replicas."""
    from replicas.engine.sharded.rank import follow as run

    return run(source, resolved, plan, engine, wait_for_work, parts)
