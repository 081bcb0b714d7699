"""Chat templates and token layouts of the Llama 3.1 and Mistral tool-format models
(`formats.py`; `format_templates.py` lists every family's module): calls as JSON objects
after one special marker, results in the family's own turn or wrapper.
"""

from __future__ import annotations

from .format_spec import FormatSpec

__all__ = ["LLAMA3_JSON", "MISTRAL"]


# Llama 3.1's template: the tools as indented JSON in the first user turn, a call written as
# {"name": ..., "parameters": ...}, results as an `ipython` turn (JSON-quoted, as its
# template writes string content). The model opens a call with <|python_tag|>.
LLAMA3_JSON = FormatSpec(
    tool_format="llama3_json",
    special=("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
             "<|python_tag|>"),
    eos=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
    favoured=("<|python_tag|>",),
    template=r"""{{- bos_token -}}
{%- if messages[0].role == 'system' -%}{%- set system_message = messages[0].content | trim -%}{%- set messages = messages[1:] -%}
{%- else -%}{%- set system_message = '' -%}{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{%- if tools -%}{{- 'Environment: ipython\n' -}}{%- endif -%}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' + system_message + '<|eot_id|>' -}}
{%- if tools -%}
{%- if not messages -%}{{- raise_exception('Cannot put tools in the first user message when there is no first user message!') -}}{%- endif -%}
{{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n' -}}
{%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\n\n' -}}{%- endfor -%}
{{- (messages[0].content | trim) + '<|eot_id|>' -}}
{%- set messages = messages[1:] -%}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- if message.tool_calls | length != 1 -%}{{- raise_exception('This model only supports single tool-calls at once!') -}}{%- endif -%}
{%- set call = message.tool_calls[0].function -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}<|eot_id|>' -}}
{%- elif message.role == 'tool' or message.role == 'ipython' -%}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + (message.content | tojson) + '<|eot_id|>' -}}
{%- else -%}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content | trim) + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
""",
)

# Mistral-7B-Instruct-v0.3's template: [AVAILABLE_TOOLS] before the last user turn, calls
# as one JSON list after [TOOL_CALLS] (each with its id), results in [TOOL_RESULTS]. The
# real template insists on 9-character call ids; this one writes any id it gets.
MISTRAL = FormatSpec(
    tool_format="mistral",
    # [ARGS] and [CALL_ID] come from the later (tekken) vocabularies, which write a call as
    # [TOOL_CALLS]NAME[ARGS]{...}: Orchard reads that form too and reserves them.
    special=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
             "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"),
    eos=("</s>",),
    pad="<unk>",
    bos="<s>",
    favoured=("[TOOL_CALLS]",),
    template=r"""{%- if messages[0].role == 'system' -%}{%- set system_message = messages[0].content -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list -%}
{{- bos_token -}}
{%- for message in loop_messages -%}
{%- if message.role == 'user' -%}
{%- if tools and message == user_messages[-1] -%}
{{- '[AVAILABLE_TOOLS] [' -}}
{%- for tool in tools -%}{{- (tool | tojson) + (', ' if not loop.last else '') -}}{%- endfor -%}
{{- '][/AVAILABLE_TOOLS]' -}}
{%- endif -%}
{%- if loop.last and system_message is defined -%}{{- '[INST] ' + system_message + '\n\n' + message.content + '[/INST]' -}}
{%- else -%}{{- '[INST] ' + message.content + '[/INST]' -}}{%- endif -%}
{%- elif message.role == 'assistant' and message.tool_calls -%}
{{- '[TOOL_CALLS] [' -}}
{%- for call in message.tool_calls -%}
{{- ((call.function | tojson)[:-1]) + ', "id": "' + call.id + '"}' + (', ' if not loop.last else ']' + eos_token) -}}
{%- endfor -%}
{%- elif message.role == 'assistant' -%}
{{- ' ' + (message.content | trim) + eos_token -}}
{%- elif message.role == 'tool' -%}
{{- '[TOOL_RESULTS] {"content": ' + (message.content | string) + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' -}}
{%- else -%}
{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') -}}
{%- endif -%}
{%- endfor -%}
""",
)
