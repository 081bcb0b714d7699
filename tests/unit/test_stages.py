"""Pipeline stages sized to the Macs (`replicas.engine.sharded.stages`): the split arithmetic, a
pinned split and its config errors, the load hook on mlx-lm's own pipeline, and the prefix
cache's scale for unequal stages. Real ranks with an unequal split: tests/sharded."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from deployments.app import build_app
from deployments.config import ModelSettings
from replicas.builtin import ensure_builtin
from replicas.engine.config import ShardPlan
from replicas.engine.sharded.rank import ShardingError, _cache_scale, sharding_mode
from replicas.engine.sharded.stages import plan_stages, proportional, split_stages, stage_layers
from replicas.sources import model_config

GIB = 1 << 30


def test_layers_follow_memory() -> None:
    assert proportional(32, [64 * GIB, 192 * GIB]) == (8, 24)
    assert proportional(4, [3 * GIB, 1 * GIB]) == (3, 1)
    assert proportional(10, [1, 1, 1]) == (4, 3, 3)  # the remainder to the lowest rank
    # A small node still gets a layer; the big one gives it up.
    assert proportional(4, [100 * GIB, 1 * GIB, 1 * GIB]) == (2, 1, 1)


@given(st.integers(1, 200).flatmap(lambda total: st.tuples(
    st.just(total), st.lists(st.integers(1, 1 << 40), min_size=1, max_size=min(total, 16)))))
def test_every_rank_holds_a_layer_and_all_layers_are_held(case: tuple[int, list[int]]) -> None:
    total, memories = case
    counts = proportional(total, memories)
    assert sum(counts) == total and min(counts) >= 1 and len(counts) == len(memories)
    # Never off its share by a layer or more, but for the minimum of one.
    for count, memory in zip(counts, memories):
        share = total * memory / sum(memories)
        assert count == 1 or abs(count - share) < 1 + len(memories)


def test_equal_nodes_keep_mlx_lms_split_and_a_pinned_split_wins() -> None:
    assert stage_layers(36, [64 * GIB, 63 * GIB]) is None  # within 5%: mlx-lm's even split
    assert stage_layers(36, [64 * GIB, 192 * GIB]) == (9, 27)
    assert stage_layers(36, [64 * GIB, 192 * GIB], pinned=[20, 16]) == (20, 16)
    with pytest.raises(ValueError, match=r"pipeline_layers \[20, 12\] sums to 32 layers; "
                                         r"the model has 36"):
        stage_layers(36, [1, 1], pinned=[20, 12])
    with pytest.raises(ValueError, match="need at least 3 layers; the model has 2"):
        proportional(2, [1, 2, 3])


def test_tensor_parallel_warns_when_the_nodes_differ(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "replicas.engine.sharded.stages"):
        assert plan_stages("tensor", 36, [64 * GIB, 192 * GIB], None, "m") is None
    assert "the smallest (rank 0) bounds every rank" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "replicas.engine.sharded.stages"):
        plan_stages("tensor", 36, [64 * GIB, 64 * GIB], None, "m")
    assert not caplog.records


def test_a_pinned_split_is_checked_against_the_config_and_the_model() -> None:
    def settings(**distributed: Any) -> ModelSettings:
        return ModelSettings.model_validate({"id": "m", "source": "builtin:pipe", "shards": 2,
                                             "sharding": "pipeline",
                                             "distributed": distributed})

    assert settings(pipeline_layers=[3, 1]).distributed.pipeline_layers == [3, 1]
    with pytest.raises(ValidationError, match="pipeline_layers needs one value per rank"):
        settings(pipeline_layers=[2, 1, 1])
    with pytest.raises(ValidationError, match="node_memory_bytes needs one value per rank"):
        settings(node_memory_bytes=[GIB])
    with pytest.raises(ValidationError):
        settings(pipeline_layers=[4, 0])
    with pytest.raises(ValidationError, match="pipeline_layers needs sharding: pipeline"):
        ModelSettings.model_validate({"id": "m", "source": "s", "shards": 2,
                                      "sharding": "tensor",
                                      "distributed": {"pipeline_layers": [1, 1]}})
    ensure_builtin("pipe")
    config = model_config("builtin:pipe", fetch=False)
    assert config is not None
    assert sharding_mode(config, 2, "pipeline", [3, 1]) == "pipeline"
    with pytest.raises(ShardingError, match="the model splits by tensor here"):
        sharding_mode(config, 2, "auto", [3, 1])  # auto: tensor for qwen2
    args = {"models": [{"id": "pipe-x2", "source": "builtin:pipe", "shards": 2,
                        "sharding": "pipeline", "distributed": {"pipeline_layers": [2, 3]}}]}
    with pytest.raises(ValueError, match=r"model 'pipe-x2': distributed.pipeline_layers "
                                         r"\[2, 3\] sums to 5 layers; the model has 4"):
        build_app(args)


class _Group:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_the_load_hook_hands_the_split_to_mlx_lms_pipeline() -> None:
    """What `sharded_load` does with the model `load_model` gives it, on the built-in
    pipeline model: rank 0 holds the last layers, rank 1 the first."""
    import mlx_lm.utils

    path = ensure_builtin("pipe")
    held = []
    for rank in (0, 1):
        with split_stages([3, 1]):
            model, _ = mlx_lm.utils.load_model(path, lazy=True, strict=False)
            model.model.pipeline(_Group(rank, 2))
        inner = model.model
        held.append((inner.start_idx, inner.end_idx))
        assert sum(layer is not None for layer in inner.layers) == 3 - 2 * rank
    assert held == [(1, 4), (0, 1)]
    assert mlx_lm.utils.load_model.__name__ == "load_model"  # put back
    model, _ = mlx_lm.utils.load_model(path, lazy=True, strict=False)
    model.model.pipeline(_Group(0, 2))
    assert (model.model.start_idx, model.model.end_idx) == (2, 4)  # unhooked: even


@dataclass
class _Stage:
    start_idx: int
    end_idx: int


@dataclass
class _Model:
    model: _Stage


def test_unequal_stages_scale_their_cache_to_the_same_average() -> None:
    config = {"num_hidden_layers": 4}
    plans = [ShardPlan("pipeline", r, 2, "ring", ("a", "b"), layers=(3, 1)) for r in (0, 1)]
    scales = [_cache_scale(_Model(_Stage(1, 4)), config, plans[0]),
              _cache_scale(_Model(_Stage(0, 1)), config, plans[1])]
    # Each rank's entry counts as two layers' worth (4 layers over 2 ranks): 3 x 4/6, 1 x 4/2.
    assert [held * total / local for held, (total, local) in zip((3, 1), scales)] == [2, 2]
