"""Startup progress lines (replicas.startup): building and loading a model say what they do,
the time so far, what the work reports of itself, and the built-in model's expected time."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from replicas import startup
from replicas.builtin import ensure_builtin
from replicas.engine.model.loading import load_model


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "orchard.startup"]


def test_heartbeat_reports_elapsed_time_and_the_latest_detail(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(startup, "HEARTBEAT_S", 0.05)
    release = threading.Event()
    with caplog.at_level(logging.INFO, logger="orchard.startup"):
        with startup.Progress("building a thing", "about a minute"):
            startup.report("step 29, min margin 1.50 at step 20")
            startup.report("step 30, min margin 2.50 at step 30")
            # Condition wait, not a sleep: the heartbeat thread logs on its own schedule.
            for _ in range(400):
                if any("step 30" in line for line in _lines(caplog)):
                    break
                release.wait(0.05)
    lines = _lines(caplog)
    assert lines[0] == "building a thing, about a minute"
    beat = next(line for line in lines if "step 30" in line)
    assert beat.startswith("building a thing: ")
    assert beat.endswith("s so far, step 30, min margin 2.50 at step 30")
    assert not any("%" in line for line in lines)  # no share of a bound it rarely reaches
    assert lines[-1].startswith("building a thing: done in ")
    startup.report("nothing")  # outside any Progress: a no-op


def test_a_failure_is_logged_as_such(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="orchard.startup"):
        with pytest.raises(RuntimeError), startup.Progress("loading x"):
            raise RuntimeError("boom")
    assert _lines(caplog)[-1].startswith("loading x: failed after ")


def test_building_and_loading_a_builtin_model_log_progress(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="orchard.startup"):
        path = ensure_builtin("bench", cache_dir=tmp_path)
        built = _lines(caplog)
        load_model(str(path), path)
    assert built[0].startswith("building the built-in model builtin:bench, once (cached in ")
    assert built[0].endswith("a few seconds")
    assert built[-1].startswith("building the built-in model builtin:bench: done in ")
    loading = [line for line in _lines(caplog) if line.startswith("loading model ")]
    assert loading[0] == f"loading model {path} from {path}"
    assert loading[-1].startswith(f"loading model {path} from {path}: done in ")
    with caplog.at_level(logging.INFO, logger="orchard.startup"):
        caplog.clear()
        ensure_builtin("bench", cache_dir=tmp_path)  # cached: nothing is built, nothing logged
    assert _lines(caplog) == []


def test_the_tiny_recipe_says_it_takes_seconds_unless_it_trains(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The first line is logged before any work; stop the build right there.
    from replicas.builtin import build

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build", stop)
    with caplog.at_level(logging.INFO, logger="orchard.startup"), \
            pytest.raises(KeyboardInterrupt):
        ensure_builtin("tiny", cache_dir=tmp_path)
    first = _lines(caplog)[0]
    assert first.startswith("building the built-in model builtin:tiny, once")
    assert "a few seconds with the weights shipped in the package" in first
    assert "training takes a few minutes" in first
