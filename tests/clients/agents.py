"""Run the real coding agents non-interactively against an Orchard base URL, and read what
they print.

Each run gets its own working folder (holding notes.txt) and its own HOME, so no user
configuration leaks in. The flags keep the prompts small and the same on every run:

- Claude Code: `--bare` (no CLAUDE.md discovery, hooks, plugins, background requests,
  and no environment block with the date and folder), `--system-prompt`, `--tools Read`
  and `--allowedTools Read` so Read runs without asking.
- Codex: `config.toml` points at Orchard with `wire_api = "responses"`, replaces the
  built-in instructions with a one-line file, and turns off what would add text that
  changes between runs or machines (environment context with date and folder, the
  permissions and apps blocks, skills, web search, goals, subagents, image viewing,
  request_user_input, update_plan). `exec_command` and `write_stdin` stay.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tasks import MODEL_ID, NOTES_FILE, NOTES_TEXT, AgentTask

SYSTEM_PROMPT = "You are Orchard Tiny."
CLIENT_TIMEOUT_S = 180


@dataclass(frozen=True)
class ClientRun:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def describe(self) -> str:
        return (f"$ {' '.join(self.argv)}\nexit {self.returncode} after {self.seconds:.1f}s\n"
                f"--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-4000:]}")

    def json_lines(self) -> list[dict[str, Any]]:
        """stdout's JSON objects, one a line (other lines are skipped)."""
        events = []
        for line in self.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
        return events


def make_workspace(root: Path) -> tuple[Path, Path]:
    """A fresh working folder with notes.txt, and an empty HOME beside it."""
    work, home = root / "work", root / "home"
    work.mkdir(parents=True)
    home.mkdir(parents=True)
    (work / NOTES_FILE).write_text(NOTES_TEXT)
    return work, home


def _base_env(home: Path) -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR", "TERM", "SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["HOME"] = str(home)
    return env


def _run(argv: Sequence[str], cwd: Path, env: dict[str, str]) -> ClientRun:
    start = time.monotonic()
    try:
        done = subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=CLIENT_TIMEOUT_S, stdin=subprocess.DEVNULL)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code = -9
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")) + \
            f"\n[timed out after {CLIENT_TIMEOUT_S}s]"
    return ClientRun(tuple(argv), code, out, err, time.monotonic() - start)


def run_claude(bin_dir: Path, base_url: str, work: Path, home: Path, task: AgentTask) -> ClientRun:
    env = _base_env(home) | {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": "sk-unused",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    argv = [
        str(bin_dir / "claude"), "-p", task.prompt, "--model", MODEL_ID,
        # stream-json ends with the same result object as `--output-format json`, and
        # before it the transcript, which shows the tool's real result.
        "--output-format", "stream-json", "--verbose",
        "--bare", "--system-prompt", SYSTEM_PROMPT,
        "--tools", task.tool, "--allowedTools", task.tool,
        "--no-session-persistence",
    ]
    return _run(argv, work, env)


CODEX_CONFIG = """\
model = "{model}"
model_provider = "orchard"
model_instructions_file = "{instructions}"
include_permissions_instructions = false
include_apps_instructions = false
include_collaboration_mode_instructions = false
include_environment_context = false
web_search = "disabled"
check_for_update_on_startup = false

[features]
goals = false
view_image = false

[agents]
enabled = false

[skills]
include_instructions = false

[tools.experimental_request_user_input]
enabled = false

[tools.update_plan]
enabled = false

[analytics]
enabled = false

[model_providers.orchard]
name = "Orchard"
base_url = "{base_url}/v1"
wire_api = "responses"
"""


def run_codex(bin_dir: Path, base_url: str, work: Path, home: Path, task: AgentTask) -> ClientRun:
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    instructions = codex_home / "instructions.md"
    instructions.write_text(SYSTEM_PROMPT + "\n")
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(
        model=MODEL_ID, instructions=instructions, base_url=base_url))
    env = _base_env(home) | {"CODEX_HOME": str(codex_home), "OPENAI_API_KEY": "unused"}
    argv = [str(bin_dir / "codex"), "exec", "--json", "--skip-git-repo-check", "--ephemeral",
            task.prompt]
    return _run(argv, work, env)


@dataclass(frozen=True)
class ClaudeTranscript:
    """What Claude Code printed: the final result object and the tool blocks in between."""

    result: dict[str, Any]
    tool_uses: list[dict[str, Any]]
    tool_results: list[dict[str, Any]]


def claude_transcript(run: ClientRun) -> ClaudeTranscript:
    events = run.json_lines()
    results = [e for e in events if e.get("type") == "result"]
    assert results, f"Claude Code printed no result object\n{run.describe()}"

    def blocks(role: str, kind: str) -> list[dict[str, Any]]:
        return [block for e in events if e.get("type") == role
                for block in e.get("message", {}).get("content", [])
                if isinstance(block, dict) and block.get("type") == kind]

    return ClaudeTranscript(results[-1], blocks("assistant", "tool_use"),
                            blocks("user", "tool_result"))


@dataclass(frozen=True)
class CodexTranscript:
    """What `codex exec --json` printed: commands it ran, its messages, and failures."""

    commands: list[dict[str, Any]]
    messages: list[str]
    errors: list[dict[str, Any]]
    turn_completed: bool


# Codex reports a model it has no metadata for as an `error` item, then works normally.
_CODEX_NOTICES = ("Model metadata for",)


def codex_transcript(run: ClientRun) -> CodexTranscript:
    events = run.json_lines()
    items = [e["item"] for e in events if e.get("type") == "item.completed" and "item" in e]
    errors = [e for e in events if e.get("type") in ("error", "turn.failed")]
    errors += [i for i in items if i.get("type") == "error"
               and not str(i.get("message", "")).startswith(_CODEX_NOTICES)]
    return CodexTranscript(
        commands=[i for i in items if i.get("type") == "command_execution"],
        messages=[str(i.get("text")) for i in items if i.get("type") == "agent_message"],
        errors=errors,
        turn_completed=any(e.get("type") == "turn.completed" for e in events),
    )
