"""LongCat (Meituan): GLM's key/value calls with LongCat's own tags (the `longcat` tool
format, mlx-lm 0.32's `longcat` parser is the reference), reasoning in
`<longcat_think>` ... `</longcat_think>` (`longcat_think`).
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import tagged_reasoning
from replicas.families.tool_format import KeyValueTags
from replicas.families.tool_layouts import key_value_format

__all__ = ["FAMILY", "LONGCAT", "LONGCAT_THINK"]

LONGCAT_THINK = tagged_reasoning("longcat_think", "<longcat_think>", "</longcat_think>",
                                 signature=("<longcat_think>", "</longcat_think>"))

#   <longcat_tool_call>NAME<longcat_arg_key>K</longcat_arg_key>
#   <longcat_arg_value>V</longcat_arg_value></longcat_tool_call>
LONGCAT = key_value_format(
    "longcat", ("<longcat_tool_call>", "</longcat_tool_call>"),
    KeyValueTags("<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>",
                 "</longcat_arg_value>"),
    ("<longcat_tool_call>",))

_LONGCAT_CALL = ("<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>",
                 "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>")
# [Round N] USER:/ASSISTANT: turns, the tools as JSON in the system part, a call as GLM's
# key/value layout with LongCat's own tags, results in <longcat_tool_response>. The turns
# around the markup are a minimal reconstruction (its tokens, its call and result markup).
TEMPLATE = ModelTemplate(
    special=("<longcat_s>", "</longcat_s>", "<longcat_pad>", *_LONGCAT_CALL,
             "<longcat_tool_response>", "</longcat_tool_response>", "<longcat_tool_declare>",
             "</longcat_tool_declare>"),
    eos=("</longcat_s>",),
    pad="<longcat_pad>",
    bos="<longcat_s>",
    favoured=_LONGCAT_CALL,
    seed=11,
    chat_template=r"""{{- bos_token -}}
{%- set ns = namespace(round=0) -%}
{%- set loop_messages = messages -%}
{%- if tools or messages[0].role == 'system' -%}
{{- 'SYSTEM:' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}
{%- if tools -%}
{{- '\n\n## Tools\nYou have access to the following tools:\n<longcat_tool_declare>\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '</longcat_tool_declare>\n\nFor each function call, write the function name and its arguments in this format:\n<longcat_tool_call>{function-name}\n<longcat_arg_key>{arg-key-1}</longcat_arg_key>\n<longcat_arg_value>{arg-value-1}</longcat_arg_value>\n</longcat_tool_call>' -}}
{%- endif -%}
{{- '\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'user' -%}
{{- '[Round ' + (ns.round | string) + '] USER:' + message.content -}}
{%- set ns.round = ns.round + 1 -%}
{%- elif message.role == 'assistant' -%}
{{- ' ASSISTANT:' + message.content -}}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<longcat_tool_call>' + call.name + '\n' -}}
{%- for key, value in call.arguments.items() -%}
{{- '<longcat_arg_key>' + key + '</longcat_arg_key>\n<longcat_arg_value>' + (value if value is string else value | tojson) + '</longcat_arg_value>\n' -}}
{%- endfor -%}
{{- '</longcat_tool_call>' -}}
{%- endfor -%}
{{- '</longcat_s>' -}}
{%- elif message.role == 'tool' -%}
{{- ' TOOL:<longcat_tool_response>' + message.content + '</longcat_tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ' ASSISTANT:' -}}{%- endif -%}
""",
)

FAMILY = Family("longcat", reasoning=LONGCAT_THINK, tools=LONGCAT, template=TEMPLATE)
