"""Pipeline stages sized to the Macs: how many layers each rank of a `sharding: pipeline`
replica holds, and loading a rank's shard with that split.

mlx-lm splits a pipeline evenly (`PipelineMixin.pipeline`), so a 64 GB and a 192 GB Mac
would each hold half the layers and the small one bounds the model. Here the layers go in
proportion to each node's memory for the model (weights + KV), or as
`distributed.pipeline_layers` pins them. Counts are per rank, rank 0 first, in mlx-lm's
order: rank 0 runs the LAST layers, the highest rank the first ones.
"""

from __future__ import annotations

import functools
import inspect
import logging
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from replicas.engine.config import Mode

log = logging.getLogger(__name__)

# Node memories within this share of the largest count as equal: mlx-lm's own split then,
# which also knows a model's own constraints (layer groups that must stay together).
EVEN_WITHIN = 0.05


def spread(memories: Sequence[int]) -> float:
    """How far the smallest memory is below the largest, as a share of the largest."""
    return (max(memories) - min(memories)) / max(memories)


def proportional(total: int, memories: Sequence[int]) -> tuple[int, ...]:
    """`total` layers over the ranks in proportion to `memories`: every rank at least one,
    the sum exactly `total` (largest remainder)."""
    if len(memories) > total:
        raise ValueError(f"{len(memories)} pipeline stages need at least {len(memories)} "
                         f"layers; the model has {total}")
    if min(memories) <= 0:
        raise ValueError(f"node memories must be positive (got {list(memories)})")
    ideal = [total * m / sum(memories) for m in memories]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) < total:  # the rank furthest below its share gets the next layer
        counts[max(range(len(counts)), key=lambda r: ideal[r] - counts[r])] += 1
    while sum(counts) > total:  # the minimum of one took too many: the furthest above gives
        counts[max((r for r in range(len(counts)) if counts[r] > 1),
                   key=lambda r: counts[r] - ideal[r])] -= 1
    return tuple(counts)


def stage_layers(total: int, memories: Sequence[int],
                 pinned: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """Layers per rank (rank 0 first) for a pipeline of `total` layers; None: the nodes'
    memories are equal, mlx-lm's even split. `pinned` (`distributed.pipeline_layers`, its
    length and positivity checked by the config) must sum to `total`."""
    if pinned is not None:
        if sum(pinned) != total:
            raise ValueError(f"distributed.pipeline_layers {list(pinned)} sums to "
                             f"{sum(pinned)} layers; the model has {total}")
        return tuple(pinned)
    if spread(memories) <= EVEN_WITHIN:
        return None
    return proportional(total, memories)


def plan_stages(mode: Mode, total: int, memories: Sequence[int],
                pinned: Sequence[int] | None, model: str) -> tuple[int, ...] | None:
    """`stage_layers` for a pipeline, logged; under tensor parallel (equal shares by
    construction) a warning when the nodes differ, since the smallest bounds every rank."""
    gib = ", ".join(f"{m / 2**30:.1f}" for m in memories)
    if mode == "tensor":
        if spread(memories) > EVEN_WITHIN:
            small = min(range(len(memories)), key=lambda r: memories[r])
            log.warning("model %s: tensor parallel gives every rank an equal share, but the "
                        "nodes' memory differs (%s GiB by rank): the smallest (rank %d) "
                        "bounds every rank; `sharding: pipeline` sizes stages to each node",
                        model, gib, small)
        return None
    split = stage_layers(total, memories, pinned)
    log.info("model %s: pipeline of %d layers over nodes of %s GiB: %s (rank 0 first; "
             "rank 0 runs the last layers)", model, total, gib,
             "mlx-lm's even split" if split is None else f"{list(split)} layers")
    return split


@contextmanager
def split_stages(split: Sequence[int] | None) -> Iterator[None]:
    """Around mlx-lm's `sharded_load`: its `model.model.pipeline(group)` calls get `split`.

    mlx-lm's `pipeline` takes a split, but `sharded_load` (which also picks the weight
    files a stage reads from the split) passes none and builds the model itself; so its
    `load_model` is wrapped for the call, rather than `sharded_load` copied. One load at a
    time per process (a replica or shard loads one model)."""
    if split is None:
        yield
        return
    import mlx_lm.utils  # here: the split arithmetic above needs no MLX

    original = mlx_lm.utils.load_model

    def load_model(*args: Any, **kwargs: Any) -> Any:
        model, config = original(*args, **kwargs)
        pipeline = model.model.pipeline
        if "split" not in inspect.signature(pipeline).parameters:
            raise ValueError(f"mlx-lm's {type(model.model).__name__} takes no pipeline "
                             "split: give its nodes equal memory or unset "
                             "distributed.pipeline_layers")
        model.model.pipeline = functools.partial(pipeline, split=list(split))
        return model, config

    mlx_lm.utils.load_model = load_model
    try:
        yield
    finally:
        mlx_lm.utils.load_model = original


def held_layers(model: Any) -> tuple[int, int]:
    """The [start, end) of the layers this pipeline stage holds."""
    inner = model.model
    return int(inner.start_idx), int(inner.end_idx)
