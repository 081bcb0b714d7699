"""The shipped packages type-check: mypy over `replicas`, `deployments` and `ingress`, with
the settings in pyproject.toml (pydantic's plugin included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_packages_type_check() -> None:
    # A subprocess, so mypy reads pyproject.toml from the repository root as a user's run does.
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout, result.stdout
