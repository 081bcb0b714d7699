"""Qwen (Qwen2.5, Qwen3, Hermes-style models and the built-in tiny): JSON calls in
`<tool_call>` tags (the `hermes` tool format), reasoning in `<think>` tags.

`QWEN_RESERVED` and `qwen_template` are Qwen's tokens and call markers, which Qwen3-Coder
(`qwen3_coder.py`) shares.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import THINK_TAGS
from replicas.families.tool_format import CallGrammar, Syntax, ToolFormat

__all__ = ["FAMILY", "HERMES", "QWEN_RESERVED", "qwen_template"]

# Hermes and Qwen3-Coder share their delimiters and the tool-result wrapper of the template.
QWEN_RESERVED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen3 / Hermes: every call wrapped in its own tags, calls joined by one newline.
HERMES = ToolFormat(
    name="hermes",
    syntax=Syntax.JSON,
    call_open="<tool_call>",
    call_close="</tool_call>",
    signature=("<tool_call>",),
    grammar=CallGrammar(
        trigger="<tool_call>",
        head='<tool_call>\n{"name": "{name}", "arguments": ',
        tail="}\n</tool_call>",
        sep="\n",
        markers=("<tool_call>", "</tool_call>"),
    ),
    reserved=QWEN_RESERVED,
)

_QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def qwen_template(chat_template: str, seed: int) -> ModelTemplate:
    """A Qwen family's test model: Qwen's tokens and <tool_call> markers, its own template."""
    return ModelTemplate(chat_template=chat_template, special=_QWEN_TOKENS, plain=QWEN_RESERVED,
                         eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>",
                         favoured=("<tool_call>", "</tool_call>"), seed=seed)


# Qwen2.5's template: the tool list in the system turn, calls as JSON in <tool_call>, the
# results of consecutive tool turns in one user turn.
FAMILY = Family("qwen", reasoning=THINK_TAGS, tools=HERMES, template=qwen_template(
    r"""{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}
{%- else -%}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -}}{%- endif -%}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""",
    seed=0,
))
