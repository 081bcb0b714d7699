"""Codex CLI (npm `@openai/codex`, pinned in package.json) completes a real tool loop
against Orchard's Responses API: the model calls exec_command with `cat notes.txt`, Codex
runs it in its sandbox and sends the output, and the model's answer quotes the first line.

First through the real ingress with a scripted model (the capture, which also proves the
Responses adapter both ways), then through `serve run` with a model trained on the
captured prompts (see README.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.serve_process import ServeProcess

from .agents import ClientRun, codex_transcript
from .session import Capture, Timings, served_run
from .tasks import ANSWER, CODEX_TASK, NOTES_FIRST_LINE
from .training_set import CODEX_TIMING, chat_messages, task_turns

pytestmark = pytest.mark.clients


def assert_cat_loop(run: ClientRun) -> None:
    """Codex's own events show `cat notes.txt` run with the file's text as output, and the
    answer, with no error."""
    transcript = codex_transcript(run)
    assert run.returncode == 0, run.describe()
    assert transcript.errors == [], run.describe()
    assert transcript.turn_completed, run.describe()
    assert len(transcript.commands) == 1, run.describe()
    command = transcript.commands[0]
    assert CODEX_TASK.arguments["cmd"] in command["command"], run.describe()
    assert command["exit_code"] == 0, run.describe()
    assert command["aggregated_output"].startswith(NOTES_FIRST_LINE), run.describe()
    assert transcript.messages == [ANSWER], run.describe()


def test_the_pinned_version_is_installed(client_bin: Path) -> None:
    out = subprocess.run([str(client_bin / "codex"), "--version"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.split() == ["codex-cli", "0.169.0"]


def test_loop_through_the_ingress_with_a_scripted_model(captures: dict[str, Capture]) -> None:
    capture = captures[CODEX_TASK.name]
    assert_cat_loop(capture.run)
    call, answer = task_turns(CODEX_TASK, capture.recorded)
    # What the Responses adapter made of Codex's requests: its function tools (the hosted
    # ones are off in its config), then the call and the command's output.
    assert CODEX_TASK.tool in [t.name for t in call.tools]
    assert chat_messages(call)[-1].content == CODEX_TASK.prompt
    *_, assistant, tool = chat_messages(answer)
    assert [(c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == \
        [(CODEX_TASK.tool, dict(CODEX_TASK.arguments))]
    assert tool.role == "tool" and NOTES_FIRST_LINE in tool.content
    assert CODEX_TIMING.search(tool.content), tool.content


def test_real_tool_loop_against_serve_run(orchard: ServeProcess, client_bin: Path,
                                          tmp_path: Path, timings: Timings) -> None:
    run = served_run(orchard, client_bin, CODEX_TASK, tmp_path, "/v1/responses", timings)
    assert_cat_loop(run)
