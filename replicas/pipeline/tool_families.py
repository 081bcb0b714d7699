"""Tool-call formats of today's coding models, one entry each (registered in
`tool_formats.TOOL_FORMATS`). mlx-lm 0.32's `tool_parsers` are the reference for each
markup: `kimi_k2`, `glm47`, `minimax_m2` and `pythonic`. Their reasoning is `<think>` ...
`</think>`, the existing `think_tags` channel format.
"""

from __future__ import annotations

from replicas.pipeline.tool_syntax import (CallGrammar, KeyValueTags, ParamLayout, Syntax,
                                           ToolFormat, XmlTags)

__all__ = ["GLM47", "KIMI_K2", "MINIMAX_M2", "PYTHONIC", "key_value_format", "xml_section_format"]

_KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_KIMI_CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
_KIMI_ARGS = "<|tool_call_argument_begin|>"
# Kimi K2: a section of calls, each `functions.NAME:IDX` then its JSON arguments.
#   <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
#   {"a": 1}<|tool_call_end|>...<|tool_calls_section_end|>
# Each call is cut out by its own begin/end (as the reference splits them); the section
# markers around them are dropped from the answer.
KIMI_K2 = ToolFormat(
    name="kimi_k2",
    syntax=Syntax.JSON,
    call_open=_KIMI_CALL[0],
    call_close=_KIMI_CALL[1],
    named=_KIMI_ARGS,
    # The reference's `^\s*((?:functions\.)?(.+?):\d+)\s*<|tool_call_argument_begin|>`.
    name_pattern=r"\s*(?:functions\.)?(?P<name>.+?):\d+\s*",
    section=_KIMI_SECTION,
    signature=(_KIMI_SECTION[0],),  # what mlx-lm detects the family by
    grammar=CallGrammar(
        trigger=_KIMI_SECTION[0],
        open=_KIMI_SECTION[0],
        head=f"{_KIMI_CALL[0]}functions.{{name}}:{{index}}{_KIMI_ARGS}",
        tail=_KIMI_CALL[1],
        sep="",  # calls follow each other inside the one section
        close=_KIMI_SECTION[1],
        markers=(*_KIMI_SECTION, *_KIMI_CALL, _KIMI_ARGS),
    ),
    reserved=(*_KIMI_SECTION, *_KIMI_CALL, _KIMI_ARGS),
)


def key_value_format(name: str, call: tuple[str, str], kv: KeyValueTags,
                     signature: tuple[str, ...]) -> ToolFormat:
    """A key/value family (`Syntax.KEY_VALUE`, GLM's layout): `CALL NAME`, then per argument
    `KEY k KEY_END VALUE v VALUE_END`, then `CALL_END`; parallel calls on lines of their own.
    The argument tags are the calls' own markup too (single tokens in the family's vocab)."""
    tags = (kv.key, kv.key_end, kv.value, kv.value_end)
    return ToolFormat(
        name=name,
        syntax=Syntax.KEY_VALUE,
        call_open=call[0],
        call_close=call[1],
        kv=kv,
        signature=signature,
        grammar=CallGrammar(
            trigger=call[0],
            head=f"{call[0]}{{name}}",
            tail=call[1],
            sep="\n",
            markers=(*call, *tags),
            params=ParamLayout(open=f"{kv.key}{{key}}{kv.key_end}{kv.value}", close=kv.value_end),
        ),
        reserved=(*call, *tags),
    )


# GLM-4.5/4.6/4.7 (and Poolside Laguna, which mlx-lm parses with the same `glm47`):
#   <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>
# GLM-4.5 writes newlines between the parts; the parser takes both, the grammar writes
# GLM-4.7's compact form (the reference's). String values are raw text, others JSON.
GLM47 = key_value_format("glm47", ("<tool_call>", "</tool_call>"), KeyValueTags(),
                         ("<tool_call>", "<arg_key>"))  # mlx-lm detects it by `<arg_key>`


def xml_section_format(name: str, section: tuple[str, str], xml: XmlTags, invoke: str,
                       parameter: str) -> ToolFormat:
    """An XML family with one section of calls (MiniMax-M2's layout), a line each:
    `SECTION` `<INVOKE name="f">` `<PARAMETER name="p">v</PARAMETER>`... `</INVOKE>` `SECTION_END`.
    The grammar writes every value as JSON where the reader takes values as JSON
    (`xml.json_values`), else strings raw."""
    return ToolFormat(
        name=name,
        syntax=Syntax.XML,
        call_open=section[0],
        call_close=section[1],
        xml=xml,
        signature=section[:1],
        grammar=CallGrammar(
            trigger=section[0],
            open=f"{section[0]}\n",
            head=f'<{invoke} name="{{name}}">\n',
            tail=f"</{invoke}>",
            sep="\n",  # parallel calls are more invoke blocks in the same section
            close=f"\n{section[1]}",
            markers=section,
            params=ParamLayout(open=f'<{parameter} name="{{key}}">', close=f"</{parameter}>",
                               after="\n", raw_strings=not xml.json_values),
        ),
        reserved=section,
    )


# MiniMax-M2: one section of `<invoke>` blocks, values raw text (JSON when not a string).
#   <minimax:tool_call>
#   <invoke name="f">
#   <parameter name="a">1</parameter>
#   </invoke>
#   </minimax:tool_call>
MINIMAX_M2 = xml_section_format(
    "minimax_m2", ("<minimax:tool_call>", "</minimax:tool_call>"),
    XmlTags(function="<invoke name=", function_end="</invoke>", parameter="<parameter name=",
            parameter_end="</parameter>", quoted=True, strip_values=True),
    "invoke", "parameter")

_PYTHONIC_CALL = ("<|tool_call_start|>", "<|tool_call_end|>")
# Pythonic calls (LFM2): a Python list of keyword-argument calls between the markers.
#   <|tool_call_start|>[get_weather(city="Paris"), ping()]<|tool_call_end|>
# The grammar writes every value as JSON, which the reference reads too (strings quoted,
# `true`/`false`/`null` as the constants).
PYTHONIC = ToolFormat(
    name="pythonic",
    syntax=Syntax.PYTHONIC,
    call_open=_PYTHONIC_CALL[0],
    call_close=_PYTHONIC_CALL[1],
    # mlx-lm detects it by this text in the template, or by both markers in the vocab.
    signature=_PYTHONIC_CALL[:1],
    grammar=CallGrammar(
        trigger=_PYTHONIC_CALL[0],
        open=f"{_PYTHONIC_CALL[0]}[",
        head="{name}(",
        tail=")",
        sep=", ",
        close=f"]{_PYTHONIC_CALL[1]}",
        markers=_PYTHONIC_CALL,
        params=ParamLayout(open="{key}=", close="", sep=", ", raw_strings=False),
    ),
    reserved=_PYTHONIC_CALL,
)
