"""Llama 3.1+ (Meta): JSON calls after `<|python_tag|>`, or a bare `{"name"` object that
starts the answer (the `llama3_json` tool format); no reasoning markup.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.tool_format import CallGrammar, Syntax, ToolFormat

__all__ = ["FAMILY", "LLAMA3_JSON"]

# Parallel calls joined by "; " as vLLM's parser reads them.
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

# Llama 3.1's template: the tools as indented JSON in the first user turn, a call written as
# {"name": ..., "parameters": ...}, results as an `ipython` turn (JSON-quoted, as its
# template writes string content). The model opens a call with <|python_tag|>.
TEMPLATE = ModelTemplate(
    special=("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
             "<|python_tag|>"),
    eos=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
    favoured=("<|python_tag|>",),
    seed=3,
    chat_template=r"""{{- bos_token -}}
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

FAMILY = Family("llama", tools=LLAMA3_JSON, template=TEMPLATE)
