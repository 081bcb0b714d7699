"""Make a built-in model directory from a recipe, and keep built ones in a cache.

A directory holds exactly what a downloaded Qwen3 checkpoint would (config.json,
generation_config.json, model-*-of-*.safetensors with their index, tokenizer.json, tokenizer_config.json)
plus build_info.json describing how it was made, the weights' origin included: shipped in
the package (see shipped.py), trained (and why), or drawn at random.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import logging
import os
import platform
import re
import sys
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import load_tokenizer

from replicas.engine.model.mtp import NextN, file_key
from ..startup import Progress
from .recipe import RandomInit, Recipe, Training, cache_key
from .scripts import Script, parse_scripts, renderings, scripts_text
from .shipped import Choice, ShippedMismatch, choose, find_shipped, fingerprint, load_weights, \
    read_arrays, write_shipped
from .tokenizer_files import (
    PAD_TOKEN,
    PLAIN_ADDED_TOKENS,
    SPECIAL_TOKENS,
    completion_ids,
    prompt_ids,
    token_id,
    train_tokenizer,
    training_texts,
    write_json,
    write_tokenizer_files,
)
from .train import BuildError, Example, train
from .verify import verify_model_dir

log = logging.getLogger(__name__)

BUILD_INFO = "build_info.json"


def orchard_cache(name: str) -> Path:
    """`$ORCHARD_CACHE_DIR/NAME`, else `~/.cache/orchard/NAME`: where built things live."""
    root = os.environ.get("ORCHARD_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "orchard") / name


def default_cache_root() -> Path:
    """`$ORCHARD_CACHE_DIR/builtin`, else `~/.cache/orchard/builtin`."""
    return orchard_cache("builtin")


def cached_build(root: Path, key: str, make: Callable[[Path], object]) -> Path:
    """`root/key`, made first by `make(directory)` if it is missing.

    Safe across processes: one builder holds an flock per cache key and builds into a
    temporary directory that is renamed into place, so a directory under its final
    name is always complete and the others just wait and reuse it.
    """
    final = root / key
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():
            return final
        # Holding the lock, any temporary directory for this key is a crashed build's.
        for stale in root.glob(f".{key}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
            make(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def ensure_recipe(recipe: Recipe, cache_dir: Path | None = None) -> Path:
    """The cached directory for `recipe`, built first if missing (see `cached_build`)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    text = scripts_text()
    key = cache_key(recipe, text)
    # Rough times from this package's README: a random-weight model is only written out,
    # shipped weights are written and verified; training is the slow path.
    expected = "a few seconds" if isinstance(recipe.weights, RandomInit) else \
        "a few seconds with the weights shipped in the package; if those fail their check, " \
        "training takes a few minutes on an Apple Silicon Mac, 5-12 minutes on a 2-core box"
    what = f"building the built-in model builtin:{recipe.name}"

    def make(tmp: Path) -> object:
        with Progress(what, f"once (cached in {root}), {expected}"):
            return build(recipe, parse_scripts(text), tmp, key)

    return cached_build(root, key, make)


def ensure_scripted(name: str, recipe: Recipe, salt: str,
                    builder: Callable[[Path, str, str], object],
                    cache_dir: Path | None = None, expected: str = "a few seconds") -> Path:
    """`builtin:<name>`'s cached directory, built first if missing by
    `builder(directory, scripts, key)`: the models made beside a recipe's own build (vision,
    rerank, encoders), keyed by `recipe`, the scripts and `salt` (what else shapes them)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    text = scripts_text()
    key = cache_key(recipe, text + salt)

    def make(tmp: Path) -> None:
        with Progress(f"building the built-in model builtin:{name}",
                      f"once (cached in {root}), {expected}"):
            builder(tmp, text, key)

    return cached_build(root, key, make)


def refresh_shipped(recipe: Recipe) -> Path:
    """Train `recipe` from scratch, ignoring the shipped weights, and ship the result in
    their place (`python -m replicas.builtin tiny --refresh-shipped`); returns the file."""
    if not isinstance(recipe.weights, Training):
        raise ValueError(f"builtin:{recipe.name} has random weights: nothing to ship")
    text = scripts_text()
    with tempfile.TemporaryDirectory() as tmp, \
            Progress(f"training builtin:{recipe.name} to ship its weights", "minutes"):
        info = build(recipe, parse_scripts(text), Path(tmp), cache_key(recipe, text),
                     use_shipped=False)
        weights = {}
        for part in sorted(Path(tmp).glob("model-*.safetensors")):
            weights.update(read_arrays(part))
    # What made them, for reading when they fail verification somewhere else.
    record = {
        "fingerprint": info["weights"]["fingerprint"],
        "training": info["training"],
        "parameters": info["parameters"],
        "made_with": {**{name: version(name) for name in ("mlx", "mlx-lm", "tokenizers")},
                      "platform": f"{sys.platform}-{platform.machine()}"},
    }
    return write_shipped(recipe.name, weights, record)


def build(recipe: Recipe, scripts: Sequence[Script], out_dir: Path, key: str,
          use_shipped: bool = True) -> dict[str, Any]:
    """Write a complete model directory into `out_dir`; returns its build info.

    A trained recipe takes the weights shipped for it when they were made for exactly this
    recipe, tokenizer and scripts and the written directory passes verification; else it
    trains, logging why. `use_shipped=False` always trains.
    """
    start = time.perf_counter()
    log.info("building builtin:%s into %s", recipe.name, out_dir)
    tokenizer = train_tokenizer(training_texts(scripts), recipe.max_vocab, recipe.min_frequency)
    arch = recipe.architecture
    eos_id = write_tokenizer_files(tokenizer, out_dir, arch.max_position_embeddings)
    pad_id = token_id(tokenizer, PAD_TOKEN)
    vocab_size = tokenizer.get_vocab_size()
    config = arch.config(vocab_size, eos_id, pad_id, recipe.dtype)
    write_json(out_dir / "config.json", config)
    write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": pad_id, "eos_token_id": [eos_id], "pad_token_id": pad_id},
    )

    mx.random.seed(recipe.seed)
    module = importlib.import_module(f"mlx_lm.models.{arch.model_type}")
    info: dict[str, Any] = {"name": recipe.name, "cache_key": key, "vocab_size": vocab_size}
    examples: list[Example] = []
    weights: dict[str, mx.array] | None = None
    if isinstance(recipe.weights, RandomInit):
        added = [token_id(tokenizer, t) for t in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS]
        model = _random_model(module, config, recipe.weights, added)
        info["weights"] = {"source": "random", "seed": recipe.seed}
    else:
        model = module.Model(module.ModelArgs.from_dict(config))
        examples = _examples(out_dir, scripts, eos_id)
        expected = fingerprint(recipe, tokenizer.get_vocab(with_added_tokens=True), examples)
        choice = choose(expected, find_shipped(recipe.name)) if use_shipped \
            else Choice(None, "asked to train (use_shipped=False)")
        weights, reason = _verified_shipped(choice, model, recipe, out_dir, examples)
        if weights is not None:
            info["weights"] = {"source": "shipped", "fingerprint": expected,
                               "shipped_training": choice.use.record.get("training")
                               if choice.use else None}
        else:
            if use_shipped:
                log.warning("builtin:%s: training instead of using shipped weights: %s",
                            recipe.name, reason)
            report = train(model, examples, pad_id, recipe.weights)
            info["weights"] = {"source": "trained", "reason": reason, "fingerprint": expected}
            info["training"] = {
                "steps": report.steps,
                "seconds": round(report.seconds, 2),
                "final_loss": report.loss,
                "min_margin": round(report.min_margin, 3),
            }
    if weights is None:  # random or freshly trained: save, then check as production loads
        model.set_dtype(getattr(mx, recipe.dtype))
        weights = dict(tree_flatten(model.parameters()))
        save_by_layer(out_dir, weights)
        if isinstance(recipe.weights, RandomInit) and recipe.weights.mtp:
            save_mtp(out_dir, mtp_weights(model, recipe.weights.mtp))
        verify_model_dir(out_dir, examples)
    info["parameters"] = sum(w.size for w in weights.values())
    info["verified_scripts"] = [e.script_id for e in examples]
    info["build_seconds"] = round(time.perf_counter() - start, 2)
    write_json(out_dir / BUILD_INFO, info)
    log.info("built builtin:%s: %s", recipe.name, info)
    return info


def _verified_shipped(choice: Choice, model: nn.Module, recipe: Recipe, out_dir: Path,
                      examples: Sequence[Example]) -> tuple[dict[str, mx.array] | None, str]:
    """The shipped weights, written into `out_dir` and verified against the scripts, or
    None and the reason to train instead (not chosen, not fitting, or failing the check:
    say, a new MLX moved the numerics)."""
    if choice.use is None:
        return None, choice.reason
    params: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    shapes = {name: tuple(value.shape) for name, value in params.items()}
    try:
        weights = load_weights(choice.use, shapes, getattr(mx, recipe.dtype))
        save_by_layer(out_dir, weights)
        verify_model_dir(out_dir, examples)
    except (ShippedMismatch, BuildError) as err:
        # Training rewrites the same per-layer files, so nothing of these is left behind.
        return None, f"the shipped weights failed their check: {err}"
    return weights, choice.reason


def save_by_layer(out_dir: Path, weights: dict[str, mx.array]) -> None:
    """One safetensors file per decoder layer plus one for the rest, and the index a
    sharded checkpoint has: a pipeline stage then reads only its own layers' files."""
    files: dict[str, dict[str, mx.array]] = {}
    for name, value in weights.items():
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        files.setdefault(f"layer-{int(layer.group(1)):03d}" if layer else "shared", {})[name] = value
    names = sorted(files)
    weight_map: dict[str, str] = {}
    for i, part in enumerate(names, start=1):
        filename = f"model-{i:05d}-of-{len(names):05d}.safetensors"
        mx.save_safetensors(str(out_dir / filename), files[part], metadata={"format": "mlx"})
        weight_map.update({k: filename for k in files[part]})
    total = sum(v.nbytes for v in weights.values())
    write_json(out_dir / "model.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def save_random_model(out_dir: Path, weights: dict[str, mx.array], *, name: str, key: str,
                      seed: int, **info: Any) -> int:
    """A random-weight built-in's weights (by layer) and its build info; returns its
    parameter count. `info`: more fields for `build_info.json`."""
    parameters = sum(w.size for w in weights.values())
    save_by_layer(out_dir, weights)
    write_json(out_dir / BUILD_INFO, {"name": name, "cache_key": key,
                                      "weights": {"source": "random", "seed": seed},
                                      **info, "parameters": parameters})
    return parameters


def vlm_initial_weights(model_type: str, config: dict[str, Any],
                        seed: int) -> dict[str, mx.array]:
    """mlx-vlm's own `model_type` model (`mlx_vlm.models.<model_type>`) built from its
    `config.json` dict with its initial weights (seeded), under the names mlx-vlm saves."""
    family: Any = importlib.import_module(f"mlx_vlm.models.{model_type}")
    mx.random.seed(seed)
    model_config = family.ModelConfig.from_dict(config)
    model_config.text_config = family.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = family.VisionConfig.from_dict(config["vision_config"])
    return dict(tree_flatten(family.Model(model_config).parameters()))


def save_mtp(out_dir: Path, weights: dict[str, mx.array]) -> None:
    """The MTP layer in a file of its own, listed in the index as a checkpoint's are.
    Not a `model*.safetensors` file: mlx-lm 0.32.2 loads all of those, and deepseek_v3's
    `sanitize` drops only `model.layers.61` (the MTP layer of DeepSeek V3's 61), so a
    small model's MTP layer there would fail its load."""
    mx.save_safetensors(str(out_dir / MTP_FILE), weights, metadata={"format": "mlx"})
    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = dict(sorted({**index["weight_map"],
                                       **{k: MTP_FILE for k in weights}}.items()))
    index["metadata"]["total_size"] += sum(v.nbytes for v in weights.values())
    write_json(index_path, index)


def _examples(model_dir: Path, scripts: Sequence[Script], eos_id: int) -> list[Example]:
    # One example per rendering the APIs produce (scripts.renderings), named by its label.
    # The tokenizer comes from the written files through mlx_lm's loader, so prompts
    # are rendered exactly as the serving path renders them.
    tokenizer = load_tokenizer(model_dir)
    return [
        Example(r.label, tuple(prompt_ids(tokenizer, r)), tuple(completion_ids(tokenizer, r, eos_id)))
        for r in renderings(scripts)
    ]


def _random_model(module: Any, config: dict[str, Any], init: RandomInit,
                  silent_ids: Sequence[int]) -> nn.Module:
    """The recipe's random model, drawn as `init.drawn_layers` layers where set and cut to
    the config's, its layers from `init.live_layers` on made inert."""
    layers = config["num_hidden_layers"]
    drawn = module.Model(module.ModelArgs.from_dict(
        {**config, "num_hidden_layers": init.drawn_layers or layers}))
    _randomize(drawn, init, silent_ids)
    if init.live_layers is not None:
        for layer in drawn.model.layers[init.live_layers:]:
            make_inert(layer)
    if init.drawn_layers in (None, layers):
        return drawn
    model = module.Model(module.ModelArgs.from_dict(config))
    kept = [(name, value) for name, value in dict(tree_flatten(drawn.parameters())).items()
            if not (m := re.search(r"\blayers\.(\d+)\.", name)) or int(m.group(1)) < layers]
    model.load_weights(kept)
    return model


def make_inert(layer: nn.Module) -> None:
    """Zero a decoder layer's output projections (attention's, every MLP's and expert's):
    it computes as usual and adds exactly 0 to the residual stream."""
    params: list[tuple[str, mx.array]] = tree_flatten(layer.parameters())  # type: ignore
    zeroed = [(name, mx.zeros_like(value)) for name, value in params
              if name.endswith(("o_proj.weight", "down_proj.weight"))]
    layer.update(tree_unflatten(zeroed))


MTP_FILE = "mtp.safetensors"


def mtp_weights(model: nn.Module, kind: str) -> dict[str, mx.array]:
    """An MTP layer for `model` as a DeepSeek V3 checkpoint holds it, under
    `model.layers.{num_hidden_layers}.` (`RandomInit.mtp`). "agree": the layer passes the
    next token's embedding through (eh_proj reads only that half) and adds nothing, and
    its norm is the model's, so on a model whose layers are all inert it predicts exactly
    what the model will after that token."""
    index = model.args.num_hidden_layers
    layer = NextN(model, type(model.model.layers[0])(model.args, index))
    if kind == "agree":
        hidden = model.args.hidden_size
        layer.eh_proj.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], 1)
        make_inert(layer.layer)
        layer.norm.weight = model.model.norm.weight
    params: list[tuple[str, mx.array]] = tree_flatten(layer.parameters())  # type: ignore
    own = {file_key(k): v for k, v in params}
    own |= {"shared_head.head.weight": model.lm_head.weight,
            "embed_tokens.weight": model.model.embed_tokens.weight}
    dtype = model.lm_head.weight.dtype
    return {f"model.layers.{index}.{k}": v.astype(dtype) for k, v in own.items()}


def _randomize(model: nn.Module, init: RandomInit, silent_ids: Sequence[int]) -> None:
    head = model.lm_head
    vocab, hidden = head.weight.shape
    weight = mx.random.normal((vocab, hidden)) * (init.logit_std / hidden**0.5)
    # Zero rows give the added tokens a logit of exactly 0, far below the best
    # ordinary tokens, so they are (practically) never generated.
    head.weight = weight * mx.ones((vocab, 1)).at[mx.array(list(silent_ids))].multiply(0.0)
    mx.eval(model.parameters())
