"""Tool-call formats as data, one entry each, and their composition with a channel format.

An entry holds everything the replica needs to know about one family's calls: how a
model marks a call in its answer (`call_open`, an optional `call_close`), how the text
inside reads (`syntax` and the JSON knobs), how to detect the family (`signature`,
`channel_format`) and how the tool grammar writes a call (`grammar`, read by
`guided/tools.py`; data only, so this package never imports llguidance). A new format is
one entry in `TOOL_FORMATS` plus its tests.

`with_tools(channel_format, tool_format)` adds `Channel.TOOL` states to a channel format, so
the router that keeps reasoning apart from the answer also cuts out each call;
`tool_calls.py` turns a call's text into events. Markup inside reasoning is never a call:
open rules go on answer states only (Harmony: a header naming a `to=functions.NAME`
recipient). `without_calls(channel_format, tool_format)` is the `tool_choice: none` side:
the answer drops every `reserved` marker of the format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from types import MappingProxyType

from replicas.contract import Channel
from replicas.pipeline.channel_formats import ByHeader, ChannelFormat, Rule, State
from replicas.pipeline.channels import detect_format
from replicas.pipeline.harmony import END as HARMONY_END
from replicas.pipeline.tool_families import GLM47, KIMI_K2, MINIMAX_M2, PYTHONIC
from replicas.pipeline.tool_families_deepseek import DEEPSEEK_V31
from replicas.pipeline.tool_families_gemma import FUNCTION_GEMMA, GEMMA4
from replicas.pipeline.tool_families_tagged import KIMI_K3, LONGCAT, MINICPM5, MUSE_SPARK
from replicas.pipeline.tool_syntax import (
    CallGrammar,
    GemmaTags,
    KeyValueTags,
    ParamLayout,
    Syntax,
    ToolFormat,
    XmlTags,
)

__all__ = [
    "TOOL_FORMATS",
    "CallGrammar",
    "GemmaTags",
    "KeyValueTags",
    "ParamLayout",
    "Syntax",
    "ToolFormat",
    "XmlTags",
    "detect_tool_format",
    "get_tool_format",
    "with_tools",
    "without_calls",
]


NONE_TOOLS = ToolFormat(name="none", syntax=Syntax.NONE)
# Hermes and Qwen3-Coder share their delimiters and the tool-result wrapper of the template.
HERMES_RESERVED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen3 / Hermes: every call wrapped in its own tags, calls joined by one newline.
HERMES = ToolFormat(
    name="hermes",
    syntax=Syntax.JSON,
    call_open="<tool_call>",
    call_close="</tool_call>",
    signature=("<tool_call>",),
    grammar=CallGrammar(
        trigger="<tool_call>",
        head='<tool_call>\n{"name": "{name}", "arguments": ',
        tail="}\n</tool_call>",
        sep="\n",
        markers=("<tool_call>", "</tool_call>"),
    ),
    reserved=HERMES_RESERVED,
)
# Qwen3-Coder: XML parameters, one `<parameter=KEY>` block per argument (guided/tool_params).
QWEN3_CODER = ToolFormat(
    name="qwen3_coder",
    syntax=Syntax.XML,
    call_open="<tool_call>",
    call_close="</tool_call>",
    signature=("<tool_call>", "<function=", "<parameter="),
    grammar=CallGrammar(
        trigger="<tool_call>",
        head="<tool_call>\n<function={name}>\n",
        tail="</function>\n</tool_call>",
        sep="\n",
        markers=("<tool_call>", "</tool_call>"),
        params=ParamLayout(open="<parameter={key}>\n", close="\n</parameter>", after="\n"),
    ),
    reserved=HERMES_RESERVED,
)
# Llama 3.1+ JSON tool calling; parallel calls joined by "; " as vLLM's parser reads them.
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    syntax=Syntax.JSON,
    call_open="<|python_tag|>",
    bare_open='{"name"',
    args_keys=("parameters", "arguments"),
    separator=";",
    signature=("<|python_tag|>",),
    grammar=CallGrammar(
        trigger="<|python_tag|>",
        open="<|python_tag|>",
        head='{"name": "{name}", "parameters": ',
        tail="}",
        sep="; ",
        markers=("<|python_tag|>",),
    ),
    reserved=("<|python_tag|>",),  # results come back as an `ipython` turn: no marker of their own
)
# Mistral: one JSON array of calls after the marker (the grammar writes that form).
MISTRAL = ToolFormat(
    name="mistral",
    syntax=Syntax.JSON,
    call_open="[TOOL_CALLS]",
    lists=True,
    named="[ARGS]",
    signature=("[TOOL_CALLS]",),
    grammar=CallGrammar(
        trigger="[TOOL_CALLS]",
        open="[TOOL_CALLS][",
        head='{"name": "{name}", "arguments": ',
        tail="}",
        sep=", ",
        close="]",
        markers=("[TOOL_CALLS]",),
    ),
    reserved=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
)
# gpt-oss: the grammar covers the whole completion after the prompt's
# `<|start|>assistant`: an optional analysis message, then the final message or one
# call (`<|call|>` ends the turn). The encoder writes the recipient after the role
# (` to=functions.x<|channel|>commentary ...`); models also write it after the channel.
HARMONY_TOOLS = ToolFormat(
    name="harmony",
    syntax=Syntax.RAW,
    signature=("<|channel|>", "to=functions"),
    channel_format="harmony",
    grammar=CallGrammar(
        trigger="<|channel|>",
        head="<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
        alt_heads=(" to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>",),
        tail="<|call|>",
        markers=("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>",
                 "<|end|>"),
        text_open="<|channel|>final<|message|>",
        preamble=("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant"),
        start="reasoning_end",
        forced_end=HARMONY_END,
    ),
    # Only `<|call|>` is the calls' own: every other Harmony marker also frames plain
    # messages (and the channel format already keeps them all out of the answer).
    reserved=("<|call|>",),
)

# Detection order: the more specific signature first (GLM's and Qwen3-Coder's templates
# also hold "<tool_call>"), otherwise mlx-lm's `_infer_tool_parser` order; "none" always
# matches last. Harmony and Kimi K3 go by their channel format. DeepSeek V3.1 (no mlx-lm
# parser) shares no signature text with another family, so its place is free.
TOOL_FORMATS: Mapping[str, ToolFormat] = MappingProxyType(
    {
        fmt.name: fmt
        for fmt in (HARMONY_TOOLS, KIMI_K3, MINIMAX_M2, GEMMA4, FUNCTION_GEMMA, LONGCAT, KIMI_K2,
                    DEEPSEEK_V31, GLM47, PYTHONIC, QWEN3_CODER, MINICPM5, MUSE_SPARK, HERMES,
                    LLAMA3_JSON, MISTRAL, NONE_TOOLS)
    }
)


def get_tool_format(name: str) -> ToolFormat:
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        valid = ", ".join(sorted(TOOL_FORMATS))
        raise ValueError(f"unknown tool format {name!r}; valid formats: {valid}") from None


def detect_tool_format(chat_template: str | None, vocab: Collection[str]) -> str:
    """The tool format tied to the model's channel format if one is (Harmony, Kimi K3's
    XTML), else the
    first whose signature texts are all in the vocab or the template."""
    template = chat_template or ""
    channel_format = detect_format(chat_template, vocab)
    for name, fmt in TOOL_FORMATS.items():
        if fmt.channel_format == channel_format:
            return name
    for name, fmt in TOOL_FORMATS.items():
        if fmt.signature and all(t in vocab or t in template for t in fmt.signature):
            return name
    return NONE_TOOLS.name


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
