"""The built-in models' recipes and build cache: cache keys, names, dtypes, concurrent and
failed builds (no training here)."""

from __future__ import annotations

import json
import logging
import multiprocessing
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest

from replicas.builtin import BUILTIN_NAMES, ensure_builtin
from replicas.builtin import build as build_module
from replicas.builtin.build import default_cache_root, ensure_recipe
from replicas.builtin.recipe import BENCH, TINY, Architecture, RandomInit, Recipe, cache_key
from replicas.builtin.scripts import Script, scripts_text

# A random-weights recipe small enough to build in about a second.
SMALL = Recipe(
    name="small-test",
    architecture=Architecture(
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    weights=RandomInit(logit_std=5.0),
    seed=7,
)


def test_cache_key_follows_the_recipe_and_the_scripts() -> None:
    text = scripts_text()
    key = cache_key(TINY, text)
    assert key.startswith("tiny-") and key == cache_key(TINY, text)
    edited = text.replace("Mexico City", "Mexico  City", 1)
    assert edited != text and cache_key(TINY, edited) != key
    assert cache_key(replace(TINY, seed=TINY.seed + 1), text) != key
    assert cache_key(BENCH, text) != key


def test_builtin_names_and_unknown_name() -> None:
    assert {"tiny", "bench"} <= set(BUILTIN_NAMES)
    with pytest.raises(ValueError, match="tiny") as err:
        ensure_builtin("nope")
    assert "bench" in str(err.value)


def test_random_weights_need_an_untied_head() -> None:
    with pytest.raises(ValueError, match="untied"):
        replace(SMALL, architecture=replace(SMALL.architecture, tie_word_embeddings=True))


def test_unknown_weight_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        replace(SMALL, dtype="float8")


def test_weights_are_saved_in_the_recipe_dtype(tmp_path: Path) -> None:
    # bench ships in bfloat16, as released MLX checkpoints do; tiny stays in float32.
    assert (BENCH.dtype, TINY.dtype) == ("bfloat16", "float32")
    built = ensure_recipe(replace(SMALL, dtype="bfloat16"), tmp_path)
    weights = {k: v for f in built.glob("model-*.safetensors") for k, v in mx.load(str(f)).items()}
    assert weights and {w.dtype for w in weights.values()} == {mx.bfloat16}
    assert json.loads((built / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, _ = mlx_lm.load(str(built))
    assert model.lm_head.weight.dtype == mx.bfloat16


def test_default_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORCHARD_CACHE_DIR", str(tmp_path))
    assert default_cache_root() == tmp_path / "builtin"
    monkeypatch.delenv("ORCHARD_CACHE_DIR")
    assert default_cache_root() == Path.home() / ".cache" / "orchard" / "builtin"


def _ensure_small_in_step(cache_dir: str, barrier: Any, results: Any) -> None:
    """Child process: wait for the sibling, then race it; report the path and
    whether this process was the one that built."""
    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    build_log = logging.getLogger(build_module.__name__)
    build_log.setLevel(logging.INFO)
    build_log.addHandler(Capture())
    barrier.wait()
    path = ensure_recipe(SMALL, Path(cache_dir))
    results.put((str(path), any(m.startswith("building") for m in messages)))


def test_concurrent_builds_make_one_directory(tmp_path: Path) -> None:
    # Separate processes, as with several Ray replicas on one machine.
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    workers = [
        ctx.Process(target=_ensure_small_in_step, args=(str(tmp_path), barrier, results))
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=30)
        assert w.exitcode == 0
    paths = {path for path, _ in outcomes}
    assert len(paths) == 1
    assert sorted(built for _, built in outcomes) == [False, True]
    built_dir = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [built_dir.name]
    assert not list(tmp_path.glob(".*.tmp-*"))
    info = json.loads((built_dir / "build_info.json").read_text())
    assert info["name"] == "small-test" and info["cache_key"] == built_dir.name
    model, tokenizer = mlx_lm.load(str(built_dir))
    assert model.args.model_type == "qwen3"
    assert tokenizer.eos_token == "<|im_end|>"
    # A later call reuses the directory without rebuilding.
    mtime = (built_dir / "model.safetensors.index.json").stat().st_mtime_ns
    assert ensure_recipe(SMALL, tmp_path) == built_dir
    assert (built_dir / "model.safetensors.index.json").stat().st_mtime_ns == mtime


def test_weights_are_split_by_layer_with_an_index(tmp_path: Path) -> None:
    # As a sharded checkpoint: a pipeline stage reads only its own layers' files.
    built = ensure_recipe(replace(SMALL, name="small-qwen2", architecture=replace(
        SMALL.architecture, model_type="qwen2")), tmp_path)
    index = json.loads((built / "model.safetensors.index.json").read_text())["weight_map"]
    layers = SMALL.architecture.num_hidden_layers
    files = {f for f in index.values()}
    assert len(files) == layers + 1  # one per layer, one for embeddings, norm and head
    for name, filename in index.items():
        assert name in mx.load(str(built / filename))
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            assert all(filename == f for n, f in index.items() if f".layers.{layer}." in n)
    model, _ = mlx_lm.load(str(built))
    assert model.args.model_type == "qwen2"


def test_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(recipe: Recipe, scripts: list[Script], out_dir: Path, key: str) -> None:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(build_module, "build", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_recipe(SMALL, tmp_path)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
