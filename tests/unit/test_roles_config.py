"""Prefill and decode roles in the config (`deployments.roles`): entries pair up by id, the
prefill one is a deployment of its own that clients never name, and a lone or mismatched
entry is refused at load with what to fix."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from deployments.app import _model_deployment, build_app
from deployments.config import AppArgs


def pair(**prefill: Any) -> list[dict[str, Any]]:
    return [{"id": "m", "source": "builtin:tiny", "role": "decode", "prefill_min_tokens": 256},
            {"id": "m", "source": "builtin:tiny", "role": "prefill", **prefill}]


def test_a_split_model_is_two_deployments_and_one_name() -> None:
    config = AppArgs.model_validate({"models": pair()})
    assert [m.role for m in config.served_models] == ["decode"]
    assert not config.colocated  # the decode replicas call the prefill ones: two hops
    names = sorted(_model_deployment(m).name for m in config.models)
    assert names == ["model:m", "prefill:m"]
    build_app({"models": pair()})  # binds the prefill deployment into the decode one


def test_a_sharded_model_splits_into_roles_sharded_alike() -> None:
    """KV moves rank to rank between the two, so both hold the same part of each layer."""
    both = {"shards": 2, "sharding": "tensor"}
    models = [{**entry, **both} for entry in pair()]
    config = AppArgs.model_validate({"models": models})
    assert [(m.role, m.shards) for m in config.models] == [("decode", 2), ("prefill", 2)]
    models[1]["sharding"] = "pipeline"
    with pytest.raises(ValidationError, match="`shards` and `sharding`"):
        AppArgs.model_validate({"models": models})


@pytest.mark.parametrize("models,error", [
    (pair()[:1], "has a `role: decode` entry but no `role: prefill` one"),
    (pair()[1:], "has a `role: prefill` entry but no `role: decode` one"),
    (pair(source="builtin:bench"), "need the same `source`"),
    (pair(shards=2), "`shards` and `sharding`"),
    (pair(aliases=["other"]), "aliases go on its decode entry"),
    (pair() + pair()[1:], "two `role: prefill` entries"),
    ([*pair(), {"id": "m", "source": "builtin:tiny"}], "'m' is used twice"),
])
def test_unpaired_or_mismatched_roles_are_refused(models: list[dict[str, Any]],
                                                  error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        AppArgs.model_validate({"models": models})
