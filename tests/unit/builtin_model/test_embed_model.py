"""`builtin:embed`: built into a private cache, it is the embedding checkpoint its README
says: Qwen3-Embedding's sentence-transformers files, found by Orchard's own detection, a
tokenizer that appends the pooled token, and weights the production loader loads."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from replicas.builtin import BUILTIN_NAMES, ensure_builtin
from replicas.builtin.embed_model import EMBED, MAX_SEQ_LENGTH
from replicas.builtin.tokenizer_files import PAD_TOKEN
from replicas.embedding_files import EmbeddingSpec, embedding_support
from replicas.engine.model.embedding import PoolingSpec, embed_rows
from replicas.engine.model.loading import load_model


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin("embed", tmp_path_factory.mktemp("cache"))


def test_its_name_is_listed() -> None:
    assert "embed" in BUILTIN_NAMES


def test_its_files_say_last_token_pooling_normalized(built: Path) -> None:
    modules = json.loads((built / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling",
                                                               "Normalize"]
    assert embedding_support(built, None) == EmbeddingSpec(
        "last_token", normalize=True, dimensions=False, max_tokens=MAX_SEQ_LENGTH)
    pooling = json.loads((built / "1_Pooling" / "config.json").read_text())
    assert pooling["word_embedding_dimension"] == EMBED.architecture.hidden_size


def test_it_loads_and_its_tokenizer_appends_the_pooled_token(built: Path) -> None:
    loaded = load_model("builtin:embed", built)
    hf = loaded.hf_tokenizer
    eos = hf.convert_tokens_to_ids(PAD_TOKEN)
    with_special = hf.encode("hello there", add_special_tokens=True)
    assert with_special[-1] == eos
    assert with_special[:-1] == hf.encode("hello there", add_special_tokens=False)
    vectors = embed_rows(loaded.model, [with_special, [eos]], PoolingSpec("last_token", True))
    assert [len(v) for v in vectors] == [EMBED.architecture.hidden_size] * 2
    norms = [float(mx.linalg.norm(mx.array(v)).item()) for v in vectors]
    assert all(abs(n - 1) < 1e-5 for n in norms)
    assert vectors[0] != vectors[1]  # random weights still tell inputs apart


def test_the_build_is_cached(built: Path) -> None:
    assert ensure_builtin("embed", built.parent) == built
