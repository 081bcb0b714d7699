"""The scripted prompts the built-in tiny model memorizes, loaded from scripts.json."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, Literal

from replicas.contract import ToolCall, ToolSpec

SCRIPTS_PATH = Path(__file__).with_name("scripts.json")

ScriptKind = Literal["chat", "completion"]
_ROLES = frozenset({"system", "user", "assistant", "tool"})
# One call exactly as the chat template writes it (and so as the model learns to).
_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def call_markup(name: str, arguments: str) -> str:
    """A call as the template renders it; `arguments` is JSON text in `json.dumps` style."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # assistant turns
    tool_call_id: str | None = None  # tool turns
    name: str | None = None  # tool turns

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI chat wire shape (call arguments as JSON text)."""
        entry: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            entry["name"] = self.name
        return entry

    def template_dict(self) -> dict[str, Any]:
        """The shape transformers' chat templates take: call arguments as a dict."""
        entry = self.as_dict()
        for call in entry.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        return entry


@dataclass(frozen=True)
class Script:
    """One prompt and the exact text the tiny model generates for it (then eos).

    `enable_thinking` is None when the chat template default applies (no kwarg is
    passed). `prompt` is set only for completions, `messages` only for chats. `tools`
    are offered to the model; an answer may end in calls written as the template does.
    """

    id: str
    kind: ScriptKind
    description: str
    messages: tuple[Message, ...]
    enable_thinking: bool | None
    prompt: str | None
    reasoning: str | None
    answer: str
    tools: tuple[ToolSpec, ...] = ()

    @property
    def expected_text(self) -> str:
        """The generated text, without the trailing `<|im_end|>` eos token."""
        if self.reasoning is None:
            return self.answer
        return f"<think>\n{self.reasoning}\n</think>\n\n{self.answer}"

    @property
    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages in the OpenAI chat wire shape."""
        return [m.as_dict() for m in self.messages]

    @property
    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as `apply_chat_template` takes them."""
        return [m.template_dict() for m in self.messages]

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        """OpenAI function tools, also the shape `apply_chat_template(tools=...)` takes."""
        return [tool_dict(t) for t in self.tools]

    @property
    def template_kwargs(self) -> dict[str, bool]:
        """Extra chat-template kwargs; empty when the template default applies."""
        if self.enable_thinking is None:
            return {}
        return {"enable_thinking": self.enable_thinking}

    @property
    def answer_text(self) -> str:
        """The answer's text before its tool calls, without the "\\n" that separates them
        (the content an assistant message with these calls carries)."""
        head, marker, _ = self.answer.partition("<tool_call>")
        return head[:-1] if marker and head else head

    @property
    def expected_calls(self) -> tuple[tuple[str, str], ...]:
        """(name, arguments JSON text) of each call the answer makes, in order."""
        calls = [json.loads(body) for body in _CALL_RE.findall(self.answer)]
        return tuple(
            (c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls
        )


@dataclass(frozen=True)
class Rendering:
    """One prompt the serving path renders for a script, and the exact text the model
    generates for it (then eos).

    A chat template has two renderings of a chat: thinking on (no `enable_thinking`
    kwarg, the template default, and `enable_thinking: true` render the same prompt) and
    thinking off (the prompt ends with the empty think block). A script's own rendering
    is the one its `enable_thinking` names; `renderings()` adds the other one, so every
    API reaches the script whatever it renders (see README.md, "Every rendering").
    """

    script: Script
    enable_thinking: bool | None  # the kwarg passed; None passes none (template default)
    text: str  # the generated text, without the eos
    derived: bool = False  # the other rendering, not the one the script names

    @property
    def thinking(self) -> bool:
        """Whether the prompt leaves the model room to think (no empty think block)."""
        return self.enable_thinking is not False

    @property
    def label(self) -> str:
        """The script id, plus the rendering for the one the script does not name."""
        if not self.derived:
            return self.script.id
        return f"{self.script.id}@thinking-{'on' if self.thinking else 'off'}"

    @property
    def template_kwargs(self) -> dict[str, bool]:
        if self.enable_thinking is None:
            return {}
        return {"enable_thinking": self.enable_thinking}

    def key(self) -> tuple[Any, ...]:
        """What decides the prompt: the same key renders the same prompt ids."""
        s = self.script
        return (s.kind, s.messages, s.prompt, s.tools, self.thinking)


def own_rendering(s: Script) -> Rendering:
    """The rendering the script names (its `enable_thinking`), with `expected_text`."""
    return Rendering(s, s.enable_thinking, s.expected_text)


def other_rendering(s: Script) -> Rendering | None:
    """A chat script's other rendering: thinking off answers `answer` alone (no reasoning,
    no think block); thinking on, for a script that names thinking off, answers the same
    `answer` without reasoning (the script has none). Completions have no other."""
    if s.kind != "chat":
        return None
    if s.enable_thinking is False:
        return Rendering(s, None, s.answer, derived=True)
    return Rendering(s, False, s.answer, derived=True)


def renderings(scripts: Sequence[Script]) -> list[Rendering]:
    """Every rendering the model is trained and verified on, script by script: its own,
    then its other one unless another script names that prompt as its own (that script
    answers it: `riddle-nothink` answers `riddle-think` with thinking off, and
    `riddle-think` answers `riddle-nothink`'s messages with thinking on)."""
    owned = {own_rendering(s).key(): s.id for s in scripts}
    result: list[Rendering] = []
    for s in scripts:
        result.append(own_rendering(s))
        other = other_rendering(s)
        if other is not None and other.key() not in owned:
            result.append(other)
    return result


def tool_dict(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = json.loads(tool.parameters)
    return {"type": "function", "function": function}


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
    owners: dict[tuple[Any, ...], str] = {}
    for s in scripts:
        other = owners.setdefault(own_rendering(s).key(), s.id)
        if other != s.id:
            raise ValueError(f"scripts {other!r} and {s.id!r} render the same prompt "
                             "(messages, tools and thinking on or off)")
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
    try:
        messages = tuple(_message(m) for m in entry.get("messages", []))
        tools = tuple(_tool(t) for t in entry.get("tools", []))
    except (AttributeError, KeyError, TypeError) as exc:
        raise fail(f"malformed message or tool: {exc!r}") from exc
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
        if messages[-1].role not in ("user", "tool"):
            raise fail("the last message must come from the user or a tool")
        if enable_thinking is False and reasoning is not None:
            raise fail("enable_thinking false leaves no room for reasoning")
        _check_tools(messages, tools, answer, fail)
    elif kind == "completion":
        if not isinstance(prompt, str) or not prompt or messages:
            raise fail("a completion script has a prompt and no messages")
        if reasoning is not None or enable_thinking is not None:
            raise fail("a completion script has no reasoning and no enable_thinking")
        if tools:
            raise fail("a completion script has no tools")
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
        tools=tools,
    )


def _message(m: dict[str, Any]) -> Message:
    # In scripts.json call arguments are JSON objects; they become `json.dumps` text,
    # the spacing the template's `tojson` writes.
    calls = tuple(
        ToolCall(c["id"], c["function"]["name"],
                 json.dumps(c["function"]["arguments"], ensure_ascii=False))
        for c in m.get("tool_calls", [])
    )
    return Message(m["role"], m["content"], calls, m.get("tool_call_id"), m.get("name"))


def _tool(t: dict[str, Any]) -> ToolSpec:
    if t.get("type") != "function":
        raise TypeError(f"tool type must be 'function', not {t.get('type')!r}")
    f = t["function"]
    return ToolSpec(f["name"], f.get("description"), json.dumps(f["parameters"]))


def _check_tools(
    messages: tuple[Message, ...], tools: tuple[ToolSpec, ...], answer: str,
    fail: Callable[[str], ValueError],
) -> None:
    names = {t.name for t in tools}
    call_ids: set[str] = set()
    for m in messages:
        if m.tool_calls and m.role != "assistant":
            raise fail("only assistant messages make tool calls")
        for call in m.tool_calls:
            if call.name not in names or call.id in call_ids:
                raise fail(f"call {call.id!r} names an unknown tool or repeats an id")
            if not isinstance(json.loads(call.arguments), dict):
                raise fail(f"call {call.id!r} arguments must be a JSON object")
            call_ids.add(call.id)
        if m.role == "tool" and (m.tool_call_id not in call_ids or m.name not in names):
            raise fail("a tool message answers an earlier call, by id and tool name")
    if "<tool_call>" not in answer:
        return
    head, _, calls = answer.partition("<tool_call>")
    bodies = _CALL_RE.findall(answer)
    try:
        parsed = [json.loads(body) for body in bodies]
        rendered = [call_markup(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                    for c in parsed]
    except (ValueError, KeyError, TypeError) as exc:
        raise fail(f"a tool call in the answer is not valid JSON: {exc}") from exc
    # Calls come last, joined by "\n", written exactly as the template renders them.
    if "<tool_call>" + calls != "\n".join(rendered):
        raise fail("tool calls must end the answer, joined by newlines, in template form")
    if any(c["name"] not in names for c in parsed):
        raise fail("the answer calls a tool the script does not offer")
    if head and not head.endswith("\n"):
        raise fail("text before a tool call ends with a newline")
