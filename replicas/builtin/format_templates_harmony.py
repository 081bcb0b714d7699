"""Chat template and token layout of the Harmony (gpt-oss) tool-format model (`formats.py`;
`format_templates.py` lists every family's module): the tools as a TypeScript namespace,
a call as a message to `functions.NAME` that ends in `<|call|>`.
"""

from __future__ import annotations

from .format_spec import FormatSpec

__all__ = ["HARMONY"]


_HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
            "<|call|>")
# gpt-oss's template: the tools as a TypeScript namespace in the developer message, a call as
# an assistant message to=functions.NAME on the commentary channel ending in <|call|>, its
# result as a message from functions.NAME back to the assistant.
HARMONY = FormatSpec(
    tool_format="harmony",
    special=("<|endoftext|>", *_HARMONY),
    eos=("<|return|>", "<|call|>"),
    pad="<|endoftext|>",
    favoured=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"),
    template=r"""{%- macro ts_type(s) -%}
{%- if s.enum is defined -%}{%- for v in s.enum -%}{{- (v | tojson) + (' | ' if not loop.last else '') -}}{%- endfor -%}
{%- elif s.type == 'string' -%}{{- 'string' -}}
{%- elif s.type == 'number' or s.type == 'integer' -%}{{- 'number' -}}
{%- elif s.type == 'boolean' -%}{{- 'boolean' -}}
{%- elif s.type == 'array' -%}{{- (ts_type(s['items']) if s['items'] is defined else 'any') + '[]' -}}
{%- else -%}{{- 'any' -}}{%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: ' + (reasoning_effort or 'medium') + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- if messages[0].role == 'system' -%}{%- set instructions = messages[0].content -%}{%- set messages = messages[1:] -%}{%- endif -%}
{%- if tools or instructions is defined -%}
{{- '<|start|>developer<|message|>' -}}
{%- if instructions is defined -%}{{- '# Instructions\n\n' + instructions + ('\n\n' if tools else '') -}}{%- endif -%}
{%- if tools -%}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
{%- for tool in tools -%}
{%- set tool = tool.function if tool.function is defined else tool -%}
{{- '// ' + (tool.description or '') + '\ntype ' + tool.name + ' = (_: {\n' -}}
{%- for name, prop in ((tool.parameters or {}).properties or {}).items() -%}
{%- if prop.description is defined -%}{{- '// ' + prop.description + '\n' -}}{%- endif -%}
{{- name + ('' if name in (tool.parameters.required or []) else '?') + ': ' + ts_type(prop) + ',\n' -}}
{%- endfor -%}
{{- '}) => any;\n\n' -}}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- set last = namespace(name='') -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{%- set last.name = call.name -%}
{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' + (call.arguments | tojson) + '<|call|>' -}}
{%- endfor -%}
{%- elif message.role == 'assistant' -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' -}}
{%- elif message.role == 'tool' -%}
{{- '<|start|>functions.' + (message.name or last.name) + ' to=assistant<|channel|>commentary<|message|>' + (message.content | tojson) + '<|end|>' -}}
{%- else -%}
{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
""",
)
