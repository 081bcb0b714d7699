"""The versions Orchard's private hooks were written against, checked before a model loads.

Orchard subclasses and rewires private parts of mlx-lm (`GenerationBatch._step`, the batch
caches' write index, nine attention classes, the attention function each model module
imports, which paged KV wraps), mlx-vlm (its language model) and Ray Serve
(the router's pending-request indices and queue-length cache, the replica's HTTP server).
Those move between releases without notice, so a version other than the pinned one fails
the load with a message, instead of serving subtly wrong output. Each hook has a contract
test (`tests/unit/test_private_hooks.py`) for the day the pins move.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Mapping

log = logging.getLogger(__name__)

# Exactly the pins in pyproject.toml (`tests/unit/test_versions.py` holds them equal).
MODEL_STACK = {"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-vlm": "0.7.10", "llguidance": "1.9.1"}
SERVING = {"ray": "2.60.0"}
OVERRIDE = "ORCHARD_ALLOW_VERSION_MISMATCH"


@dataclass(frozen=True)
class Mismatch:
    package: str
    found: str
    expected: str

    def __str__(self) -> str:
        return f"{self.package} {self.found} is installed, Orchard expects {self.expected}"


class VersionMismatch(RuntimeError):
    """An installed package is not the version Orchard's private hooks were written for."""


def mismatches(expected: Mapping[str, str]) -> list[Mismatch]:
    """The installed packages of `expected` whose version differs (an absent one is not a
    mismatch: its import fails on its own, naming it)."""
    found = []
    for package, version in expected.items():
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        if installed != version:
            found.append(Mismatch(package, installed, version))
    return found


def check(expected: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> None:
    """Raise `VersionMismatch` naming each package that differs from `expected`, unless
    `ORCHARD_ALLOW_VERSION_MISMATCH=1`, which logs the same and goes on."""
    wrong = mismatches(expected)
    if not wrong:
        return
    found = "; ".join(str(m) for m in wrong)
    if environ.get(OVERRIDE) == "1":
        log.warning("%s (%s=1: loading anyway; Orchard's private hooks may misbehave)",
                    found, OVERRIDE)
        return
    pins = " ".join(f"{m.package}=={m.expected}" for m in wrong)
    raise VersionMismatch(
        f"{found}. Orchard reaches into private parts of these packages, which change "
        f"between releases. Install the pinned versions (pip install {pins}, or "
        f"pip install -e . in the checkout), or set {OVERRIDE}=1 to load anyway at your "
        "own risk.")
