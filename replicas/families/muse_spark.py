"""Muse Spark (XML_ATEM): MiniMax-M2's section layout with `atem:` tags, values JSON when
they parse (the `muse_spark` tool format, mlx-lm 0.32's `muse_spark` parser is the
reference). Its Harmony-like `to=self<|message|>` messages are not a channel format here:
its answer and calls route as `none`.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.tool_format import XmlTags
from replicas.families.tool_layouts import xml_section_format

__all__ = ["FAMILY", "MUSE_SPARK"]

# A value that parses as JSON is that value (a quoted string too), so the grammar writes
# every value as JSON.
#   <atem:function_calls>
#   <atem:invoke name="f">
#   <atem:parameter name="p">"Paris"</atem:parameter>
#   </atem:invoke>
#   </atem:function_calls>
MUSE_SPARK = xml_section_format(
    "muse_spark", ("<atem:function_calls>", "</atem:function_calls>"),
    XmlTags(function="<atem:invoke", function_end="</atem:invoke>", parameter="<atem:parameter",
            parameter_end="</atem:parameter>", name_attr="name", json_values=True),
    "atem:invoke", "atem:parameter")

_MUSE_CALLS = ("<atem:function_calls>", "</atem:function_calls>")
# Header turns, the tools as JSON in the system turn, calls as <atem:invoke> blocks with
# JSON values in one <atem:function_calls> section, results in an <atem:function_results>
# block; a minimal reconstruction around the reference's markup.
TEMPLATE = ModelTemplate(
    special=("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad|>",
             "<|header_start|>", "<|header_end|>", "<|eot|>", *_MUSE_CALLS),
    eos=("<|eot|>", "<|end_of_text|>"),
    pad="<|finetune_right_pad|>",
    bos="<|begin_of_text|>",
    favoured=_MUSE_CALLS,
    seed=13,
    chat_template=r"""{{- bos_token -}}
{%- set loop_messages = messages -%}
{%- if tools or messages[0].role == 'system' -%}
{{- '<|header_start|>system<|header_end|>\n\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}
{%- if tools -%}
{{- '\n\nYou can call these functions:\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '\nTo call them, write:\n<atem:function_calls>\n<atem:invoke name="function_name">\n<atem:parameter name="param_name">JSON value</atem:parameter>\n</atem:invoke>\n</atem:function_calls>' -}}
{%- endif -%}
{{- '<|eot|>' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'tool' -%}
{{- '<|header_start|>tool<|header_end|>\n\n<atem:function_results>\n<atem:result name="' + (message.name or '') + '">' + message.content + '</atem:result>\n</atem:function_results><|eot|>' -}}
{%- else -%}
{{- '<|header_start|>' + message.role + '<|header_end|>\n\n' + message.content -}}
{%- if message.tool_calls -%}
{{- ('\n' if message.content else '') + '<atem:function_calls>\n' -}}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<atem:invoke name="' + call.name + '">\n' -}}
{%- for key, value in call.arguments.items() -%}
{{- '<atem:parameter name="' + key + '">' + (value | tojson) + '</atem:parameter>\n' -}}
{%- endfor -%}
{{- '</atem:invoke>\n' -}}
{%- endfor -%}
{{- '</atem:function_calls>' -}}
{%- endif -%}
{{- '<|eot|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|header_start|>assistant<|header_end|>\n\n' -}}{%- endif -%}
""",
)

FAMILY = Family("muse_spark", tools=MUSE_SPARK, template=TEMPLATE)
