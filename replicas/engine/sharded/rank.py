"""One model across several processes (one per Mac): which split an architecture allows,
joining the `mx.distributed` group, and loading this rank's shard with mlx-lm.

The split is mlx-lm's own: tensor parallel where the model class has `shard()` (every rank
holds a slice of every layer; two all-reduces per layer), pipeline parallel where its
layers are a `PipelineMixin` (each rank holds a run of whole layers and reads only their
weight files; one hop per stage). Who the ranks are and where they listen comes from the
caller (Ray, in `deployments.shards`): this module starts no process and opens no socket of
its own; MLX's ring (TCP) or JACCL (RDMA over Thunderbolt) backend does the talking.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.pipeline import PipelineMixin
# Private helpers of the pinned mlx-lm: its own architecture lookup and Hub fetch, so a
# config is judged exactly as `sharded_load` will load it.
from mlx_lm.utils import _get_classes, sharded_load

from replicas.engine.batch.local import LocalBatch
from replicas.engine.config import EngineConfig, Mode, ShardPlan
from replicas.engine.model.loading import LoadedModel, loaded_model
from replicas.engine.model.mtp import Mtp
from replicas.engine.sharded.kv_parts import KvParts
from replicas.engine.sharded.lockstep import Follower
from replicas.engine.sharded.stages import held_layers, split_stages, stage_layers
from replicas.engine.kv.quantized import cache_maker
from replicas.engine.kv.budget import RankMemory, plan_memory
from replicas.engine.kv.directory import HeldBlocks
from replicas.engine.spec.sharded import SharedDrafts
from replicas.startup import Progress



class ShardingError(ValueError):
    """A `shards`/`sharding` value this model cannot take; names the field."""


def sharding_mode(config: dict[str, Any], shards: int, requested: str = "auto",
                  pipeline_layers: Sequence[int] | None = None) -> Mode:
    """The split for `shards` ranks of a model with this config.json, or a ShardingError
    naming the field. `auto`: tensor where mlx-lm can shard the architecture, else
    pipeline. `pipeline_layers`: a pinned split, which must sum to the model's layers.
    Reads only the config and the model class: no weights."""
    if shards < 1:
        raise ShardingError(f"shards must be at least 1 (got {shards})")
    try:
        model_class, _ = _get_classes(config)  # mlx-lm's own lookup (pinned version)
    except (KeyError, ValueError) as exc:
        raise ShardingError(f"shards: {shards}: mlx-lm does not know this architecture "
                            f"({exc})") from exc
    tensor = hasattr(model_class, "shard")
    module = sys.modules[model_class.__module__]
    pipeline = any(isinstance(v, type) and issubclass(v, PipelineMixin) and v is not PipelineMixin
                   for v in vars(module).values())
    kind = config.get("model_type", "?")
    if requested == "auto":
        if not (tensor or pipeline):
            raise ShardingError(f"shards: {shards}: mlx-lm can split a {kind} model neither by "
                                "tensor nor by pipeline")
        mode: Mode = "tensor" if tensor else "pipeline"
    elif requested in ("tensor", "pipeline"):
        if not (tensor if requested == "tensor" else pipeline):
            raise ShardingError(f"sharding: {requested}: mlx-lm cannot split a {kind} model "
                                f"that way")
        mode = "tensor" if requested == "tensor" else "pipeline"
    else:
        raise ShardingError(f"sharding must be auto, tensor or pipeline (got {requested!r})")
    if shards > 1:
        _check_divisible(config, shards, mode)
    if pipeline_layers is not None:
        if mode != "pipeline":
            raise ShardingError("distributed.pipeline_layers: the model splits by tensor "
                                "here; pinned layer counts need sharding: pipeline")
        try:
            stage_layers(layer_count(config), (), pipeline_layers)
        except ValueError as exc:
            raise ShardingError(str(exc)) from exc
    return mode


def layer_count(config: dict[str, Any]) -> int:
    return int(config.get("text_config", config).get("num_hidden_layers", 0))


def _check_divisible(config: dict[str, Any], shards: int, mode: Mode) -> None:
    text = config.get("text_config", config)
    if mode == "pipeline":
        layers = int(text.get("num_hidden_layers", 0))
        if layers < shards:
            raise ShardingError(f"shards: {shards} pipeline stages need at least {shards} "
                                f"layers; the model has {layers}")
        return
    heads = int(text.get("num_attention_heads", 0))
    sizes = {"num_attention_heads": heads,
             "num_key_value_heads": int(text.get("num_key_value_heads") or heads),
             "intermediate_size": int(text.get("intermediate_size") or 0)}
    for name, value in sizes.items():
        if value and value % shards:
            raise ShardingError(f"shards: {shards} does not divide the model's {name} "
                                f"({value}), which tensor parallelism splits evenly")


def join(plan: ShardPlan) -> mx.distributed.Group:
    """Join the group every rank of this replica joins at the same time (blocking)."""
    os.environ["MLX_RANK"] = str(plan.rank)
    if plan.backend == "ring":
        os.environ["MLX_HOSTFILE"] = _file(json.dumps([[a] for a in plan.addresses]))
    else:
        os.environ["MLX_JACCL_COORDINATOR"] = plan.addresses[0]
        os.environ["MLX_IBV_DEVICES"] = _file(json.dumps(plan.rdma_devices))
    group = mx.distributed.init(strict=True, backend=plan.backend)
    if (group.rank(), group.size()) != (plan.rank, plan.size):
        raise RuntimeError(f"joined as rank {group.rank()} of {group.size()}, expected "
                           f"{plan.rank} of {plan.size}")
    return group


def _file(text: str) -> str:
    with tempfile.NamedTemporaryFile("w", prefix="orchard-mlx-", suffix=".json",
                                     delete=False) as f:
        f.write(text)
    return f.name


def open_shard(source: str, resolved: Path | str, plan: ShardPlan, config: EngineConfig,
               held: HeldBlocks | None = None,
               draft: Callable[[LoadedModel], nn.Module | Mtp | None] | None = None
               ) -> tuple[LoadedModel, LocalBatch, mx.distributed.Group, tuple[RankMemory, ...]]:
    """Join the group, load this rank's shard (mlx-lm's `sharded_load`: a pipeline stage
    reads only its layers' files), make its local batch, and fix its memory: every rank
    measures its own KV and sets its own limit, and each learns every rank's. `held`: rank
    0's prefix directory's view of its cache (every rank's cache holds the same entries).
    `draft`: rank 0's draft model for speculation, given the loaded shard (rank 0 alone
    drafts; the others receive its drafts)."""
    with Progress(f"joining {plan.label} of {source} over {plan.backend}"):
        group = join(plan)
    with Progress(f"loading model {source}, {plan.label}, from {resolved}"):
        tensor = group if plan.mode == "tensor" else None
        pipeline = group if plan.mode == "pipeline" else None
        with split_stages(plan.layers):
            model, tokenizer, model_conf = sharded_load(str(resolved), pipeline, tensor,
                                                        return_config=True)
    if plan.layers is not None:
        _check_stage(model, plan.layers, plan)
    loaded = loaded_model(source, resolved, model, tokenizer, model_conf)
    drafts_with = draft(loaded) if draft is not None else None
    most = config.speculative.num_speculative_tokens if config.speculative else 0
    batch = LocalBatch(model, config, _cache_scale(model, model_conf, plan), held=held,
                       shared_drafts=lambda stream: SharedDrafts(group, stream, plan.rank == 0,
                                                                 most), draft=drafts_with)
    # Every rank runs the probe's forward pass (and its collectives) here, together.
    mine = plan_memory(model, config.kv_budget_bytes, plan.label,
                       make_cache=cache_maker(config.kv_bits, config.kv_group_size),
                       draft=drafts_with)
    return loaded, batch, group, share_memory(group, mine, batch.stream)


# Room for one rank's pickled RankMemory in the exchange below.
_MEMORY_SLOT = 1024


def share_memory(group: mx.distributed.Group, mine: RankMemory,
                 stream: mx.Stream) -> tuple[RankMemory, ...]:
    """Every rank's memory, by rank: each writes its pickled record into its own slot of
    a zero buffer and one `all_sum` adds them up (as `lockstep.Channel` sends records)."""
    data = pickle.dumps(mine)
    if len(data) > _MEMORY_SLOT:
        raise RuntimeError(f"a rank's memory record takes {len(data)} bytes")
    slots = np.zeros((group.size(), _MEMORY_SLOT), dtype=np.uint8)
    slots[group.rank(), :len(data)] = np.frombuffer(data, dtype=np.uint8)
    total = mx.distributed.all_sum(mx.array(slots), group=group, stream=stream)
    mx.eval(total)
    # Pickle stops at its own end marker: the zeros after it are never read.
    return tuple(pickle.loads(row.tobytes())  # noqa: S301 - this replica's own ranks
                 for row in np.array(total))


def follow(source: str, resolved: Path | str, plan: ShardPlan, config: EngineConfig,
           wait_for_work: Callable[[], None], parts: KvParts | None = None) -> int:
    """Ranks 1..N-1: load the shard, then replay rank 0's batch until it stops. Returns
    the steps run. `parts`: this rank's parts of KV moving between replicas."""
    faulthandler.enable(all_threads=True)  # a native crash names this rank's threads' stacks
    _, batch, group, _ = open_shard(source, resolved, plan, config)
    follower = Follower(batch, group, wait_for_work, parts)
    follower.run()
    return follower.steps


def _check_stage(model: Any, layers: tuple[int, ...], plan: ShardPlan) -> None:
    """This rank holds what the split gives it: rank r the run after ranks r+1..N-1's."""
    start = sum(layers[plan.rank + 1:])
    expected = (start, start + layers[plan.rank])
    if held_layers(model) != expected:
        raise RuntimeError(f"{plan.label} holds layers {held_layers(model)}, expected "
                           f"{expected} of the split {list(layers)}")


def _cache_scale(model: Any, config: dict[str, Any], plan: ShardPlan) -> tuple[int, int]:
    """Pipeline stages hold different numbers of layers; counting each entry as the
    replica's average per rank makes every stage's cache agree (`PromptCache`)."""
    if plan.mode == "tensor":
        return (1, 1)
    total = int(config.get("text_config", config)["num_hidden_layers"])
    local = model.model.end_idx - model.model.start_idx
    return (total, local * plan.size)
