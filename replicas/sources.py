"""Where a model comes from: `builtin:NAME` (built on first use), a local path, or a Hub
repo id. Resolved here, above the engine, so the engine loads a directory and never
imports the built-in models (which read the model families)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

BUILTIN_PREFIX = "builtin:"


def resolve_source(source: str) -> Path | str:
    """A local directory for `builtin:NAME` (built on first use) or a path; else a repo id."""
    if source.startswith(BUILTIN_PREFIX):
        from replicas.builtin import ensure_builtin

        return ensure_builtin(source[len(BUILTIN_PREFIX) :])
    path = Path(source).expanduser()
    return path if path.exists() else source


def model_files(source: str, patterns: Sequence[str], fetch: bool = True) -> Path | None:
    """The model's directory: local, built-in, or (with `fetch`) a Hub snapshot holding at
    least the files matching `patterns`, as mlx-lm fetches them; None when it is not on
    disk and `fetch` is off."""
    resolved = resolve_source(source)
    if isinstance(resolved, Path):
        return resolved
    if not fetch:
        return None
    from mlx_lm.utils import _download

    return Path(_download(resolved, allow_patterns=list(patterns)))


def model_config(source: str, fetch: bool = True) -> dict[str, Any] | None:
    """config.json of a model: local, built-in, or (with `fetch`) that file alone from the
    Hub, as mlx-lm fetches it; None when it is not on disk and `fetch` is off."""
    directory = model_files(source, ["config.json"], fetch)
    if directory is None:
        return None
    path = directory / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    assert isinstance(config, dict)
    return config


def load_source(source: str) -> Any:
    """The `LoadedModel` of `source`, resolved and loaded as a replica loads it."""
    from replicas.engine.model.loading import load_model

    return load_model(source, resolve_source(source))
