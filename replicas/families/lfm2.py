"""LFM2 (Liquid): pythonic calls, a Python list of keyword-argument calls between
`<|tool_call_start|>` and `<|tool_call_end|>` (the `pythonic` tool format, mlx-lm 0.32's
`pythonic` parser is the reference); no reasoning markup.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.tool_format import CallGrammar, ParamLayout, Syntax, ToolFormat

__all__ = ["FAMILY", "PYTHONIC"]

_PYTHONIC_CALL = ("<|tool_call_start|>", "<|tool_call_end|>")
#   <|tool_call_start|>[get_weather(city="Paris"), ping()]<|tool_call_end|>
# The grammar writes every value as JSON, which the reference reads too (strings quoted,
# `true`/`false`/`null` as the constants).
PYTHONIC = ToolFormat(
    name="pythonic",
    syntax=Syntax.PYTHONIC,
    call_open=_PYTHONIC_CALL[0],
    call_close=_PYTHONIC_CALL[1],
    # mlx-lm detects it by this text in the template, or by both markers in the vocab.
    signature=_PYTHONIC_CALL[:1],
    grammar=CallGrammar(
        trigger=_PYTHONIC_CALL[0],
        open=f"{_PYTHONIC_CALL[0]}[",
        head="{name}(",
        tail=")",
        sep=", ",
        close=f"]{_PYTHONIC_CALL[1]}",
        markers=_PYTHONIC_CALL,
        params=ParamLayout(open="{key}=", close="", sep=", ", raw_strings=False),
    ),
    reserved=_PYTHONIC_CALL,
)

# LFM2's template: the tool list as JSON between <|tool_list_start|> and <|tool_list_end|>
# in the system turn, results wrapped in <|tool_response_start|> ... <|tool_response_end|>;
# an assistant's calls are written as the model writes them, a Python list of calls.
TEMPLATE = ModelTemplate(
    special=("<|pad|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>",
             "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
             "<|tool_response_start|>", "<|tool_response_end|>"),
    eos=("<|im_end|>",),
    pad="<|pad|>",
    bos="<|startoftext|>",
    favoured=_PYTHONIC_CALL,
    seed=2,
    chat_template=r"""{{- bos_token -}}
{%- set ns = namespace(system_prompt='') -%}
{%- if messages[0].role == 'system' -%}{%- set ns.system_prompt = messages[0].content -%}{%- set messages = messages[1:] -%}{%- endif -%}
{%- if tools -%}
{%- set ns.system_prompt = ns.system_prompt + ('\n' if ns.system_prompt else '') + 'List of tools: <|tool_list_start|>[' -%}
{%- for tool in tools -%}
{%- set ns.system_prompt = ns.system_prompt + (tool | tojson) + (', ' if not loop.last else '') -%}
{%- endfor -%}
{%- set ns.system_prompt = ns.system_prompt + ']<|tool_list_end|>' -%}
{%- endif -%}
{%- if ns.system_prompt -%}{{- '<|im_start|>system\n' + ns.system_prompt + '<|im_end|>\n' -}}{%- endif -%}
{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\n' -}}
{%- set content = message.content -%}
{%- if message.tool_calls -%}
{%- set calls = namespace(text='') -%}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{%- set calls.text = calls.text + (', ' if not loop.first else '') + call.name + '(' -%}
{%- for key, value in call.arguments.items() -%}
{%- set calls.text = calls.text + (', ' if not loop.first else '') + key + '=' + (value | tojson) -%}
{%- endfor -%}
{%- set calls.text = calls.text + ')' -%}
{%- endfor -%}
{%- set content = '<|tool_call_start|>[' + calls.text + ']<|tool_call_end|>' + content -%}
{%- endif -%}
{%- if message.role == 'tool' -%}{%- set content = '<|tool_response_start|>' + content + '<|tool_response_end|>' -%}{%- endif -%}
{{- content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""",
)

FAMILY = Family("lfm2", tools=PYTHONIC, template=TEMPLATE)
