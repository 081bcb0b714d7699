"""Claude Code (npm `@anthropic-ai/claude-code`, pinned in package.json) completes a real
tool loop against Orchard: it asks, the model calls Read, Claude Code reads notes.txt and
sends the result, and the model's answer quotes the file's first line.

First through the real ingress with a scripted model (the capture, which also proves the
Anthropic adapter both ways), then through `serve run` with a model trained on the
captured prompts (see README.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.serve_process import ServeProcess

from .agents import ClientRun, claude_transcript
from .session import Capture, Timings, served_run
from .tasks import ANSWER, CLAUDE_TASK, NOTES_FIRST_LINE
from .training_set import chat_messages, task_turns

pytestmark = pytest.mark.clients


def assert_read_loop(run: ClientRun) -> None:
    """Claude Code's own output shows one Read of notes.txt, its real result, and the answer,
    in two model turns with no API error."""
    transcript = claude_transcript(run)
    result = transcript.result
    assert run.returncode == 0, run.describe()
    assert result["is_error"] is False, run.describe()
    assert result.get("api_error_status") is None, run.describe()
    assert result["result"] == ANSWER, run.describe()
    assert result["num_turns"] == 2, run.describe()
    assert [(u["name"], u["input"]) for u in transcript.tool_uses] == \
        [(CLAUDE_TASK.tool, dict(CLAUDE_TASK.arguments))], run.describe()
    assert len(transcript.tool_results) == 1, run.describe()
    tool_result = transcript.tool_results[0]
    assert not tool_result.get("is_error"), run.describe()
    assert NOTES_FIRST_LINE in json.dumps(tool_result["content"]), run.describe()


def test_the_pinned_version_is_installed(client_bin: Path) -> None:
    out = subprocess.run([str(client_bin / "claude"), "--version"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.split()[0] == "2.1.328"


def test_loop_through_the_ingress_with_a_scripted_model(captures: dict[str, Capture]) -> None:
    capture = captures[CLAUDE_TASK.name]
    assert_read_loop(capture.run)
    call, answer = task_turns(CLAUDE_TASK, capture.recorded)
    # What the Anthropic adapter made of Claude Code's requests: the Read tool offered,
    # then the call in the assistant turn and the file's content in the tool turn.
    assert [t.name for t in call.tools] == [CLAUDE_TASK.tool]
    assert chat_messages(call)[-1].content == CLAUDE_TASK.prompt
    *_, assistant, tool = chat_messages(answer)
    assert [(c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == \
        [(CLAUDE_TASK.tool, dict(CLAUDE_TASK.arguments))]
    assert tool.role == "tool" and NOTES_FIRST_LINE in tool.content


def test_real_tool_loop_against_serve_run(orchard: ServeProcess, client_bin: Path,
                                          tmp_path: Path, timings: Timings) -> None:
    run = served_run(orchard, client_bin, CLAUDE_TASK, tmp_path, "/v1/messages", timings)
    assert_read_loop(run)
