"""Gemma (Google): two families, Gemma 4 and FunctionGemma, that write calls the same way
(`call:NAME{key:VALUE,...}`, strings between quote markers) with their own markers. mlx-lm
0.32's `gemma4` and `function_gemma` parsers are the reference for the markup. Gemma 4
reasons in its `gemma4` channel format (`<|channel>thought` ... `<channel|>`);
FunctionGemma does not reason.
"""

from __future__ import annotations

from replicas.families.family import Family, ModelTemplate
from replicas.families.reasoning import tagged_reasoning
from replicas.families.tool_format import CallGrammar, GemmaTags, ParamLayout, Syntax, ToolFormat

__all__ = ["FAMILIES", "FUNCTION_GEMMA", "GEMMA4", "GEMMA4_THOUGHT"]

# Gemma 4: `<|channel>thought\n` + reasoning + `<channel|>` + answer. `thought` is the only
# channel mlx-lm opens; the whole text is the marker, so another channel stays text.
GEMMA4_THOUGHT = tagged_reasoning("gemma4", "<|channel>thought", "<channel|>",
                                  signature=("<|channel>", "<channel|>"))


def _gemma_format(name: str, call: tuple[str, str], quote: str, signature: tuple[str, ...],
                  results: tuple[str, str]) -> ToolFormat:
    """A Gemma family: `CALL call:NAME{key:VALUE,...}CALL_END`, one marker pair per call (so
    parallel calls follow each other), strings between `quote`s. `results` is the
    tool-result wrapper the template writes for a tool message, reserved too."""
    return ToolFormat(
        name=name,
        syntax=Syntax.GEMMA,
        call_open=call[0],
        call_close=call[1],
        gemma=GemmaTags(quote),
        signature=signature,
        grammar=CallGrammar(
            trigger=call[0],
            head=f"{call[0]}call:{{name}}{{",
            tail=f"}}{call[1]}",
            sep="",
            markers=(*call, quote),
            params=ParamLayout(open="{key}:", close="", sep=",", quote=quote),
        ),
        reserved=(*call, *results),
    )


_GEMMA4_CALL = ("<|tool_call>", "<tool_call|>")
# Gemma 4: one marker pair per call, bare keys, strings between `<|"|>`s.
#   <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>
# The grammar writes a top-level string that way and any other value as JSON, which the
# reader takes inside a Gemma value too.
GEMMA4 = _gemma_format("gemma4", _GEMMA4_CALL, '<|"|>',
                       _GEMMA4_CALL,  # both in the template, as mlx-lm checks
                       ("<|tool_response>", "<tool_response|>"))

_FG_CALL = ("<start_function_call>", "<end_function_call>")
# FunctionGemma (Gemma 3 270M): the same shape, strings between `<escape>`s.
#   <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>
# Its reference reads a flat argument list: a value other than a string ends at the next
# comma, so the grammar's JSON for an object or a list argument is this reader's only.
FUNCTION_GEMMA = _gemma_format("function_gemma", _FG_CALL, "<escape>", _FG_CALL[:1],
                               ("<start_function_response>", "<end_function_response>"))

# A value in Gemma's notation: strings between two `quote`s, bare keys, JSON otherwise
# (the macro takes the quote, so both Gemma templates share it).
_GEMMA_VALUE = r"""{%- macro gemma_value(value, quote, upper=false) -%}
{%- if value is string -%}{{- quote + (value | upper if upper else value) + quote -}}
{%- elif value is mapping -%}{{- '{' -}}
{%- for key, item in value | dictsort -%}{{- (',' if not loop.first else '') + key + ':' + gemma_value(item, quote, key == 'type') -}}{%- endfor -%}
{{- '}' -}}
{%- elif value is sequence -%}{{- '[' -}}{%- for item in value -%}{{- (',' if not loop.first else '') + gemma_value(item, quote) -}}{%- endfor -%}{{- ']' -}}
{%- else -%}{{- value | tojson -}}{%- endif -%}
{%- endmacro -%}
"""

# Gemma 4: <|turn>ROLE ... <turn|> turns, declarations as <|tool>declaration:NAME{...}<tool|>
# in the system turn, strings between <|"|>s; a call's response stays in the model's turn.
GEMMA4_TEMPLATE = ModelTemplate(
    special=("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>",
             "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'),
    eos=("<turn|>", "<eos>", "<|tool_response>"),
    pad="<pad>",
    bos="<bos>",
    favoured=("<|tool_call>", "<tool_call|>", '<|"|>'),
    seed=9,
    chat_template=_GEMMA_VALUE + r"""{%- set q = '<|"|>' -%}
{{- bos_token -}}
{%- set ns = namespace(previous='', name='') -%}
{%- set loop_messages = messages -%}
{%- if tools or messages[0].role == 'system' -%}
{{- '<|turn>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content | trim -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}
{%- for tool in tools or [] -%}
{%- set tool = tool.function if tool.function is defined else tool -%}
{{- '<|tool>declaration:' + tool.name + '{description:' + q + (tool.description or '') + q + ',parameters:' + gemma_value(tool.parameters or {}, q) + '}<tool|>' -}}
{%- endfor -%}
{{- '<turn|>\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'tool' -%}
{{- '<|tool_response>response:' + (message.name or ns.name) + '{value:' + q + message.content + q + '}<tool_response|>' -}}
{%- set ns.previous = 'response' -%}
{%- else -%}
{%- if ns.previous != 'response' -%}{{- '<|turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' -}}{%- endif -%}
{{- message.content | trim -}}
{%- set ns.previous = 'content' -%}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{%- set ns.name = call.name -%}
{{- '<|tool_call>call:' + call.name + '{' -}}
{%- for key, value in call.arguments | dictsort -%}{{- (',' if not loop.first else '') + key + ':' + gemma_value(value, q) -}}{%- endfor -%}
{{- '}<tool_call|>' -}}
{%- set ns.previous = 'call' -%}
{%- endfor -%}
{%- if ns.previous == 'content' -%}{{- '<turn|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.previous not in ('call', 'response') -%}{{- '<|turn>model\n' -}}{%- endif -%}
""",
)

# FunctionGemma: declarations in a developer turn, a call's response right after it in the
# model's turn (`<start_function_response>` also ends a turn), which the model continues.
FUNCTION_GEMMA_TEMPLATE = ModelTemplate(
    special=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
             "<start_function_declaration>", "<end_function_declaration>",
             "<start_function_call>", "<end_function_call>", "<start_function_response>",
             "<end_function_response>", "<escape>"),
    eos=("<end_of_turn>", "<eos>", "<start_function_response>"),
    pad="<pad>",
    bos="<bos>",
    favoured=("<start_function_call>", "<end_function_call>", "<escape>"),
    seed=10,
    chat_template=_GEMMA_VALUE + r"""{{- bos_token -}}
{%- set ns = namespace(previous='', name='') -%}
{%- set loop_messages = messages -%}
{%- if tools or messages[0].role == 'system' -%}
{{- '<start_of_turn>developer\n' -}}
{%- if messages[0].role == 'system' -%}{{- (messages[0].content | trim) + ('\n\n' if tools else '') -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}
{%- for tool in tools or [] -%}
{%- set tool = tool.function if tool.function is defined else tool -%}
{{- '<start_function_declaration>declaration:' + tool.name + '{description:<escape>' + (tool.description or '') + '<escape>,parameters:' + gemma_value(tool.parameters or {}, '<escape>') + '}<end_function_declaration>' -}}
{%- endfor -%}
{{- '<end_of_turn>\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'tool' -%}
{{- '<start_function_response>response:' + (message.name or ns.name) + '{value:<escape>' + message.content + '<escape>}<end_function_response>' -}}
{%- set ns.previous = 'response' -%}
{%- else -%}
{%- if ns.previous != 'response' -%}{{- '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' -}}{%- endif -%}
{{- message.content | trim -}}
{%- set ns.previous = 'content' -%}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{%- set ns.name = call.name -%}
{{- '<start_function_call>call:' + call.name + '{' -}}
{%- for key, value in call.arguments.items() -%}{{- (',' if not loop.first else '') + key + ':' + gemma_value(value, '<escape>') -}}{%- endfor -%}
{{- '}<end_function_call>' -}}
{%- set ns.previous = 'call' -%}
{%- endfor -%}
{%- if ns.previous == 'content' -%}{{- '<end_of_turn>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.previous not in ('call', 'response') -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
""",
)

FAMILIES = (
    Family("gemma4", reasoning=GEMMA4_THOUGHT, tools=GEMMA4, template=GEMMA4_TEMPLATE),
    Family("function_gemma", tools=FUNCTION_GEMMA, template=FUNCTION_GEMMA_TEMPLATE),
)
