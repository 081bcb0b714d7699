"""Qwen3-Coder: XML parameters inside Qwen's `<tool_call>` tags (`qwen3_coder`), one
`<parameter=KEY>` block per argument; no reasoning markup. Qwen's tokens and reserved
markers (`qwen.py`).
"""

from __future__ import annotations

from replicas.families.family import Family
from replicas.families.qwen import QWEN_RESERVED, qwen_template
from replicas.families.tool_format import CallGrammar, ParamLayout, Syntax, ToolFormat

__all__ = ["FAMILY", "QWEN3_CODER"]

# The arguments as `<parameter=KEY>` blocks (guided/tool_params.py writes them).
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
    reserved=QWEN_RESERVED,
)

# Qwen3-Coder's template: tools as <function>/<parameter> XML (extra schema keys such as
# `enum` and `required` as their own tags), calls as <function=NAME><parameter=KEY> blocks.
FAMILY = Family("qwen3_coder", tools=QWEN3_CODER, template=qwen_template(
    r"""{%- macro extra_keys(fields, handled) -%}
{%- for key, value in fields.items() if key not in handled -%}
{{- '\n<' + key + '>' + (value | tojson if value is mapping or (value is sequence and value is not string) else value | string) + '</' + key + '>' -}}
{%- endfor -%}
{%- endmacro -%}
{%- if messages[0].role == 'system' -%}{%- set system_message = messages[0].content -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- if system_message is defined -%}{{- '<|im_start|>system\n' + system_message -}}
{%- elif tools -%}{{- '<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.' -}}{%- endif -%}
{%- if tools -%}
{{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
{%- for tool in tools -%}
{%- set tool = tool.function if tool.function is defined else tool -%}
{{- '\n<function>\n<name>' + tool.name + '</name>' -}}
{%- if tool.description is defined -%}{{- '\n<description>' + (tool.description | trim) + '</description>' -}}{%- endif -%}
{{- '\n<parameters>' -}}
{%- for name, fields in (tool.parameters.properties or {}).items() -%}
{{- '\n<parameter>\n<name>' + name + '</name>' -}}
{%- if fields.type is defined -%}{{- '\n<type>' + (fields.type | string) + '</type>' -}}{%- endif -%}
{%- if fields.description is defined -%}{{- '\n<description>' + (fields.description | trim) + '</description>' -}}{%- endif -%}
{{- extra_keys(fields, ['name', 'type', 'description']) -}}
{{- '\n</parameter>' -}}
{%- endfor -%}
{{- extra_keys(tool.parameters, ['type', 'properties']) -}}
{{- '\n</parameters>\n</function>' -}}
{%- endfor -%}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n</IMPORTANT>' -}}
{%- endif -%}
{%- if system_message is defined or tools -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content and message.content | trim -%}{{- '\n' + (message.content | trim) + '\n' -}}{%- endif -%}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '\n<tool_call>\n<function=' + call.name + '>\n' -}}
{%- for key, value in call.arguments.items() -%}
{{- '<parameter=' + key + '>\n' -}}
{{- (value | tojson if value is mapping or (value is sequence and value is not string) else value | string) + '\n</parameter>\n' -}}
{%- endfor -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user\n' -}}{%- endif -%}
{{- '<tool_response>\n' + message.content + '\n</tool_response>\n' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""",
    seed=1,
))
