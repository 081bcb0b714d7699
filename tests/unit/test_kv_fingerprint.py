"""The KV fingerprint knows the weights (issue 59): a fine-tune written with the same config,
tokenizer and shapes is another model, whose disk tier and pulls never see the old KV."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from replicas.engine.kv.disk import DiskTier
from replicas.engine.kv.fingerprint import model_fingerprint
from tests.unit.test_disk_cache import kv, written

_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def checkpoint(directory: Path, seed: int, source: Path) -> Path:
    """A model directory: the same config and tokenizer files, weights drawn from `seed`
    (same names, shapes and dtypes: the same safetensors header)."""
    directory.mkdir()
    for name in _FILES:
        shutil.copy(source / name, directory / name)
    mx.random.seed(seed)
    weights = {f"layers.{i}.weight": mx.random.normal((64, 64)).astype(mx.bfloat16)
               for i in range(8)}
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    return directory


def test_other_weights_with_the_same_config_and_shapes_are_another_model(
        tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (source / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (source / "tokenizer_config.json").write_text("{}")
    model = nn.Linear(4, 4)
    base = checkpoint(tmp_path / "base", 1, source)
    tuned = checkpoint(tmp_path / "tuned", 2, source)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)  # the same weights elsewhere: the same model
    header = (base / "model.safetensors").read_bytes()[:64]
    assert header == (tuned / "model.safetensors").read_bytes()[:64]
    assert (base / "model.safetensors").stat().st_size == \
        (tuned / "model.safetensors").stat().st_size
    old, new = model_fingerprint(base, model), model_fingerprint(tuned, model)
    assert old != new
    assert model_fingerprint(copy, model) == old
    # The old model's KV on disk is not the new one's.
    cache = tmp_path / "kv"
    written(DiskTier(cache, 1 << 30, old), list(range(10)), kv(10))
    assert len(DiskTier(cache, 1 << 30, old)) == 1
    tier = DiskTier(cache, 1 << 30, new)
    assert len(tier) == 0 and tier.lookup(list(range(11))) is None
