"""Random-weight LoRA (or DoRA) adapters for a model, made with mlx-lm's own tuner classes
and saved in `mlx_lm.lora`'s format: for tests and benchmarks of adapters served side by
side (`replicas/engine/model/adapters.py`).

B is drawn nonzero (a freshly initialised LoRA's B is zero, and would change nothing), so
each adapter changes the model's greedy output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.tuner.utils import linear_to_lora_layers


def make_adapter(model_dir: str | Path, out: str | Path, seed: int, rank: int = 4,
                 scale: float = 10.0, keys: Sequence[str] | None = None,
                 num_layers: int = -1, dora: bool = False) -> Path:
    """An adapter for the model at `model_dir`, written to `out` (created): mlx-lm's
    `linear_to_lora_layers` converts the layers, random draws fill `lora_a`, `lora_b`
    (and DoRA's magnitude `m`), and the files are those `mlx_lm.lora` saves."""
    loaded = mlx_load(str(model_dir))
    model = loaded[0]
    params: dict[str, object] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = list(keys)
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    key = mx.random.key(seed)
    weights: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.trainable_parameters()):  # type: ignore[str-unpack]
        assert isinstance(value, mx.array)
        leaf = name.rsplit(".", 1)[-1]
        key, draw = mx.random.split(key)
        if leaf == "lora_a":
            weights[name] = mx.random.normal(value.shape, key=draw) / value.shape[0] ** 0.5
        elif leaf == "lora_b":
            weights[name] = 0.2 * mx.random.normal(value.shape, key=draw)
        elif leaf == "m" and dora:
            weights[name] = value * (1.0 + 0.1 * mx.random.normal(value.shape, key=draw))
    where = Path(out)
    where.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(where / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "dora" if dora else "lora", "num_layers": num_layers,
              "lora_parameters": params}
    (where / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return where


def builtin_adapter(model: str, name: str, seed: int, dora: bool = False,
                    build: bool = True) -> Path:
    """A random adapter for built-in model `model`, cached beside the built-in models
    (made once, safe across processes); `build=False`: its path only."""
    from replicas.builtin import ensure_builtin
    from replicas.builtin.build import cached_build, default_cache_root

    key = f"adapter-{model}-{name}-{seed}{'-dora' if dora else ''}-v1"
    if not build:
        return default_cache_root() / key
    return cached_build(default_cache_root(), key,
                        lambda where: make_adapter(ensure_builtin(model), where, seed,
                                                   dora=dora))
