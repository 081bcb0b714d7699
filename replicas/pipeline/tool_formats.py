"""Tool-call formats as data, and their composition with a channel format.

A tool format says how a model marks a call in its answer (`call_open`, an optional
`call_close`) and how the text inside reads (`syntax`). `with_tools(channel_format,
tool_format)` adds `Channel.TOOL` states to a channel format, so the router that keeps
reasoning apart from the answer also cuts out each call; `tool_calls.py` turns a call's
text into events. Markup inside reasoning is never a call: open rules go on answer states
only (Harmony: a header naming a `to=functions.NAME` recipient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from replicas.contract import Channel
from replicas.pipeline.channel_formats import ByHeader, ChannelFormat, Rule, State
from replicas.pipeline.channels import detect_format

__all__ = [
    "TOOL_FORMATS",
    "Syntax",
    "ToolFormat",
    "detect_tool_format",
    "get_tool_format",
    "with_tools",
]


class Syntax(str, Enum):
    NONE = "none"  # no calls
    JSON = "json"  # call objects {"name": ..., "arguments": {...}}
    XML = "xml"  # Qwen3-Coder: <function=NAME><parameter=P>VALUE</parameter></function>
    RAW = "raw"  # Harmony: the message body is the arguments, the header names the call


@dataclass(frozen=True)
class ToolFormat:
    name: str
    syntax: Syntax
    # The literal text that opens a call (the grammar's trigger); None for Harmony, where
    # a header's recipient does.
    call_open: str | None = None
    call_close: str | None = None  # ends one call; without it a call runs to the end
    # Opens a call only where it starts the answer; the marker is also the call's first text.
    bare_open: str | None = None
    args_keys: tuple[str, ...] = ("arguments",)  # JSON: keys that hold the arguments
    separator: str | None = None  # JSON: between call objects after one marker
    lists: bool = False  # JSON: the calls may come as one list [{...}, {...}]
    named: str | None = None  # JSON: "NAME<named>{args}" is a call too (Mistral's [ARGS])
    # Texts that identify the format when all are in a chat template or a vocabulary.
    signature: tuple[str, ...] = ()


NONE_TOOLS = ToolFormat(name="none", syntax=Syntax.NONE)
HERMES = ToolFormat(
    name="hermes",
    syntax=Syntax.JSON,
    call_open="<tool_call>",
    call_close="</tool_call>",
    signature=("<tool_call>",),
)
QWEN3_CODER = ToolFormat(
    name="qwen3_coder",
    syntax=Syntax.XML,
    call_open="<tool_call>",
    call_close="</tool_call>",
    signature=("<tool_call>", "<function=", "<parameter="),
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    syntax=Syntax.JSON,
    call_open="<|python_tag|>",
    bare_open='{"name"',
    args_keys=("parameters", "arguments"),
    separator=";",
    signature=("<|python_tag|>",),
)
MISTRAL = ToolFormat(
    name="mistral",
    syntax=Syntax.JSON,
    call_open="[TOOL_CALLS]",
    lists=True,
    named="[ARGS]",
    signature=("[TOOL_CALLS]",),
)
HARMONY_TOOLS = ToolFormat(
    name="harmony",
    syntax=Syntax.RAW,
    signature=("<|channel|>", "to=functions"),
)

# Detection order: the more specific signature first (Qwen3-Coder's template also holds
# "<tool_call>"); "none" always matches last.
TOOL_FORMATS: Mapping[str, ToolFormat] = MappingProxyType(
    {
        fmt.name: fmt
        for fmt in (HARMONY_TOOLS, QWEN3_CODER, HERMES, LLAMA3_JSON, MISTRAL, NONE_TOOLS)
    }
)


def get_tool_format(name: str) -> ToolFormat:
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        valid = ", ".join(sorted(TOOL_FORMATS))
        raise ValueError(f"unknown tool format {name!r}; valid formats: {valid}") from None


def detect_tool_format(chat_template: str | None, vocab: Collection[str]) -> str:
    """The first tool format whose signature texts are all in the vocab or the template;
    a model whose channel format is Harmony uses Harmony's tool calls."""
    template = chat_template or ""
    if detect_format(chat_template, vocab) == "harmony":
        return HARMONY_TOOLS.name
    for name, fmt in TOOL_FORMATS.items():
        if fmt.signature and all(t in vocab or t in template for t in fmt.signature):
            return name
    return NONE_TOOLS.name


TOOL_STATE = "tool"
BETWEEN_STATE = "tool_between"

# Composed formats, by (channel format, tool format) name; the stored base is compared by
# identity so a different format object of the same name is composed afresh.
_COMPOSED: dict[tuple[str, str], tuple[ChannelFormat, ChannelFormat]] = {}


def with_tools(fmt: ChannelFormat, tools: ToolFormat) -> ChannelFormat:
    """`fmt` with `tools`' calls as TOOL states (cached; `fmt` itself for `none`)."""
    if tools.syntax is Syntax.NONE or fmt.name.endswith(f"+{tools.name}"):
        return fmt
    key = (fmt.name, tools.name)
    hit = _COMPOSED.get(key)
    if hit is not None and hit[0] is fmt:
        return hit[1]
    composed = _by_header(fmt) if tools.syntax is Syntax.RAW else _by_marker(fmt, tools)
    _COMPOSED[key] = (fmt, composed)
    return composed


def _by_marker(fmt: ChannelFormat, tools: ToolFormat) -> ChannelFormat:
    """Answer states gain the open rules; a close leads to a state where whitespace is
    dropped and only another call, or (malformed output) answer text, may follow."""
    assert tools.call_open is not None
    opens = [Rule(tools.call_open, TOOL_STATE)]
    if tools.bare_open is not None:
        opens.append(Rule(tools.bare_open, TOOL_STATE, at_start=True))
    states = {
        name: (
            dataclasses.replace(state, rules=(*state.rules, *opens))
            if state.channel is Channel.ANSWER
            else state
        )
        for name, state in fmt.states.items()
    }
    # A second open inside a call starts the next call (Mistral writes one marker per call).
    tool_rules = [Rule(tools.call_open, TOOL_STATE)]
    if tools.call_close is not None:
        tool_rules.append(Rule(tools.call_close, BETWEEN_STATE))
        states[BETWEEN_STATE] = State(
            Channel.ANSWER, tuple(opens), strip_leading_whitespace=True
        )
    states[TOOL_STATE] = State(Channel.TOOL, tuple(tool_rules))
    return _derived(fmt, tools, states)


def _by_header(fmt: ChannelFormat) -> ChannelFormat:
    """Harmony: a header with a `to=functions.NAME` recipient opens a TOOL message that
    ends like any other message (the rules of the header's default state, minus the ones
    that swallow stray markers in place)."""
    states: dict[str, State] = {}
    default: str | None = None
    for name, state in fmt.states.items():
        rules = []
        for rule in state.rules:
            if isinstance(rule.to, ByHeader):
                default = rule.to.default
                rule = dataclasses.replace(rule, to=dataclasses.replace(rule.to, calls=TOOL_STATE))
            rules.append(rule)
        states[name] = dataclasses.replace(state, rules=tuple(rules))
    if default is None:
        raise ValueError(f"harmony tool calls need a format with headers, not {fmt.name!r}")
    message_end = tuple(r for r in fmt.states[default].rules if r.to != default)
    states[TOOL_STATE] = State(Channel.TOOL, message_end)
    return _derived(fmt, HARMONY_TOOLS, states)


def _derived(fmt: ChannelFormat, tools: ToolFormat, states: dict[str, State]) -> ChannelFormat:
    return ChannelFormat(
        name=f"{fmt.name}+{tools.name}",
        states=states,
        answer_state=fmt.answer_state,
        reasoning_state=fmt.reasoning_state,
        reasoning_end=fmt.reasoning_end,
        prompt_states=fmt.prompt_states,
        signature=fmt.signature,
    )
