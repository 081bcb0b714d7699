"""Which models serve `/v1/embeddings` and how (`replicas.embedding_files`): a checkpoint's
sentence-transformers files as Qwen3-Embedding ships them, and the config's opt-in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from deployments.config import ModelSettings
from replicas.embedding_files import (
    EmbeddingSpec,
    NotEmbedding,
    capabilities,
    embedding_support,
)

NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}


def checkpoint(tmp_path: Path, pooling: dict[str, Any], normalize: bool = True,
               max_seq_length: int | None = 8192) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules + ([NORMALIZE] if normalize else [])))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 1024, **pooling}))
    if max_seq_length is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": max_seq_length, "do_lower_case": False}))
    return tmp_path


# Qwen3-Embedding's 1_Pooling/config.json.
LAST_TOKEN = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
              "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
              "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True,
              "include_prompt": True}
MEAN = {**LAST_TOKEN, "pooling_mode_lasttoken": False, "pooling_mode_mean_tokens": True}


def test_qwen3_embedding_files_say_last_token_normalized(tmp_path: Path) -> None:
    spec = embedding_support(checkpoint(tmp_path, LAST_TOKEN), None)
    assert spec == EmbeddingSpec("last_token", normalize=True, dimensions=False, max_tokens=8192)
    assert capabilities(spec, opted_in=False) == ("embeddings",)


@pytest.mark.parametrize("pooling", [MEAN, {"pooling_mode": "mean"}])
def test_mean_pooling_without_normalize(tmp_path: Path, pooling: dict[str, Any]) -> None:
    spec = embedding_support(checkpoint(tmp_path, pooling, normalize=False,
                                        max_seq_length=None), None, dimensions=True)
    assert spec == EmbeddingSpec("mean", normalize=False, dimensions=True, max_tokens=None)


def test_cls_pooling_is_read_from_the_files(tmp_path: Path) -> None:
    cls = {**LAST_TOKEN, "pooling_mode_lasttoken": False, "pooling_mode_cls_token": True}
    spec = embedding_support(checkpoint(tmp_path, cls), None)
    assert isinstance(spec, EmbeddingSpec) and spec.pooling == "cls"


@pytest.mark.parametrize("pooling", [
    {**LAST_TOKEN, "pooling_mode_lasttoken": False, "pooling_mode_max_tokens": True},
    {**MEAN, "pooling_mode_max_tokens": True},  # two modes: sentence-transformers concatenates
    {"pooling_mode": "weightedmean"},
])
def test_a_pooling_orchard_does_not_compute_is_named(tmp_path: Path,
                                                     pooling: dict[str, Any]) -> None:
    spec = embedding_support(checkpoint(tmp_path, pooling), None)
    assert isinstance(spec, NotEmbedding) and "pooling" in spec.reason
    assert capabilities(spec, opted_in=False) == ("text",)
    # ... and the config may still choose one of its own.
    chosen = embedding_support(tmp_path, "mean")
    assert chosen == EmbeddingSpec("mean", normalize=True, dimensions=False, max_tokens=8192)


def test_a_chat_model_serves_embeddings_only_when_its_config_opts_in(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    refused = embedding_support(tmp_path, None)
    assert isinstance(refused, NotEmbedding) and "embeddings: last_token" in refused.reason
    assert embedding_support(None, None) == refused  # not on disk: the same answer
    opted = embedding_support(tmp_path, "last_token")
    assert opted == EmbeddingSpec("last_token", normalize=True, dimensions=False,
                                  max_tokens=None)
    assert capabilities(opted, opted_in=True) == ("text", "embeddings")


def test_the_config_overrides_the_files_pooling(tmp_path: Path) -> None:
    spec = embedding_support(checkpoint(tmp_path, LAST_TOKEN, normalize=False), "mean")
    assert spec == EmbeddingSpec("mean", normalize=False, dimensions=False, max_tokens=8192)


def test_broken_files_are_no_embedding_files(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text("{not json")
    assert isinstance(embedding_support(tmp_path, None), NotEmbedding)


def test_the_config_names_only_poolings_it_computes() -> None:
    settings = ModelSettings(id="m", source="builtin:tiny", embeddings="mean",
                             embedding_dimensions=True)
    assert settings.embeddings == "mean" and settings.embedding_dimensions
    with pytest.raises(ValidationError, match="embeddings"):
        ModelSettings(id="m", source="builtin:tiny", embeddings="max")  # type: ignore[arg-type]
