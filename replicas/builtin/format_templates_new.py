"""Chat templates and token layouts of the tool-format models for the families mlx-lm 0.32
added (`format_templates.py` lists every family's module; `format_spec.py` has the
`FormatSpec` they fill in): Gemma 4, FunctionGemma, LongCat, MiniCPM5, Muse Spark and Kimi K3.

The call markup of each is the reference parser's (mlx-lm's `tool_parsers`, the entries in
`replicas/pipeline/tool_families_*.py`). FunctionGemma's and Gemma 4's turn layout follows
their published templates (declarations in the first turn, a call's response kept in the
model's turn); for LongCat, MiniCPM5, Muse Spark and Kimi K3 the turns around the markup
are a minimal reconstruction (their tokens, their call and result markup, plain turns).
"""

from __future__ import annotations

from .format_spec import FormatSpec

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

# FunctionGemma: declarations in a developer turn, a call's response right after it in the
# model's turn (`<start_function_response>` also ends a turn), which the model continues.
FUNCTION_GEMMA = FormatSpec(
    tool_format="function_gemma",
    special=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
             "<start_function_declaration>", "<end_function_declaration>",
             "<start_function_call>", "<end_function_call>", "<start_function_response>",
             "<end_function_response>", "<escape>"),
    eos=("<end_of_turn>", "<eos>", "<start_function_response>"),
    pad="<pad>",
    bos="<bos>",
    favoured=("<start_function_call>", "<end_function_call>", "<escape>"),
    template=_GEMMA_VALUE + r"""{{- bos_token -}}
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

# Gemma 4: <|turn>ROLE ... <turn|> turns, declarations as <|tool>declaration:NAME{...}<tool|>
# in the system turn, strings between <|"|>s; a call's response stays in the model's turn.
GEMMA4 = FormatSpec(
    tool_format="gemma4",
    special=("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>",
             "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'),
    eos=("<turn|>", "<eos>", "<|tool_response>"),
    pad="<pad>",
    bos="<bos>",
    favoured=("<|tool_call>", "<tool_call|>", '<|"|>'),
    template=_GEMMA_VALUE + r"""{%- set q = '<|"|>' -%}
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

_LONGCAT_CALL = ("<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>",
                 "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>")
# LongCat: [Round N] USER:/ASSISTANT: turns, the tools as JSON in the system part, a call
# as GLM's key/value layout with LongCat's own tags, results in <longcat_tool_response>.
LONGCAT = FormatSpec(
    tool_format="longcat",
    special=("<longcat_s>", "</longcat_s>", "<longcat_pad>", *_LONGCAT_CALL,
             "<longcat_tool_response>", "</longcat_tool_response>", "<longcat_tool_declare>",
             "</longcat_tool_declare>"),
    eos=("</longcat_s>",),
    pad="<longcat_pad>",
    bos="<longcat_s>",
    favoured=_LONGCAT_CALL,
    template=r"""{{- bos_token -}}
{%- set ns = namespace(round=0) -%}
{%- set loop_messages = messages -%}
{%- if tools or messages[0].role == 'system' -%}
{{- 'SYSTEM:' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}
{%- if tools -%}
{{- '\n\n## Tools\nYou have access to the following tools:\n<longcat_tool_declare>\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '</longcat_tool_declare>\n\nFor each function call, write the function name and its arguments in this format:\n<longcat_tool_call>{function-name}\n<longcat_arg_key>{arg-key-1}</longcat_arg_key>\n<longcat_arg_value>{arg-value-1}</longcat_arg_value>\n</longcat_tool_call>' -}}
{%- endif -%}
{{- '\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'user' -%}
{{- '[Round ' + (ns.round | string) + '] USER:' + message.content -}}
{%- set ns.round = ns.round + 1 -%}
{%- elif message.role == 'assistant' -%}
{{- ' ASSISTANT:' + message.content -}}
{%- for call in message.tool_calls or [] -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<longcat_tool_call>' + call.name + '\n' -}}
{%- for key, value in call.arguments.items() -%}
{{- '<longcat_arg_key>' + key + '</longcat_arg_key>\n<longcat_arg_value>' + (value if value is string else value | tojson) + '</longcat_arg_value>\n' -}}
{%- endfor -%}
{{- '</longcat_tool_call>' -}}
{%- endfor -%}
{{- '</longcat_s>' -}}
{%- elif message.role == 'tool' -%}
{{- ' TOOL:<longcat_tool_response>' + message.content + '</longcat_tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ' ASSISTANT:' -}}{%- endif -%}
""",
)

# MiniCPM5: ChatML turns, the tools in the system turn with the call format
# <function name="f"><param name="p">value</param></function> (no wrapper), results in a
# `tool` turn.
MINICPM5 = FormatSpec(
    tool_format="minicpm5",
    special=("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"),
    eos=("<|im_end|>", "</s>"),
    pad="<unk>",
    bos="<s>",
    favoured=(),  # no marker is a token: the grammar writes every byte of a forced call
    template=r"""{%- set loop_messages = messages -%}
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

_MUSE_CALLS = ("<atem:function_calls>", "</atem:function_calls>")
# Muse Spark (XML_ATEM): header turns, the tools as JSON in the system turn, calls as
# <atem:invoke> blocks with JSON values in one <atem:function_calls> section, results in
# an <atem:function_results> block.
MUSE_SPARK = FormatSpec(
    tool_format="muse_spark",
    special=("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad|>",
             "<|header_start|>", "<|header_end|>", "<|eot|>", *_MUSE_CALLS),
    eos=("<|eot|>", "<|end_of_text|>"),
    pad="<|finetune_right_pad|>",
    bos="<|begin_of_text|>",
    favoured=_MUSE_CALLS,
    template=r"""{{- bos_token -}}
{%- set loop_messages = messages -%}
{%- if tools or messages[0].role == 'system' -%}
{{- '<|header_start|>system<|header_end|>\n\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}
{%- if tools -%}
{{- '\n\nYou can call these functions:\n' -}}
{%- for tool in tools -%}{{- (tool | tojson) + '\n' -}}{%- endfor -%}
{{- '\nTo call them, write:\n<atem:function_calls>\n<atem:invoke name="function_name">\n<atem:parameter name="param_name">JSON value</atem:parameter>\n</atem:invoke>\n</atem:function_calls>' -}}
{%- endif -%}
{{- '<|eot|>' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'tool' -%}
{{- '<|header_start|>tool<|header_end|>\n\n<atem:function_results>\n<atem:result name="' + (message.name or '') + '">' + message.content + '</atem:result>\n</atem:function_results><|eot|>' -}}
{%- else -%}
{{- '<|header_start|>' + message.role + '<|header_end|>\n\n' + message.content -}}
{%- if message.tool_calls -%}
{{- ('\n' if message.content else '') + '<atem:function_calls>\n' -}}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '<atem:invoke name="' + call.name + '">\n' -}}
{%- for key, value in call.arguments.items() -%}
{{- '<atem:parameter name="' + key + '">' + (value | tojson) + '</atem:parameter>\n' -}}
{%- endfor -%}
{{- '</atem:invoke>\n' -}}
{%- endfor -%}
{{- '</atem:function_calls>' -}}
{%- endif -%}
{{- '<|eot|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|header_start|>assistant<|header_end|>\n\n' -}}{%- endif -%}
""",
)

# Kimi K3 (XTML): every message an <|open|>message ...<|sep|> block ended by
# <|close|>message<|sep|><|end_of_msg|>, the answer in a response block, calls in a tools
# block of typed argument blocks, the tools declared as JSON in the system message.
KIMI_K3 = FormatSpec(
    tool_format="kimi_k3",
    special=("[BOS]", "[EOS]", "[PAD]", "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
    eos=("<|end_of_msg|>", "[EOS]"),
    pad="[PAD]",
    bos="[BOS]",
    # The quote after the call's index is the only way out of its digits.
    favoured=("<|open|>", "<|close|>", "<|sep|>", '"'),
    template=r"""{%- macro attr(text) -%}{{- text | replace('&', '&amp;') | replace('"', '&quot;') -}}{%- endmacro -%}
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

NEW_SPECS: tuple[FormatSpec, ...] = (GEMMA4, FUNCTION_GEMMA, LONGCAT, MINICPM5, MUSE_SPARK,
                                     KIMI_K3)
