"""The test-only failpoints (`replicas.engine.failpoints`): off, nothing fires; on, an armed
failpoint fires once, in one process, for its own scope only."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from replicas.engine import failpoints

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def restore() -> Iterator[None]:
    """Each test configures the module as it needs; put back what the environment said."""
    yield
    failpoints.configure(os.environ.get(failpoints.ENV))


def test_off_never_fires_even_when_armed(tmp_path: Path, restore: None) -> None:
    failpoints.configure(None)
    armed = failpoints.arm(tmp_path, "step", "m")
    assert not failpoints.ENABLED
    for _ in range(3):
        failpoints.hit("step", "m")  # a caller that skipped the ENABLED test: still nothing
    assert armed.exists()  # not claimed


def test_off_unless_the_environment_names_a_directory(tmp_path: Path) -> None:
    check = "from replicas.engine import failpoints as f; print(f.ENABLED)"
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    for extra, expected in (({}, "False"), ({failpoints.ENV: ""}, "False"),
                            ({failpoints.ENV: str(tmp_path)}, "True")):
        done = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env={**env, **extra},
                              capture_output=True, text=True, check=True, timeout=60)
        assert done.stdout.strip() == expected, extra


def test_on_fires_once_per_armed_file(tmp_path: Path, restore: None) -> None:
    failpoints.configure(tmp_path)
    assert failpoints.ENABLED
    failpoints.hit("step", "m")  # not armed: passes
    armed = failpoints.arm(tmp_path, "step", "m")
    with pytest.raises(failpoints.FailpointError, match="step"):
        failpoints.hit("step", "m")
    failpoints.hit("step", "m")  # claimed: the second call passes
    assert not armed.exists()
    assert (tmp_path / f"step.m.fired.{os.getpid()}").exists()  # who fired it
    failpoints.arm(tmp_path, "step", "m")  # armed again: fires again, once
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("step", "m")
    failpoints.hit("step", "m")


def test_a_failpoint_fires_for_its_own_scope_only(tmp_path: Path, restore: None) -> None:
    failpoints.configure(tmp_path)
    failpoints.arm(tmp_path, "step", "org/a")  # a model id with a slash: one file
    failpoints.hit("step", "b")
    failpoints.hit("other", "org/a")
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("step", "org/a")


def _race(directory: str, fired: "multiprocessing.Queue[bool]") -> None:
    failpoints.configure(directory)
    try:
        failpoints.hit("step", "m")
        fired.put(False)
    except failpoints.FailpointError:
        fired.put(True)


def test_one_process_of_many_claims_it(tmp_path: Path) -> None:
    """A replica and its replacement race for the file: exactly one fails."""
    failpoints.arm(tmp_path, "step", "m")
    context = multiprocessing.get_context("spawn")
    fired: multiprocessing.Queue[bool] = context.Queue()
    processes = [context.Process(target=_race, args=(str(tmp_path), fired)) for _ in range(4)]
    for process in processes:
        process.start()
    results = [fired.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert sorted(results) == [False, False, False, True]


def test_a_hold_waits_until_its_file_is_gone_or_its_limit(tmp_path: Path,
                                                          restore: None) -> None:
    import threading

    failpoints.configure(tmp_path)
    assert failpoints.hold("load", "m") == 0.0  # not armed: no wait
    armed = failpoints.arm_hold(tmp_path, "load", "m")
    threading.Timer(0.5, armed.unlink).start()
    assert 0.4 <= failpoints.hold("load", "m", poll_s=0.02) < 30
    assert failpoints.hold("load", "m") == 0.0  # deleted: the next load goes through
    failpoints.arm_hold(tmp_path, "load", "m", limit_s=0.3)  # a forgotten file ends too
    assert 0.3 <= failpoints.hold("load", "m", poll_s=0.02) < 30
    assert failpoints.hold("load", "other") == 0.0  # another model loads at once
    failpoints.configure(None)
    assert failpoints.hold("load", "m") == 0.0  # off
