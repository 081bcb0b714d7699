"""Serve's own settings as `serve_config.yaml` ships them, for the benchmarks' own configs.

Read from the shipped config, not from `deployments/` (load never imports that layer), so
every benchmark's `serve run` runs Serve the way users do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parents[1] / "serve_config.yaml"


def controller_options(**env: str) -> dict[str, Any]:
    """The shipped `controller_options`, with `env` overriding its variables."""
    options: dict[str, Any] = yaml.safe_load(SHIPPED.read_text())["controller_options"]
    options["runtime_env"]["env_vars"].update(env)
    return options
