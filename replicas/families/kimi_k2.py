"""Kimi K2 (Moonshot): a section of calls, each `functions.NAME:IDX` then its JSON
arguments (the `kimi_k2` tool format, mlx-lm 0.32's `kimi_k2` parser is the reference);
K2 Thinking reasons in `<think>` tags.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import THINK_TAGS
from replicas.families.tool_format import CallGrammar, Syntax, ToolFormat

__all__ = ["FAMILY", "KIMI_K2"]

_KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_KIMI_CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
_KIMI_ARGS = "<|tool_call_argument_begin|>"
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

# Kimi K2's template: the tools declared as JSON in a `tool_declare` system turn, calls in a
# section of <|tool_call_begin|>ID<|tool_call_argument_begin|>JSON<|tool_call_end|>, the ID
# being `functions.NAME:IDX` (an id in another shape is written in that one), results as a
# `tool` turn starting "## Return of ID".
TEMPLATE = ModelTemplate(
    special=("[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
             "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
             "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
             "<|tool_call_end|>"),
    eos=("<|im_end|>", "[EOS]"),
    pad="[PAD]",
    bos="[BOS]",
    favoured=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
              "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    seed=5,
    chat_template=r"""{%- if tools -%}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' -}}{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and message.role != 'system' -%}{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}{%- endif -%}
{%- if message.role == 'user' -%}{{- '<|im_user|>user<|im_middle|>' -}}
{%- elif message.role == 'assistant' -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- else -%}{{- '<|im_system|>' + message.role + '<|im_middle|>' -}}{%- endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{{- message.content or '' -}}
{{- '<|tool_calls_section_begin|>' -}}
{%- for call in message.tool_calls -%}
{%- set id = call.id if call.id.startswith('functions.') else 'functions.' + call.function.name + ':' + (loop.index0 | string) -%}
{%- set arguments = call.function.arguments -%}
{{- '<|tool_call_begin|>' + id + '<|tool_call_argument_begin|>' + (arguments if arguments is string else arguments | tojson) + '<|tool_call_end|>' -}}
{%- endfor -%}
{{- '<|tool_calls_section_end|>' -}}
{%- elif message.role == 'tool' -%}
{{- '## Return of ' + message.tool_call_id + '\n' + message.content -}}
{%- else -%}
{{- message.content -}}
{%- endif -%}
{{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}
""",
)

FAMILY = Family("kimi_k2", reasoning=THINK_TAGS, tools=KIMI_K2, template=TEMPLATE)
