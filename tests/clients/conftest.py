"""Session fixtures for the real coding agents: install them, capture their requests through
the real ingress with a scripted model, train the agent model on those, serve it with a
real `serve run` (see README.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.serve_process import ROOT, ServeProcess, config_copy, free_port, serve_run

from .agent_model import BUILD_INFO, ensure_agent_model
from .agents import make_workspace
from .capture import RecordingClient, capture_server
from .npm_clients import ensure_clients
from .session import RUNNERS, TIMINGS, Capture, Timings
from .tasks import CLAUDE_TASK, CODEX_TASK, MODEL_ID
from .training_set import training_set


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TIMINGS.phases:
        terminalreporter.write_line("coding agents suite, seconds per phase: " + json.dumps(
            {k: round(v, 1) for k, v in TIMINGS.phases.items()}))
    for note in TIMINGS.notes:
        terminalreporter.write_line(note)


@pytest.fixture(scope="session")
def timings() -> Timings:
    return TIMINGS


@pytest.fixture(scope="session")
def client_bin(timings: Timings) -> Path:
    start = time.monotonic()
    path = ensure_clients()
    timings.phases["npm install (0 when cached)"] = time.monotonic() - start
    return path


@pytest.fixture(scope="session")
def captures(client_bin: Path, tmp_path_factory: pytest.TempPathFactory,
             timings: Timings) -> dict[str, Capture]:
    """Both clients' runs against the real ingress app with the scripted, recording model."""
    start = time.monotonic()
    client = RecordingClient()
    found: dict[str, Capture] = {}
    with capture_server(client) as base_url:
        for task in (CLAUDE_TASK, CODEX_TASK):
            work, home = make_workspace(tmp_path_factory.mktemp(f"capture-{task.name}"))
            before = len(client.recorded)
            run = RUNNERS[task.name](client_bin, base_url, work, home, task)
            found[task.name] = Capture(task, run, tuple(client.recorded[before:]))
    timings.phases["capture"] = time.monotonic() - start
    return found


@pytest.fixture(scope="session")
def agent_model(captures: dict[str, Capture], timings: Timings) -> Path:
    start = time.monotonic()
    train, held_out = training_set([r for c in captures.values() for r in c.recorded])
    path = ensure_agent_model(train, held_out)
    timings.phases["train (0 when cached)"] = time.monotonic() - start
    info = json.loads((path / BUILD_INFO).read_text())
    timings.notes.append(f"agent model {path}: {info['training']}")
    return path


# Package scope: the server (and its Ray instance) stops once this folder's tests are done,
# before other suites start their own.
@pytest.fixture(scope="package")
def orchard(agent_model: Path, tmp_path_factory: pytest.TempPathFactory,
            timings: Timings) -> Iterator[ServeProcess]:
    """`serve run` of the real config with the agent model in place of the built-in one."""
    start = time.monotonic()
    real = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    models = real["applications"][0]["args"]["models"]
    assert [m["id"] for m in models] == [MODEL_ID], "the real config's model changed"
    port = free_port()
    tmp = tmp_path_factory.mktemp("serve")
    config = config_copy(tmp, port, models=[{**models[0], "source": str(agent_model)}])
    with serve_run(config, port, tmp / "serve_run.log", model=MODEL_ID) as server:
        timings.phases["serve run startup"] = time.monotonic() - start
        yield server
