"""LoRA adapters in the config (`deployments.config.ModelSettings.adapters`): the short
`name: path` form and `{path, aliases}`, the names each is served under, and what is
refused at load (a bad name, a clash with another model's name, a sharded or split model)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from deployments.config import AppArgs
from deployments.model_deployment import replica_options


def model(**extra: Any) -> dict[str, Any]:
    return {"id": "m", "source": "builtin:tiny", **extra}


def test_both_forms_reach_the_replica_and_the_names() -> None:
    config = AppArgs.model_validate({"models": [model(adapters={
        "sql": "/a/sql", "poet": {"path": "/a/poet", "aliases": ["bard"]}})]})
    (settings,) = config.models
    assert settings.adapter_names() == ["m:sql", "m:poet", "bard"]
    assert replica_options(settings).adapters == (("sql", "/a/sql"), ("poet", "/a/poet"))


@pytest.mark.parametrize("adapters,models,message", [
    ({"a:b": "/x"}, [], "without ':'"),
    ({"sql": {"path": "/x", "aliases": ["other"]}}, [{"id": "other", "source": "builtin:tiny"}],
     "'other' is used twice"),
    ({"sql": {"path": ""}}, [], "at least 1 character"),
])
def test_refused(adapters: dict[str, Any], models: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate({"models": [model(adapters=adapters), *models]})


def test_only_whole_model_replicas_serve_adapters() -> None:
    with pytest.raises(ValidationError, match="whole-model replicas"):
        AppArgs.model_validate({"models": [model(adapters={"a": "/x"}, shards=2)]})
