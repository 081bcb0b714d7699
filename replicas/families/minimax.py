"""MiniMax-M2: one `<minimax:tool_call>` section of `<invoke>` blocks (the `minimax_m2`
tool format, mlx-lm 0.32's `minimax_m2` parser is the reference), reasoning in `<think>`
tags.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import THINK_TAGS
from replicas.families.tool_format import XmlTags
from replicas.families.tool_layouts import xml_section_format

__all__ = ["FAMILY", "MINIMAX_M2"]

# Values raw text (JSON when not a string).
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

# MiniMax-M2's template: each tool's JSON in a <tool> line of the system turn, calls as
# <invoke> blocks in one <minimax:tool_call> section, results as <response> in a tool turn.
TEMPLATE = ModelTemplate(
    special=("]!p~[", "]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"),
    eos=("[e~[",),
    pad="]!p~[",
    bos="]~!b[",
    favoured=("<minimax:tool_call>", "</minimax:tool_call>"),
    seed=7,
    chat_template=r"""{%- if messages[0].role == 'system' -%}{%- set system_message = messages[0].content -%}{%- set messages = messages[1:] -%}
{%- else -%}{%- set system_message = 'You are a helpful assistant.' -%}{%- endif -%}
{{- ']~!b[]~b]system\n' + system_message -}}
{%- if tools -%}
{{- '\n\n# Tools\nYou may call one or more tools to assist with the user query.\nHere are the tools available in JSONSchema format:\n\n<tools>\n' -}}
{%- for tool in tools -%}{{- '<tool>' + (tool.function | tojson) + '</tool>\n' -}}{%- endfor -%}
{{- '</tools>\n\nWhen making tool calls, use XML format to invoke tools and pass parameters:\n\n<minimax:tool_call>\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n</minimax:tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- ']~b]ai\n' + message.content -}}
{%- if message.tool_calls -%}
{{- '\n<minimax:tool_call>\n' -}}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<invoke name="' + call.name + '">\n' -}}
{%- for key, value in call.arguments.items() -%}
{{- '<parameter name="' + key + '">' + (value if value is string else value | tojson) + '</parameter>\n' -}}
{%- endfor -%}
{{- '</invoke>\n' -}}
{%- endfor -%}
{{- '</minimax:tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- ']~b]tool' -}}{%- endif -%}
{{- '\n<response>' + message.content + '</response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '[e~[\n' -}}{%- endif -%}
{%- else -%}
{{- ']~b]' + message.role + '\n' + message.content + '[e~[\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\n' -}}{%- endif -%}
""",
)

FAMILY = Family("minimax", reasoning=THINK_TAGS, tools=MINIMAX_M2, template=TEMPLATE)
