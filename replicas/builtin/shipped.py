"""Trained weights shipped in the package, so a first build of `builtin:tiny` writes them
out in seconds instead of training for minutes.

`shipped/<name>.safetensors` holds every weight in one file (the build splits them per
layer, as it does trained ones) and `shipped/<name>.json` the fingerprint they were trained
for, with the training record. The fingerprint hashes what decides what the weights mean:
the recipe, the tokenizer's vocabulary and the training examples (each script rendered
through the chat template and tokenized, so it follows the scripts, the template and the
tokenizer). It leaves out what the cache key adds (this package's Python source and package
versions): those change with any edit or upgrade without changing what the weights must do.
A changed numeric path (a new MLX) is caught instead by verifying the written directory
against the scripts, and the build trains when that fails.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .recipe import Recipe, recipe_fields
from .train import Example

SHIPPED_DIR = Path(__file__).parent / "shipped"


@dataclass(frozen=True)
class Shipped:
    """One recipe's shipped weights: the safetensors file and its sidecar's contents."""

    weights_file: Path
    fingerprint: str
    record: dict[str, Any]  # how they were trained: steps, loss, margin, versions


@dataclass(frozen=True)
class Choice:
    """Whether the build writes the shipped weights (`use`) or trains, and why."""

    use: Shipped | None
    reason: str


class ShippedMismatch(ValueError):
    """The shipped weights do not fit the model the recipe builds (names, shapes, dtype)."""


def fingerprint(recipe: Recipe, vocab: Mapping[str, int], examples: Sequence[Example]) -> str:
    """A stable hash of what the weights are trained for (see the module docstring)."""
    material = {
        "recipe": recipe_fields(recipe),
        "weights_kind": type(recipe.weights).__name__,
        "vocab": sorted(vocab.items()),
        "examples": [[e.script_id, list(e.prompt), list(e.completion)] for e in examples],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def find_shipped(name: str, directory: Path | None = None) -> Shipped | None:
    """The weights shipped for recipe `name`, or None if the package has none."""
    root = SHIPPED_DIR if directory is None else directory
    weights, sidecar = root / f"{name}.safetensors", root / f"{name}.json"
    if not (weights.is_file() and sidecar.is_file()):
        return None
    record = json.loads(sidecar.read_text())
    return Shipped(weights, str(record["fingerprint"]), record)


def choose(expected: str, shipped: Shipped | None) -> Choice:
    """Write the shipped weights only when they were trained for exactly this build
    (`expected` is its fingerprint); otherwise train, saying why."""
    if shipped is None:
        return Choice(None, "no shipped weights for this recipe")
    if shipped.fingerprint != expected:
        return Choice(None, f"the shipped weights were trained for another recipe, tokenizer "
                            f"or scripts (fingerprint {shipped.fingerprint[:12]}, this build "
                            f"{expected[:12]}); `python -m replicas.builtin <name> "
                            f"--refresh-shipped` ships new ones")
    return Choice(shipped, "the shipped weights match this recipe, tokenizer and scripts")


def load_weights(shipped: Shipped, shapes: Mapping[str, Sequence[int]],
                 dtype: mx.Dtype) -> dict[str, mx.array]:
    """The shipped arrays, checked against the freshly built model's parameter names and
    shapes and the recipe's dtype, so a mismatch is a clear reason to train rather than a
    failed load later."""
    weights = read_arrays(shipped.weights_file)
    missing, extra = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    if missing or extra:
        raise ShippedMismatch(f"parameter names differ: missing {missing[:3]}, extra {extra[:3]}")
    for name, shape in shapes.items():
        got = weights[name]
        if tuple(got.shape) != tuple(shape) or got.dtype != dtype:
            raise ShippedMismatch(f"{name}: shipped {got.dtype}{tuple(got.shape)}, "
                                  f"the model wants {dtype}{tuple(shape)}")
    return weights


def read_arrays(path: Path) -> dict[str, mx.array]:
    """The named arrays of one safetensors file."""
    loaded = mx.load(str(path))
    if not isinstance(loaded, dict):
        raise ShippedMismatch(f"{path} holds no named arrays")
    return loaded


def write_shipped(name: str, weights: Mapping[str, mx.array], record: Mapping[str, Any],
                  directory: Path | None = None) -> Path:
    """Replace recipe `name`'s shipped weights; `record` must hold their "fingerprint"."""
    root = SHIPPED_DIR if directory is None else directory
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.safetensors"
    mx.save_safetensors(str(path), dict(weights), metadata={"format": "mlx"})
    (root / f"{name}.json").write_text(json.dumps(dict(record), indent=2, sort_keys=True) + "\n")
    return path
