"""The scripted task each coding agent is given, in one place: what the user asks, the call
the model makes with the client's own tool, and the final answer.

The capture fake answers with exactly these, and the agent model is trained on exactly
these, so the served model's turns are the fake's turns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

MODEL_ID = "orchard-tiny"
NOTES_FILE = "notes.txt"
NOTES_FIRST_LINE = "Orchard keeps its apples in crates of twelve."
NOTES_TEXT = f"{NOTES_FIRST_LINE}\nThe second line is never quoted.\n"
ANSWER = f"The first line of {NOTES_FILE} is: {NOTES_FIRST_LINE}"


@dataclass(frozen=True)
class AgentTask:
    name: str  # names the recorded turns: "<name>-call", "<name>-answer"
    prompt: str  # what the user types
    tool: str  # the client's own tool the model calls
    arguments: Mapping[str, Any] = field(default_factory=dict)
    answer: str = ANSWER

    @property
    def arguments_json(self) -> str:
        # json.dumps' default separators, as the chat template's `tojson` writes them back.
        return json.dumps(dict(self.arguments), ensure_ascii=False)


# Relative paths keep the temporary folder's name out of the prompt (Claude Code resolves
# them against its working directory; Codex runs the command there), so the prompts are the
# same on every run and a trained model can be reused.
CLAUDE_TASK = AgentTask(
    name="claude",
    prompt=f"Read {NOTES_FILE} and tell me its first line.",
    tool="Read",
    arguments=MappingProxyType({"file_path": NOTES_FILE}),
)
CODEX_TASK = AgentTask(
    name="codex",
    prompt=f"Run cat {NOTES_FILE} and tell me its first line.",
    tool="exec_command",
    arguments=MappingProxyType({"cmd": f"cat {NOTES_FILE}"}),
)
TASKS = (CLAUDE_TASK, CODEX_TASK)
