"""What the client suite's session fixtures hand the tests, and the served run they share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.serve_process import ServeProcess

from .agents import ClientRun, make_workspace, run_claude, run_codex
from .capture import Recorded
from .tasks import CLAUDE_TASK, CODEX_TASK, AgentTask

Runner = Callable[[Path, str, Path, Path, AgentTask], ClientRun]
RUNNERS: dict[str, Runner] = {CLAUDE_TASK.name: run_claude, CODEX_TASK.name: run_codex}


@dataclass(frozen=True)
class Capture:
    """One client's run against the capture server, and the requests it caused."""

    task: AgentTask
    run: ClientRun
    recorded: tuple[Recorded, ...]


@dataclass(frozen=True)
class Timings:
    """Seconds per phase, and notes, printed at the end of the pytest run."""

    phases: dict[str, float]
    notes: list[str]


TIMINGS = Timings({}, [])


def served_run(orchard: ServeProcess, client_bin: Path, task: AgentTask, root: Path,
               path: str, timings: Timings) -> ClientRun:
    """The client's run against the served model, once the server is seen to have handled
    exactly the loop's two requests to `path` (the call, then the answer) during it."""
    before = orchard.handled("POST", path)
    work, home = make_workspace(root)
    start = time.monotonic()
    run = RUNNERS[task.name](client_bin, orchard.base_url, work, home, task)
    timings.phases[f"{task.name} served run"] = time.monotonic() - start
    # Ray forwards the replicas' access lines with a delay; a moment more lets an extra
    # request show too.
    orchard.wait_handled("POST", path, len(before) + 2)
    time.sleep(1.0)
    requests = len(orchard.handled("POST", path) - before)
    assert requests == 2, f"the server handled {requests} {path} requests, not 2\n" \
                          f"{run.describe()}\nserve log: {orchard.log_path}"
    return run
