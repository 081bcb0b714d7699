"""Kimi K3 (Moonshot): XTML, where every structure is an `<|open|>NAME ...<|sep|>` ...
`<|close|>NAME<|sep|>` block. Its reasoning is a think block and its answer a response
block (the `xtml` channel format, mlx-lm 0.32's `_infer_thinking` and
`_infer_structural_markers`); its calls a tools block of call blocks (the `kimi_k3` tool
format, mlx-lm's `kimi_k3` parser is the reference), tied to `xtml`: mlx-lm tells the
family by the XTML vocabulary alone.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import tagged_reasoning
from replicas.families.tool_format import CallGrammar, Syntax, ToolFormat

__all__ = ["FAMILY", "KIMI_K3", "XTML"]

# `<|open|>think<|sep|>` ... `<|close|>think<|sep|>`, the answer wrapped in
# `<|open|>response<|sep|>` ... `<|close|>response<|sep|>` and the message closed by
# `<|close|>message<|sep|>`: the answer drops those three, as mlx-lm does.
XTML = tagged_reasoning(
    "xtml", "<|open|>think<|sep|>", "<|close|>think<|sep|>",
    signature=("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    answer_drops=("<|open|>response<|sep|>", "<|close|>response<|sep|>",
                  "<|close|>message<|sep|>"),
)

_K3_SECTION = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
_K3_CALL = ("<|open|>call", "<|close|>call<|sep|>")
_K3_JSON = ('<|open|>json type="object"<|sep|>', "<|close|>json<|sep|>")
# A tools section of calls, each typed argument blocks or one JSON block.
#   <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
#   <|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>
#   <|close|>call<|sep|><|close|>tools<|sep|>
# The grammar writes the JSON block form, which carries any schema.
KIMI_K3 = ToolFormat(
    name="kimi_k3",
    syntax=Syntax.XTML,
    call_open=_K3_CALL[0],
    call_close=_K3_CALL[1],
    section=_K3_SECTION,
    channel_format="xtml",
    grammar=CallGrammar(
        trigger=_K3_SECTION[0],
        open=_K3_SECTION[0],
        head=f'{_K3_CALL[0]} tool="{{name}}" index="{{index}}"<|sep|>{_K3_JSON[0]}',
        tail=f"{_K3_JSON[1]}{_K3_CALL[1]}",
        sep="",
        close=_K3_SECTION[1],
        markers=("<|open|>", "<|close|>", "<|sep|>"),
        text_markers=("<|open|>response<|sep|>", "<|close|>response<|sep|>"),
    ),
    # Each of these is several tokens (`<|open|>` also opens plain messages): none is banned,
    # all are dropped from the answer under `tool_choice: none`.
    reserved=(*_K3_SECTION, *_K3_CALL, "<|open|>argument", "<|close|>argument<|sep|>",
              "<|open|>json", _K3_JSON[1]),
)

# Every message an <|open|>message ...<|sep|> block ended by
# <|close|>message<|sep|><|end_of_msg|>, the answer in a response block, calls in a tools
# block of typed argument blocks, the tools declared as JSON in the system message; a
# minimal reconstruction around the reference's markup.
TEMPLATE = ModelTemplate(
    special=("[BOS]", "[EOS]", "[PAD]", "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    eos=("<|end_of_msg|>", "[EOS]"),
    pad="[PAD]",
    bos="[BOS]",
    # The quote after the call's index is the only way out of its digits.
    favoured=("<|open|>", "<|close|>", "<|sep|>", '"'),
    seed=14,
    chat_template=r"""{%- macro attr(text) -%}{{- text | replace('&', '&amp;') | replace('"', '&quot;') -}}{%- endmacro -%}
{%- set loop_messages = messages -%}
{%- if tools or messages[0].role == 'system' -%}
{{- '<|open|>message role="system"<|sep|>' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}
{%- if tools -%}{{- '<|open|>tool_declare<|sep|>' + (tools | tojson) + '<|close|>tool_declare<|sep|>' -}}{%- endif -%}
{{- '<|close|>message<|sep|><|end_of_msg|>' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'tool' -%}
{{- '<|open|>message role="tool" call="' + attr(message.tool_call_id or '') + '"<|sep|>' + message.content -}}
{%- elif message.role == 'assistant' -%}
{{- '<|open|>message role="assistant"<|sep|>' -}}
{%- if message.content -%}{{- '<|open|>response<|sep|>' + message.content + '<|close|>response<|sep|>' -}}{%- endif -%}
{%- if message.tool_calls -%}
{{- '<|open|>tools<|sep|>' -}}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<|open|>call tool="' + attr(call.name) + '" index="' + (loop.index | string) + '"<|sep|>' -}}
{%- for key, value in call.arguments.items() -%}
{%- set kind = 'string' if value is string else ('boolean' if value is boolean else ('number' if value is number else ('array' if value is sequence else 'object'))) -%}
{{- '<|open|>argument key="' + attr(key) + '" type="' + kind + '"<|sep|>' + (value if value is string else value | tojson) + '<|close|>argument<|sep|>' -}}
{%- endfor -%}
{{- '<|close|>call<|sep|>' -}}
{%- endfor -%}
{{- '<|close|>tools<|sep|>' -}}
{%- endif -%}
{%- else -%}
{{- '<|open|>message role="' + message.role + '"<|sep|>' + message.content -}}
{%- endif -%}
{{- '<|close|>message<|sep|><|end_of_msg|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|open|>message role="assistant"<|sep|>' -}}{%- endif -%}
""",
)

FAMILY = Family("kimi_k3", reasoning=XTML, tools=KIMI_K3, template=TEMPLATE)
