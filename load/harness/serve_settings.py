"""Serve's own settings as `serve_config.yaml` ships them, for the benchmarks' own configs.

Read from the shipped config, not from `deployments/` (load never imports that layer), so
every benchmark's `serve run` runs Serve the way users do.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parents[2] / "serve_config.yaml"
SHIPPED_PORT = 8000  # where clients of the shipped config connect: the replica itself
_DIRECT_PORTS = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
_DIRECT_ONLY = (*_DIRECT_PORTS, "RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_PORT_QUARANTINE_S",
                "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")


def serve_settings(port: int = SHIPPED_PORT, *, direct: bool = True,
                   **env: str) -> dict[str, Any]:
    """The shipped config's Serve blocks (`proxy_location`, `http_options`,
    `controller_options`), serving on `port`. As shipped, the replica that serves HTTP
    listens on `port` itself and Serve's proxy one port above (every port moves by the same
    offset). `direct=False`: no direct ingress, Serve's proxy (or HAProxy) on `port`, as
    before it shipped. `env` overrides Serve's variables."""
    shipped = yaml.safe_load(SHIPPED.read_text())
    blocks = {k: copy.deepcopy(shipped[k])
              for k in ("proxy_location", "http_options", "controller_options")}
    variables: dict[str, str] = blocks["controller_options"]["runtime_env"]["env_vars"]
    shift = port - SHIPPED_PORT
    blocks["http_options"]["port"] += shift
    for name in _DIRECT_PORTS:
        variables[name] = str(int(variables[name]) + shift)
    if not direct:
        blocks["http_options"]["port"] = port
        for name in _DIRECT_ONLY:
            variables.pop(name)
    variables.update(env)
    return blocks
