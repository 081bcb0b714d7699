"""MiniCPM5 (OpenBMB): bare `<function name="f">` blocks with `<param>` values (the
`minicpm5` tool format, mlx-lm 0.32's `minicpm5` parser is the reference), reasoning in
`<think>` tags.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import THINK_TAGS
from replicas.families.tool_format import CallGrammar, ParamLayout, Syntax, ToolFormat, XmlTags

__all__ = ["FAMILY", "MINICPM5"]

# No wrapper, each call one `<function>` block; the router cuts at `<function name=` so the
# reader starts at the name (`XmlTags.function` is empty).
#   <function name="f"><param name="p">value</param></function>
# A value holding `<`, `&` or a newline comes as `<![CDATA[...]]>`.
MINICPM5 = ToolFormat(
    name="minicpm5",
    syntax=Syntax.XML,
    call_open="<function name=",
    call_close="</function>",
    xml=XmlTags(function="", function_end="</function>", parameter="<param name=",
                parameter_end="</param>", quoted=True, strip_values=True, cdata=True),
    signature=('<function name="', '<param name="'),  # both in the template, as mlx-lm checks
    grammar=CallGrammar(
        trigger="<function name=",
        head='<function name="{name}">',
        tail="</function>",
        sep="\n",
        params=ParamLayout(open='<param name="{key}">', close="</param>"),
    ),
    reserved=("<function name=", "</function>"),
)

# ChatML turns, the tools in the system turn with the call format
# <function name="f"><param name="p">value</param></function> (no wrapper), results in a
# `tool` turn; a minimal reconstruction around the reference's markup.
TEMPLATE = ModelTemplate(
    special=("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"),
    eos=("<|im_end|>", "</s>"),
    pad="<unk>",
    bos="<s>",
    favoured=(),  # no marker is a token: the grammar writes every byte of a forced call
    seed=12,
    chat_template=r"""{%- set loop_messages = messages -%}
{%- if tools or messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}
{%- if tools -%}
{{- '\n\n# Tools\n\nYou may call functions. Their signatures:\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '\nTo call a function, reply with one block per call:\n<function name="function_name"><param name="param_name">value</param></function>\nWrap a value holding <, & or a newline in <![CDATA[...]]>.' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{{- '<|im_start|>' + message.role + '\n' + message.content -}}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- ('\n' if message.content or not loop.first else '') + '<function name="' + call.name + '">' -}}
{%- for key, value in call.arguments.items() -%}
{%- set text = value if value is string else value | tojson -%}
{{- '<param name="' + key + '">' + ('<![CDATA[' + text + ']]>' if '<' in text or '&' in text or '\n' in text else text) + '</param>' -}}
{%- endfor -%}
{{- '</function>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""",
)

FAMILY = Family("minicpm", reasoning=THINK_TAGS, tools=MINICPM5, template=TEMPLATE)
