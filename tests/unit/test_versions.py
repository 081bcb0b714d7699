"""The version check before a model loads: a package other than the pinned one fails the
load naming the package, both versions and the override; the override loads anyway."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from replicas import versions
from replicas.versions import MODEL_STACK, OVERRIDE, SERVING, VersionMismatch, check

ROOT = Path(__file__).resolve().parents[2]


def test_the_checked_versions_are_pyprojects_pins() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^;\s]+)", dep)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    for package, version in {**MODEL_STACK, **SERVING}.items():
        assert pins.get(package) == version, (package, pins.get(package), version)


def test_the_installed_stack_passes() -> None:
    check({**MODEL_STACK, **SERVING}, environ={})


def _installed(fake: dict[str, str]):
    def version(package: str) -> str:
        if package in fake:
            return fake[package]
        raise metadata.PackageNotFoundError(package)
    return version


def test_a_moved_package_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions.metadata, "version",
                        _installed({"mlx-lm": "0.33.0", "mlx": "0.32.4"}))
    with pytest.raises(VersionMismatch) as err:
        check({"mlx": "0.32.4", "mlx-lm": "0.32.2", "mlx-vlm": "0.7.10"}, environ={})
    message = str(err.value)
    assert "mlx-lm 0.33.0 is installed, Orchard expects 0.32.2" in message
    assert "pip install mlx-lm==0.32.2" in message
    assert OVERRIDE in message
    assert "mlx 0" not in message  # the matching one is not named; the absent one is skipped
    assert "mlx-vlm" not in message


def test_the_override_logs_and_goes_on(monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(versions.metadata, "version", _installed({"ray": "2.61.0"}))
    check({"ray": "2.60.0"}, environ={OVERRIDE: "1"})
    assert "ray 2.61.0 is installed, Orchard expects 2.60.0" in caplog.text
