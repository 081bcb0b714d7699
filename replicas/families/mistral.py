"""Mistral: one JSON array of calls after `[TOOL_CALLS]`, or `[TOOL_CALLS]NAME[ARGS]{...}`
per call in the later (tekken) vocabularies (the `mistral` tool format); no reasoning
markup Orchard reads.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.tool_format import CallGrammar, Syntax, ToolFormat

__all__ = ["FAMILY", "MISTRAL"]

# The grammar writes the array form.
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

# Mistral-7B-Instruct-v0.3's template: [AVAILABLE_TOOLS] before the last user turn, calls
# as one JSON list after [TOOL_CALLS] (each with its id), results in [TOOL_RESULTS]. The
# real template insists on 9-character call ids; this one writes any id it gets.
TEMPLATE = ModelTemplate(
    # [ARGS] and [CALL_ID] come from the later (tekken) vocabularies, which write a call as
    # [TOOL_CALLS]NAME[ARGS]{...}: Orchard reads that form too and reserves them.
    special=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
             "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"),
    eos=("</s>",),
    pad="<unk>",
    bos="<s>",
    favoured=("[TOOL_CALLS]",),
    seed=4,
    chat_template=r"""{%- if messages[0].role == 'system' -%}{%- set system_message = messages[0].content -%}{%- set loop_messages = messages[1:] -%}
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

FAMILY = Family("mistral", tools=MISTRAL, template=TEMPLATE)
