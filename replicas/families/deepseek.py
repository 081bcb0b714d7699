"""DeepSeek V3.1 and V3.2-Exp: a section of calls, each its name, `<｜tool▁sep｜>` and its
JSON arguments (the `deepseek_v31` tool format), reasoning in `<think>` tags. mlx-lm 0.32
has no parser for it; the reference is the chat template's own markup and vLLM's
`deepseek_v31` parser. The pipeline's JSON reader reads it by the `named` knob, as it
reads Kimi K2's.

The bars in the markers are U+FF5C (fullwidth vertical line) and the spaces U+2581 (lower
one eighth block); each marker is one added token of DeepSeek's vocabulary.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import THINK_TAGS
from replicas.families.tool_format import CallGrammar, Syntax, ToolFormat

__all__ = ["DEEPSEEK_V31", "DEEPSEEK_V31_CALL", "DEEPSEEK_V31_RESULTS", "DEEPSEEK_V31_SECTION",
           "DEEPSEEK_V31_SEP", "FAMILY"]

DEEPSEEK_V31_SECTION = ("<\uff5ctool\u2581calls\u2581begin\uff5c>",
                        "<\uff5ctool\u2581calls\u2581end\uff5c>")
DEEPSEEK_V31_CALL = ("<\uff5ctool\u2581call\u2581begin\uff5c>",
                     "<\uff5ctool\u2581call\u2581end\uff5c>")
DEEPSEEK_V31_SEP = "<\uff5ctool\u2581sep\uff5c>"
# V3.1's template wraps each result in output begin/end; the plural pair is V3's wrapper
# around all of them, still in the vocabulary, so a model may write either.
DEEPSEEK_V31_RESULTS = ("<\uff5ctool\u2581output\u2581begin\uff5c>",
                        "<\uff5ctool\u2581output\u2581end\uff5c>",
                        "<\uff5ctool\u2581outputs\u2581begin\uff5c>",
                        "<\uff5ctool\u2581outputs\u2581end\uff5c>")

# DeepSeek V3.1: one section of calls, each its name then its JSON arguments.
#   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
#   <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
# Each call is cut out by its own begin/end (as vLLM's parser finds them); the section
# markers around them are dropped from the answer.
DEEPSEEK_V31 = ToolFormat(
    name="deepseek_v31",
    syntax=Syntax.JSON,
    call_open=DEEPSEEK_V31_CALL[0],
    call_close=DEEPSEEK_V31_CALL[1],
    named=DEEPSEEK_V31_SEP,  # the stripped text before it is the name
    section=DEEPSEEK_V31_SECTION,
    signature=DEEPSEEK_V31_SECTION[:1],
    grammar=CallGrammar(
        trigger=DEEPSEEK_V31_SECTION[0],
        open=DEEPSEEK_V31_SECTION[0],
        head=f"{DEEPSEEK_V31_CALL[0]}{{name}}{DEEPSEEK_V31_SEP}",
        tail=DEEPSEEK_V31_CALL[1],
        sep="",  # "chain them directly without separators", as the model card says
        close=DEEPSEEK_V31_SECTION[1],
        markers=(*DEEPSEEK_V31_SECTION, *DEEPSEEK_V31_CALL, DEEPSEEK_V31_SEP),
    ),
    reserved=(*DEEPSEEK_V31_SECTION, *DEEPSEEK_V31_CALL, DEEPSEEK_V31_SEP,
              *DEEPSEEK_V31_RESULTS),
)

# V3.1's published template: the system prompt raw after bos, then `<｜User｜>` and
# `<｜Assistant｜>` turns, `</think>` after `<｜Assistant｜>` unless the `thinking` flag opens
# `<think>`, calls as a `<｜tool▁calls▁begin｜>` section, each result in
# `<｜tool▁output▁begin｜>` ... `<｜tool▁output▁end｜>` with the model going on right after
# it. V3.1's template leaves the tool list to the caller's system prompt, in the form its
# model card gives; this one writes that form itself, so `tools=` reaches the prompt as on
# every other family. As in DeepSeek's tokenizer, only bos, eos and pad are special
# tokens: the role, think and tool markers are added tokens that decoding keeps.
_BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
_PAD = "<\uff5c\u2581pad\u2581\uff5c>"
_ROLES = ("<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>")
_CALL_MARKERS = (*DEEPSEEK_V31_SECTION, *DEEPSEEK_V31_CALL, DEEPSEEK_V31_SEP)

TEMPLATE = ModelTemplate(
    special=(_BOS, _EOS, _PAD),
    plain=(*_ROLES, "<think>", "</think>", *_CALL_MARKERS, *DEEPSEEK_V31_RESULTS),
    eos=(_EOS,),
    pad=_PAD,
    bos=_BOS,
    favoured=_CALL_MARKERS,
    seed=15,
    chat_template=r"""{{- bos_token -}}
{%- set ns = namespace(system='', last_user=false, tool=false) -%}
{%- for message in messages if message.role == 'system' -%}
{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + message.content -%}
{%- endfor -%}
{%- if tools -%}
{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + '## Tools\nYou have access to the following tools:\n' -%}
{%- for tool in tools -%}
{%- set tool = tool.function if tool.function is defined else tool -%}
{%- set ns.system = ns.system + '\n### ' + tool.name + '\nDescription: ' + (tool.description or '') + '\n\nParameters: ' + (tool.parameters | tojson) + '\n' -%}
{%- endfor -%}
{%- set ns.system = ns.system + '\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n\nWhere:\n\n- `tool_call_name` must be an exact match to one of the available tools\n- `tool_call_arguments` must be valid JSON that strictly follows the tool\'s Parameters Schema\n- For multiple tool calls, chain them directly without separators or spaces' -%}
{%- endif -%}
{{- ns.system -}}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
{{- '<｜User｜>' + message.content -}}
{%- set ns.last_user = true -%}
{%- set ns.tool = false -%}
{%- elif message.role == 'assistant' -%}
{%- if ns.last_user -%}{{- '<｜Assistant｜></think>' -}}{%- endif -%}
{%- if message.tool_calls -%}
{{- (message.content or '') + '<｜tool▁calls▁begin｜>' -}}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<｜tool▁call▁begin｜>' + call.name + '<｜tool▁sep｜>' + (call.arguments if call.arguments is string else call.arguments | tojson) + '<｜tool▁call▁end｜>' -}}
{%- endfor -%}
{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}
{%- else -%}
{%- set content = message.content or '' -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>', 1)[1] -%}{%- endif -%}
{{- content + '<｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- set ns.last_user = false -%}
{%- set ns.tool = false -%}
{%- elif message.role == 'tool' -%}
{{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' -}}
{%- set ns.last_user = false -%}
{%- set ns.tool = true -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.last_user and not ns.tool -%}
{{- '<｜Assistant｜>' + ('<think>' if thinking else '</think>') -}}
{%- endif -%}
""",
)

FAMILY = Family("deepseek", reasoning=THINK_TAGS, tools=DEEPSEEK_V31, template=TEMPLATE)
