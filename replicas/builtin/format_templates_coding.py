"""Chat templates and token layouts of the tool-format models of today's coding models
(`formats.py`; `format_templates.py` lists every family's module): Kimi K2, GLM-4.7 and
MiniMax-M2, each writing calls in its own markup (`replicas/pipeline/tool_families.py`).
"""

from __future__ import annotations

from .format_spec import FormatSpec

__all__ = ["GLM47", "KIMI_K2", "MINIMAX_M2"]


# Kimi K2's template: the tools declared as JSON in a `tool_declare` system turn, calls in a
# section of <|tool_call_begin|>ID<|tool_call_argument_begin|>JSON<|tool_call_end|>, the ID
# being `functions.NAME:IDX` (an id in another shape is written in that one), results as a
# `tool` turn starting "## Return of ID".
KIMI_K2 = FormatSpec(
    tool_format="kimi_k2",
    special=("[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
             "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
             "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
             "<|tool_call_end|>"),
    eos=("<|im_end|>", "[EOS]"),
    pad="[PAD]",
    bos="[BOS]",
    favoured=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
              "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    template=r"""{%- if tools -%}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' -}}{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and message.role != 'system' -%}{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}{%- endif -%}
{%- if message.role == 'user' -%}{{- '<|im_user|>user<|im_middle|>' -}}
{%- elif message.role == 'assistant' -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- else -%}{{- '<|im_system|>' + message.role + '<|im_middle|>' -}}{%- endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{{- message.content or '' -}}
{{- '<|tool_calls_section_begin|>' -}}
{%- for call in message.tool_calls -%}
{%- set id = call.id if call.id.startswith('functions.') else 'functions.' + call.function.name + ':' + (loop.index0 | string) -%}
{%- set arguments = call.function.arguments -%}
{{- '<|tool_call_begin|>' + id + '<|tool_call_argument_begin|>' + (arguments if arguments is string else arguments | tojson) + '<|tool_call_end|>' -}}
{%- endfor -%}
{{- '<|tool_calls_section_end|>' -}}
{%- elif message.role == 'tool' -%}
{{- '## Return of ' + message.tool_call_id + '\n' + message.content -}}
{%- else -%}
{{- message.content -}}
{%- endif -%}
{{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}
""",
)

_GLM_CALL = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>")
# GLM-4.7's template: the tools as JSON lines in the system turn, a call as
# <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> (strings raw,
# other values JSON), results in <tool_response> after an <|observation|> turn.
GLM47 = FormatSpec(
    tool_format="glm47",
    special=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
             "<|observation|>", *_GLM_CALL, "<tool_response>", "</tool_response>"),
    eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    pad="<|endoftext|>",
    favoured=_GLM_CALL,
    template=r"""{{- '[gMASK]<sop>' -}}
{%- if tools -%}
{{- '<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}{{- '<|user|>' + message.content -}}
{%- elif message.role == 'system' -%}{{- '<|system|>' + message.content -}}
{%- elif message.role == 'assistant' -%}
{{- '<|assistant|>' + (message.content | trim) -}}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<tool_call>' + call.name -}}
{%- for key, value in call.arguments.items() -%}
{{- '<arg_key>' + key + '</arg_key><arg_value>' + (value if value is string else value | tojson) + '</arg_value>' -}}
{%- endfor -%}
{{- '</tool_call>' -}}
{%- endfor -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}
{{- '<tool_response>' + message.content + '</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}
""",
)

# MiniMax-M2's template: each tool's JSON in a <tool> line of the system turn, calls as
# <invoke> blocks in one <minimax:tool_call> section, results as <response> in a tool turn.
MINIMAX_M2 = FormatSpec(
    tool_format="minimax_m2",
    special=("]!p~[", "]~!b[", "]~b]", "[e~[", "<minimax:tool_call>", "</minimax:tool_call>"),
    eos=("[e~[",),
    pad="]!p~[",
    bos="]~!b[",
    favoured=("<minimax:tool_call>", "</minimax:tool_call>"),
    template=r"""{%- if messages[0].role == 'system' -%}{%- set system_message = messages[0].content -%}{%- set messages = messages[1:] -%}
{%- else -%}{%- set system_message = 'You are a helpful assistant.' -%}{%- endif -%}
{{- ']~!b[]~b]system\n' + system_message -}}
{%- if tools -%}
{{- '\n\n# Tools\nYou may call one or more tools to assist with the user query.\nHere are the tools available in JSONSchema format:\n\n<tools>\n' -}}
{%- for tool in tools -%}{{- '<tool>' + (tool.function | tojson) + '</tool>\n' -}}{%- endfor -%}
{{- '</tools>\n\nWhen making tool calls, use XML format to invoke tools and pass parameters:\n\n<minimax:tool_call>\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n</minimax:tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}
{{- ']~b]ai\n' + message.content -}}
{%- if message.tool_calls -%}
{{- '\n<minimax:tool_call>\n' -}}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<invoke name="' + call.name + '">\n' -}}
{%- for key, value in call.arguments.items() -%}
{{- '<parameter name="' + key + '">' + (value if value is string else value | tojson) + '</parameter>\n' -}}
{%- endfor -%}
{{- '</invoke>\n' -}}
{%- endfor -%}
{{- '</minimax:tool_call>' -}}
{%- endif -%}
{{- '[e~[\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- ']~b]tool' -}}{%- endif -%}
{{- '\n<response>' + message.content + '</response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '[e~[\n' -}}{%- endif -%}
{%- else -%}
{{- ']~b]' + message.role + '\n' + message.content + '[e~[\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\n' -}}{%- endif -%}
""",
)
