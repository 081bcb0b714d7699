"""builtin:tiny's shipped weights: an empty cache builds from them and trains nothing; the
choice between them and training, in isolation; and the two ways back to training (weights
made for another build, weights that fail verification), with training itself stubbed out."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from replicas.builtin import build as build_module
from replicas.builtin import ensure_builtin, load_scripts
from replicas.builtin import shipped as shipped_module
from replicas.builtin.build import ensure_recipe
from replicas.builtin.recipe import TINY
from replicas.builtin.scripts import renderings
from replicas.builtin.shipped import Shipped, choose, find_shipped, fingerprint, read_arrays
from replicas.builtin.train import BuildError, Example


class Trained(Exception):
    """Raised by the stubbed `train`: the build chose to train."""


def _no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def train(*_: object) -> None:
        raise Trained

    monkeypatch.setattr(build_module, "train", train)


def test_an_empty_cache_builds_tiny_from_the_shipped_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_training(monkeypatch)
    path = ensure_builtin("tiny", cache_dir=tmp_path)
    info = json.loads((path / "build_info.json").read_text())
    shipped = find_shipped("tiny")
    assert shipped is not None
    assert info["weights"]["source"] == "shipped"
    assert info["weights"]["fingerprint"] == shipped.fingerprint
    assert "training" not in info
    # The full verification ran: every script in every rendering, decoded alone and in
    # one batch.
    assert info["verified_scripts"] == [r.label for r in renderings(load_scripts())]
    assert {s.id for s in load_scripts()} < set(info["verified_scripts"])
    # The output keeps the per-layer layout: one file per decoder layer, one for the rest.
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == TINY.architecture.num_hidden_layers + 1
    assert info["parameters"] == sum(v.size for v in read_arrays(shipped.weights_file).values())


def _shipped(fp: str) -> Shipped:
    return Shipped(Path("tiny.safetensors"), fp, {"fingerprint": fp})


def test_choose_uses_shipped_weights_only_for_the_same_fingerprint() -> None:
    assert choose("a" * 64, _shipped("a" * 64)).use == _shipped("a" * 64)
    missing = choose("a" * 64, None)
    assert missing.use is None and "no shipped weights" in missing.reason
    other = choose("a" * 64, _shipped("b" * 64))
    assert other.use is None
    assert "b" * 12 in other.reason and "a" * 12 in other.reason
    assert "--refresh-shipped" in other.reason


def test_the_fingerprint_follows_recipe_vocabulary_and_examples() -> None:
    vocab = {"a": 0, "b": 1}
    examples = [Example("hello", (0, 1), (1, 0))]
    base = fingerprint(TINY, vocab, examples)
    assert base == fingerprint(TINY, dict(reversed(vocab.items())), list(examples))
    assert fingerprint(replace(TINY, seed=TINY.seed + 1), vocab, examples) != base
    assert fingerprint(TINY, {"a": 1, "b": 0}, examples) != base
    assert fingerprint(TINY, vocab, [Example("hello", (0, 1), (1, 1, 0))]) != base
    assert fingerprint(TINY, vocab, [Example("hello", (0,), (1, 1, 0))]) != base


def _ship(directory: Path, fp: str | None, zero: bool = False) -> None:
    """Copy the real shipped weights into `directory`, with another fingerprint or zeroed."""
    real = find_shipped("tiny")
    assert real is not None
    directory.mkdir()
    if zero:
        weights = {k: mx.zeros_like(v) for k, v in read_arrays(real.weights_file).items()}
        mx.save_safetensors(str(directory / "tiny.safetensors"), weights)
    else:
        shutil.copy(real.weights_file, directory / "tiny.safetensors")
    record = {**real.record, "fingerprint": fp or real.fingerprint}
    (directory / "tiny.json").write_text(json.dumps(record))


def test_weights_made_for_another_build_are_not_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    _ship(tmp_path / "shipped", "0" * 64)
    monkeypatch.setattr(shipped_module, "SHIPPED_DIR", tmp_path / "shipped")
    _no_training(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=build_module.__name__), \
            pytest.raises(Trained):
        ensure_recipe(TINY, tmp_path / "cache")
    assert "trained for another recipe, tokenizer or scripts" in caplog.text


def test_weights_that_fail_verification_fall_back_to_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # The right fingerprint but wrong numbers, as if a new MLX had moved the numerics.
    _ship(tmp_path / "shipped", None, zero=True)
    monkeypatch.setattr(shipped_module, "SHIPPED_DIR", tmp_path / "shipped")
    _no_training(monkeypatch)
    checked: list[Path] = []

    def verify(path: Path, examples: object) -> None:
        # The real check would decode every script to its length limit (~20 s on 2 cores);
        # its verdict on wrong weights is what matters here, and the weights it saw.
        checked.append(path)
        weights = {k: v for f in path.glob("model-*.safetensors") for k, v in read_arrays(f).items()}
        assert weights and all(not mx.any(v).item() for v in weights.values())
        raise BuildError("built model does not reproduce its scripts:\nhello (single): ...")

    monkeypatch.setattr(build_module, "verify_model_dir", verify)
    with caplog.at_level(logging.WARNING, logger=build_module.__name__), \
            pytest.raises(Trained):
        ensure_recipe(TINY, tmp_path / "cache")
    assert len(checked) == 1
    assert "the shipped weights failed their check" in caplog.text
    assert "does not reproduce its scripts" in caplog.text
