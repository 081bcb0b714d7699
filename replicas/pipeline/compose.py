"""Composition of a channel format with a tool format, per request: the router then
separates reasoning, answer and calls in one pass.

`with_tools(channel_format, tool_format)` adds `Channel.TOOL` states to a channel format, so
the router that keeps reasoning apart from the answer also cuts out each call;
`tool_calls/parser.py` turns a call's text into events. Markup inside reasoning is never a
call: open rules go on answer states only (Harmony: a header naming a `to=functions.NAME`
recipient). `without_calls(channel_format, tool_format)` is the `tool_choice: none` side:
the answer drops every `reserved` marker of the tool format. Both read only the formats'
data (`replicas/families/`), never a format's name.
"""

from __future__ import annotations

import dataclasses

from replicas.contract import Channel
from replicas.families.channel_format import ByHeader, ChannelFormat, Rule, State
from replicas.families.tool_format import Syntax, ToolFormat

__all__ = ["with_tools", "without_calls"]


TOOL_STATE = "tool"
BETWEEN_STATE = "tool_between"

# Composed formats, by (channel format, tool format) name ("-NAME": `without_calls`); the
# stored base is compared by identity so a different format object of the same name is
# composed afresh.
_COMPOSED: dict[tuple[str, str], tuple[ChannelFormat, ChannelFormat]] = {}


def with_tools(fmt: ChannelFormat, tools: ToolFormat) -> ChannelFormat:
    """`fmt` with `tools`' calls as TOOL states (cached; `fmt` itself for `none`)."""
    if tools.syntax is Syntax.NONE or fmt.name.endswith(f"+{tools.name}"):
        return fmt
    key = (fmt.name, tools.name)
    hit = _COMPOSED.get(key)
    if hit is not None and hit[0] is fmt:
        return hit[1]
    composed = _by_header(fmt, tools) if tools.syntax is Syntax.RAW else _by_marker(fmt, tools)
    _COMPOSED[key] = (fmt, composed)
    return composed


def without_calls(fmt: ChannelFormat, tools: ToolFormat) -> ChannelFormat:
    """`fmt` whose answer states swallow every reserved marker of `tools` (cached), for
    `tool_choice: none`: the text guarantee behind the token ban, for a marker the vocab
    spells with several tokens or one the model spells out. Reasoning keeps its text."""
    key = (fmt.name, f"-{tools.name}")
    hit = _COMPOSED.get(key)
    if hit is not None and hit[0] is fmt:
        return hit[1]
    states = {}
    for name, state in fmt.states.items():
        own = {rule.marker for rule in state.rules}  # already a marker here (Harmony's)
        swallow = tuple(Rule(m, name) for m in tools.reserved if m not in own)
        if state.channel is Channel.ANSWER and swallow:
            state = dataclasses.replace(state, rules=(*state.rules, *swallow))
        states[name] = state
    suppressed = fmt if states == dict(fmt.states) else dataclasses.replace(
        fmt, name=f"{fmt.name}-{tools.name}", states=states)
    _COMPOSED[key] = (fmt, suppressed)
    return suppressed


def _by_marker(fmt: ChannelFormat, tools: ToolFormat) -> ChannelFormat:
    """Answer states gain the open rules; a close leads to a state where whitespace is
    dropped and only another call, or (malformed output) answer text, may follow."""
    assert tools.call_open is not None
    opens = [Rule(tools.call_open, TOOL_STATE)]
    if tools.bare_open is not None:
        opens.append(Rule(tools.bare_open, TOOL_STATE, at_start=True))
    states = {
        name: (
            # Section markers re-enter the state they are in: dropped, nothing else.
            dataclasses.replace(state, rules=(*state.rules, *opens,
                                              *(Rule(m, name) for m in tools.section)))
            if state.channel is Channel.ANSWER
            else state
        )
        for name, state in fmt.states.items()
    }
    # A second open inside a call starts the next call (Mistral writes one marker per call).
    tool_rules = [Rule(tools.call_open, TOOL_STATE)]
    if tools.call_close is not None:
        tool_rules.append(Rule(tools.call_close, BETWEEN_STATE))
        # Markers the answer swallows in place (Kimi K3's message end) stay swallowed here.
        drops = dict.fromkeys(
            [*tools.section, *(r.marker for name, state in fmt.states.items()
                               if state.channel is Channel.ANSWER
                               for r in state.rules if r.to == name)])
        states[BETWEEN_STATE] = State(
            Channel.ANSWER, (*opens, *(Rule(m, BETWEEN_STATE) for m in drops
                                       if m not in {o.marker for o in opens})),
            strip_leading_whitespace=True,
        )
    states[TOOL_STATE] = State(Channel.TOOL, tuple(tool_rules))
    return _derived(fmt, tools, states)


def _by_header(fmt: ChannelFormat, tools: ToolFormat) -> ChannelFormat:
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
        raise ValueError(f"{tools.name} tool calls need a format with headers, not {fmt.name!r}")
    message_end = tuple(r for r in fmt.states[default].rules if r.to != default)
    states[TOOL_STATE] = State(Channel.TOOL, message_end)
    return _derived(fmt, tools, states)


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
