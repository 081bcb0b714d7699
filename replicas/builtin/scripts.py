"""The scripted prompts the built-in tiny model memorizes, loaded from scripts.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

SCRIPTS_PATH = Path(__file__).with_name("scripts.json")

ScriptKind = Literal["chat", "completion"]
_ROLES = frozenset({"system", "user", "assistant"})


@dataclass(frozen=True)
class Message:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        """The shape chat templates and the OpenAI API use."""
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Script:
    """One prompt and the exact text the tiny model generates for it (then eos).

    `enable_thinking` is None when the chat template default applies (no kwarg is
    passed). `prompt` is set only for completions, `messages` only for chats.
    """

    id: str
    kind: ScriptKind
    description: str
    messages: tuple[Message, ...]
    enable_thinking: bool | None
    prompt: str | None
    reasoning: str | None
    answer: str

    @property
    def expected_text(self) -> str:
        """The generated text, without the trailing `<|im_end|>` eos token."""
        if self.reasoning is None:
            return self.answer
        return f"<think>\n{self.reasoning}\n</think>\n\n{self.answer}"

    @property
    def message_dicts(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]

    @property
    def template_kwargs(self) -> dict[str, bool]:
        """Extra chat-template kwargs; empty when the template default applies."""
        if self.enable_thinking is None:
            return {}
        return {"enable_thinking": self.enable_thinking}


def scripts_text() -> str:
    """The raw scripts.json content (part of the build recipe's cache key)."""
    return SCRIPTS_PATH.read_text(encoding="utf-8")


def parse_scripts(text: str) -> list[Script]:
    """Parse and validate scripts.json content; raises ValueError naming the script."""
    entries = json.loads(text)["scripts"]
    scripts = [_parse_one(entry) for entry in entries]
    ids = [s.id for s in scripts]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"duplicate script ids: {duplicates}")
    return scripts


@lru_cache(maxsize=1)
def _cached_scripts() -> tuple[Script, ...]:
    return tuple(parse_scripts(scripts_text()))


def load_scripts() -> list[Script]:
    return list(_cached_scripts())


def script(id: str) -> Script:
    for s in _cached_scripts():
        if s.id == id:
            return s
    known = ", ".join(s.id for s in _cached_scripts())
    raise KeyError(f"no script {id!r}; known scripts: {known}")


def _parse_one(entry: dict[str, Any]) -> Script:
    sid = entry.get("id")
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"script without an id: {entry!r}")

    def fail(why: str) -> ValueError:
        return ValueError(f"script {sid!r}: {why}")

    kind = entry.get("kind")
    answer = entry.get("answer")
    reasoning = entry.get("reasoning")
    enable_thinking = entry.get("enable_thinking")
    prompt = entry.get("prompt")
    messages = tuple(
        Message(role=m.get("role"), content=m.get("content")) for m in entry.get("messages", [])
    )
    if not isinstance(answer, str) or not answer:
        raise fail("answer must be a non-empty string")
    if reasoning is not None and (not isinstance(reasoning, str) or not reasoning):
        raise fail("reasoning must be a non-empty string or null")
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise fail("enable_thinking must be true, false or null")
    if kind == "chat":
        if prompt is not None or not messages:
            raise fail("a chat script has messages and no prompt")
        if any(m.role not in _ROLES or not isinstance(m.content, str) for m in messages):
            raise fail(f"message roles must be in {sorted(_ROLES)} with string content")
        if messages[-1].role != "user":
            raise fail("the last message must come from the user")
        if enable_thinking is False and reasoning is not None:
            raise fail("enable_thinking false leaves no room for reasoning")
    elif kind == "completion":
        if not isinstance(prompt, str) or not prompt or messages:
            raise fail("a completion script has a prompt and no messages")
        if reasoning is not None or enable_thinking is not None:
            raise fail("a completion script has no reasoning and no enable_thinking")
    else:
        raise fail(f"kind must be 'chat' or 'completion', not {kind!r}")
    return Script(
        id=sid,
        kind=kind,
        description=str(entry.get("description", "")),
        messages=messages,
        enable_thinking=enable_thinking,
        prompt=prompt,
        reasoning=reasoning,
        answer=answer,
    )
