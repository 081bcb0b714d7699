"""`shards` / `sharding` values: checked against the architecture at deploy, each error
naming its field; and the lockstep pieces that need no second process."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from pydantic import ValidationError

from deployments.app import build_app
from deployments.config import AppArgs, ModelSettings
from deployments.model_deployment import replica_options
from replicas.engine.batch.rows import Done
from replicas.engine.config import SpeculativeConfig
from replicas.builtin import ensure_builtin
from replicas.engine.sharded.lockstep import _Finish, _Insert, _RowSpec
from replicas.engine.sharded.rank import ShardingError, sharding_mode
from replicas.sources import model_config


@pytest.fixture(scope="module")
def tiny_config() -> dict[str, Any]:
    ensure_builtin("tiny")
    config = model_config("builtin:tiny", fetch=False)
    assert config is not None
    return config


@pytest.fixture(scope="module")
def pipe_config() -> dict[str, Any]:
    config = model_config("builtin:pipe", fetch=False)
    assert config is not None
    return config


def test_auto_is_tensor_where_mlx_lm_can_shard(tiny_config: dict[str, Any],
                                               pipe_config: dict[str, Any]) -> None:
    assert sharding_mode(tiny_config, 2) == "tensor"  # qwen3: shard() only
    assert sharding_mode(pipe_config, 2) == "tensor"  # qwen2: both, tensor first
    assert sharding_mode(pipe_config, 2, "pipeline") == "pipeline"
    assert sharding_mode(pipe_config, 4, "pipeline") == "pipeline"  # one layer a stage


@pytest.mark.parametrize("shards,sharding,field,words", [
    (3, "auto", "shards: 3", "num_attention_heads (4)"),  # 4 heads do not split 3 ways
    (4, "tensor", "shards: 4", "num_key_value_heads (2)"),  # 2 kv heads do not split 4 ways
    (2, "pipeline", "sharding: pipeline", "cannot split a qwen3 model"),
])
def test_what_the_architecture_cannot_split_names_the_field(
        tiny_config: dict[str, Any], shards: int, sharding: str, field: str,
        words: str) -> None:
    with pytest.raises(ShardingError) as err:
        sharding_mode(tiny_config, shards, sharding)
    assert str(err.value).startswith(field) and words in str(err.value)


def test_more_stages_than_layers(pipe_config: dict[str, Any]) -> None:
    with pytest.raises(ShardingError, match=r"^shards: 5 pipeline stages need at least 5 "
                                            r"layers; the model has 4"):
        sharding_mode(pipe_config, 5, "pipeline")


def test_an_architecture_with_neither_split() -> None:
    config = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8, "vocab_size": 16,
              "n_positions": 16}
    with pytest.raises(ShardingError, match="neither by tensor nor by pipeline"):
        sharding_mode(config, 2)


def test_build_app_refuses_a_bad_shards_value_naming_model_and_field() -> None:
    args = {"models": [{"id": "tiny-x3", "source": "builtin:tiny", "shards": 3}]}
    with pytest.raises(ValueError, match=r"model 'tiny-x3': shards: 3 does not divide"):
        build_app(args)


@pytest.mark.parametrize("value", [0, -1, "two"])
def test_shards_must_be_a_positive_count(value: object) -> None:
    with pytest.raises(ValidationError) as err:
        ModelSettings.model_validate({"id": "m", "source": "builtin:tiny", "shards": value})
    assert err.value.errors()[0]["loc"] == ("shards",)


def test_jaccl_needs_the_rdma_matrix() -> None:
    with pytest.raises(ValidationError, match="distributed.rdma_devices must be a 2 x 2"):
        ModelSettings.model_validate({"id": "m", "source": "s", "shards": 2,
                                      "distributed": {"backend": "jaccl"}})
    ok = ModelSettings.model_validate({
        "id": "m", "source": "s", "shards": 2, "distributed": {
            "backend": "jaccl", "rdma_devices": [[None, "rdma_en3"], ["rdma_en3", None]]}})
    assert ok.distributed.rdma_devices == [[None, "rdma_en3"], ["rdma_en3", None]]


def test_placement_spreads_pinned_shards_one_per_node() -> None:
    pinned = AppArgs.model_validate({
        "cluster": {"placement": {"pin": True}},
        "models": [{"id": "m", "source": "s", "shards": 2}]})
    model = pinned.models[0].with_placement(pinned.cluster.placement)
    assert model.placement_strategy == "STRICT_SPREAD"
    loose = ModelSettings.model_validate({"id": "m", "source": "s", "shards": 2})
    assert loose.placement_strategy == "PACK"


def test_a_batch_record_survives_the_wire() -> None:
    # What rank 0 sends before a step is plain data: pickled, it comes back equal.
    ops = [_Insert((_RowSpec((1, 2, 3), 2, 16, frozenset({0}), 7, 1),)),
           _Finish((Done(4, keep=True),))]
    assert pickle.loads(pickle.dumps(ops)) == ops


@pytest.mark.parametrize("field, says", [
    ({"kind": "vision"}, "kind: vision needs shards: 1"),
    ({"prompt_cache": {"disk_path": "auto"}}, "prompt_cache.disk_path needs shards: 1"),
])
def test_what_a_sharded_replica_cannot_take_is_a_config_error(field: dict[str, Any],
                                                              says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        ModelSettings.model_validate({"id": "m", "source": "builtin:tiny", "shards": 2,
                                      **field})
    ModelSettings.model_validate({"id": "m", "source": "builtin:tiny", **field})  # 1: fine


def test_speculation_and_kv_bits_settings_reach_the_engine() -> None:
    model = ModelSettings.model_validate({
        "id": "m", "source": "builtin:tiny", "engine": {"kv_bits": 8, "kv_group_size": 32},
        "speculative": {"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                        "disable_by_batch_size": 8}})
    engine = replica_options(model).engine
    assert (engine.kv_bits, engine.kv_group_size) == (8, 32)
    assert engine.speculative == SpeculativeConfig(3, 4, 1, 8)
    assert replica_options(ModelSettings.model_validate(
        {"id": "m", "source": "s"})).engine.speculative is None
    drafted = replica_options(ModelSettings.model_validate({
        "id": "m", "source": "builtin:bench",
        "speculative": {"method": "draft", "draft_model": "builtin:tiny"}})).engine
    assert drafted.speculative is not None
    assert drafted.speculative.draft_model == "builtin:tiny"
    mtp = replica_options(ModelSettings.model_validate({
        "id": "m", "source": "builtin:mtp", "speculative": {"method": "mtp"}})).engine
    assert mtp.speculative is not None and mtp.speculative.mtp
    assert (mtp.speculative.method, mtp.speculative.draft_model) == ("mtp", None)
    # A quantized cache has a disk tier too (stored as mlx-lm's QuantizedKVCache).
    disk = replica_options(ModelSettings.model_validate({
        "id": "m", "source": "builtin:tiny", "engine": {"kv_bits": 4},
        "prompt_cache": {"disk_path": "/tmp/orchard-kv"}})).engine
    assert (disk.kv_bits, disk.disk_cache_dir) == (4, "/tmp/orchard-kv")


@pytest.mark.parametrize("field, says", [
    ({"engine": {"kv_bits": 3}}, "kv_bits"),
    ({"speculative": {"method": "draft"}}, "draft_model goes with method: draft"),
    ({"speculative": {"draft_model": "builtin:tiny"}}, "draft_model goes with method: draft"),
    ({"speculative": {"method": "mtp", "draft_model": "builtin:tiny"}},
     "draft_model goes with method: draft"),
    ({"speculative": {"method": "eagle"}}, "method"),
    ({"speculative": {"prompt_lookup_min": 5}}, "prompt_lookup_min must be <="),
    ({"speculative": {"num_speculative_tokens": 0}}, "num_speculative_tokens"),
])
def test_bad_speculation_and_kv_bits_settings_are_config_errors(field: dict[str, Any],
                                                                says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        ModelSettings.model_validate({"id": "m", "source": "builtin:tiny", **field})
