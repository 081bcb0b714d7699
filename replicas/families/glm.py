"""GLM-4.5 to 4.7 (Zhipu; and Poolside Laguna, which mlx-lm parses with the same `glm47`):
key/value calls (the `glm47` tool format), reasoning in `<think>` tags.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import THINK_TAGS
from replicas.families.tool_format import KeyValueTags
from replicas.families.tool_layouts import key_value_format

__all__ = ["FAMILY", "GLM47"]

#   <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>
# GLM-4.5 writes newlines between the parts; the parser takes both, the grammar writes
# GLM-4.7's compact form (the reference's). String values are raw text, others JSON.
GLM47 = key_value_format("glm47", ("<tool_call>", "</tool_call>"), KeyValueTags(),
                         ("<tool_call>", "<arg_key>"))  # mlx-lm detects it by `<arg_key>`

_GLM_CALL = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>")
# GLM-4.7's template: the tools as JSON lines in the system turn, a call as
# <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> (strings raw,
# other values JSON), results in <tool_response> after an <|observation|> turn.
TEMPLATE = ModelTemplate(
    special=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
             "<|observation|>", *_GLM_CALL, "<tool_response>", "</tool_response>"),
    eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    pad="<|endoftext|>",
    favoured=_GLM_CALL,
    seed=6,
    chat_template=r"""{{- '[gMASK]<sop>' -}}
{%- if tools -%}
{{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{{- '<|user|>' + message.content -}}
{%- elif message.role == 'system' -%}{{- '<|system|>' + message.content -}}
{%- elif message.role == 'assistant' -%}
{{- '<|assistant|>' + (message.content | trim) -}}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<tool_call>' + call.name -}}
{%- for key, value in call.arguments.items() -%}
{{- '<arg_key>' + key + '</arg_key><arg_value>' + (value if value is string else value | tojson) + '</arg_value>' -}}
{%- endfor -%}
{{- '</tool_call>' -}}
{%- endfor -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
{{- '<tool_response>' + message.content + '</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}
""",
)

FAMILY = Family("glm", reasoning=THINK_TAGS, tools=GLM47, template=TEMPLATE)
