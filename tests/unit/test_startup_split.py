"""The startup split (deployments.startup_split): the line names each phase of the time to a
first answer, from the marks that belong to this start, and adds up to the total."""

from __future__ import annotations

import logging
import re
import threading

import pytest

from deployments import startup_split
from deployments.startup_split import fresh_marks, split_line, watch_first_token

# A `serve run` as the build task and the replica record it (seconds since the epoch).
BUILD = {"imported": 1007.0, "called": 1008.5, "builtin_s": 2.5, "built": 1011.25}
DRIVER = (1000.0, 1003.0)  # serve run's process start, its joining Ray


def _phases(line: str) -> dict[str, float]:
    return {name.strip(): float(s) for name, s in re.findall(r"([a-z ]+) (\d+\.\d)s", line.split(": ", 1)[1])}


def test_the_line_splits_a_fresh_serve_run_into_phases_that_add_up() -> None:
    marks = {**fresh_marks(1013.0, BUILD, lambda: DRIVER),
             "constructed": 1013.0, "ready": 1013.5, "first_token": 1014.0}
    line = split_line(marks)
    assert line.startswith("first answer 14.0s after serve run: ")
    phases = _phases(line)
    assert phases == {"ray": 3.0, "serve": 4.0, "app imports": 1.5, "builtin": 2.5,
                      "app build": 0.2, "replica start": 1.8, "load": 0.5, "first token": 0.5}
    assert sum(phases.values()) == pytest.approx(14.0, abs=0.1)


def test_a_replacement_replica_long_after_the_build_times_only_its_own_start() -> None:
    late = 1011.25 + 3600
    marks = {**fresh_marks(late, BUILD, lambda: DRIVER),
             "constructed": late, "ready": late + 2, "first_token": late + 2.5}
    assert split_line(marks) == \
        "first answer 2.5s after the replica's start: load 2.0s, first token 0.5s"


def test_a_driver_that_joined_long_before_the_build_is_left_out() -> None:
    # `ray start` then a much later `serve deploy`: the driver's start is not this start's.
    marks = {**fresh_marks(1013.0, BUILD, lambda: (0.0, 10.0)),
             "constructed": 1013.0, "ready": 1013.5, "first_token": 1014.0}
    line = split_line(marks)
    assert line.startswith("first answer 7.0s after the app's build: ")
    assert "ray" not in _phases(line)


def test_the_replica_logs_the_line_at_its_first_token(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(startup_split, "_POLL_S", 0.01)
    answered = threading.Event()
    stopped = threading.Event()
    with caplog.at_level(logging.INFO, logger="orchard.startup"):
        thread = watch_first_token("m", 0.0, answered.is_set, stopped)
        thread.join(0.1)
        assert thread.is_alive()  # no token yet: nothing logged, still watching
        answered.set()
        thread.join(10)
    lines = [r.getMessage() for r in caplog.records if r.name == "orchard.startup"]
    assert len(lines) == 1 and lines[0].startswith("m: first answer ")
    # Outside Ray there are no build marks: the line starts at the replica's constructor.
    assert "after the replica's start: load " in lines[0]


def test_a_stopped_replica_stops_watching() -> None:
    stopped = threading.Event()
    thread = watch_first_token("m", 0.0, lambda: False, stopped)
    stopped.set()
    thread.join(10)
    assert not thread.is_alive()
