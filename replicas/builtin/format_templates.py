"""Chat templates and token layouts of the tool-format models (`formats.py`), one per family.

Each entry is what a real checkpoint of the family ships, cut down to what tool calling
needs: the special and added tokens its tokenizer has (every marker of its call and result
markup is one token, special where the family's is), and a chat template that writes the
tool list, an assistant's calls in history and the tool results in that family's markup,
as its real template does (reasoning and other extras left out). Orchard detects the
format from these files alone (`replicas.pipeline.tool_formats.detect_tool_format`); the
build checks that it does.

This module holds the ChatML families (Hermes, Qwen3-Coder, LFM2) and `SPECS`, the first
families in their fixed order; the others are by family in `format_templates_llama.py`
(Llama 3.1, Mistral), `format_templates_coding.py` (Kimi K2, GLM-4.7, MiniMax-M2),
`format_templates_harmony.py` (gpt-oss), `format_templates_new.py` (the families mlx-lm
0.32 added) and `format_templates_deepseek.py` (DeepSeek V3.1).
"""

from __future__ import annotations

from .format_spec import FormatSpec
from .format_templates_coding import GLM47, KIMI_K2, MINIMAX_M2
from .format_templates_harmony import HARMONY
from .format_templates_llama import LLAMA3_JSON, MISTRAL

__all__ = ["SPECS", "FormatSpec"]

# ---- ChatML families -----------------------------------------------------------------------

_QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN_PLAIN = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def _qwen(tool_format: str, template: str) -> FormatSpec:
    """A Qwen family's model: Qwen's tokens and <tool_call> markers, its own template."""
    return FormatSpec(tool_format=tool_format, special=_QWEN_TOKENS, plain=_QWEN_PLAIN,
                      eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>",
                      favoured=("<tool_call>", "</tool_call>"), template=template)


# Qwen2.5's template: the tool list in the system turn, calls as JSON in <tool_call>, the
# results of consecutive tool turns in one user turn.
HERMES = _qwen(
    "hermes",
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
)

# Qwen3-Coder's template: tools as <function>/<parameter> XML (extra schema keys such as
# `enum` and `required` as their own tags), calls as <function=NAME><parameter=KEY> blocks.
QWEN3_CODER = _qwen(
    "qwen3_coder",
    r"""{%- macro extra_keys(fields, handled) -%}
{%- for key, value in fields.items() if key not in handled -%}
{{- '\n<' + key + '>' + (value | tojson if value is mapping or (value is sequence and value is not string) else value | string) + '</' + key + '>' -}}
{%- endfor -%}
{%- endmacro -%}
{%- if messages[0].role == 'system' -%}{%- set system_message = messages[0].content -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- if system_message is defined -%}{{- '<|im_start|>system\n' + system_message -}}
{%- elif tools -%}{{- '<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.' -}}{%- endif -%}
{%- if tools -%}
{{- '\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
{%- for tool in tools -%}
{%- set tool = tool.function if tool.function is defined else tool -%}
{{- '\n<function>\n<name>' + tool.name + '</name>' -}}
{%- if tool.description is defined -%}{{- '\n<description>' + (tool.description | trim) + '</description>' -}}{%- endif -%}
{{- '\n<parameters>' -}}
{%- for name, fields in (tool.parameters.properties or {}).items() -%}
{{- '\n<parameter>\n<name>' + name + '</name>' -}}
{%- if fields.type is defined -%}{{- '\n<type>' + (fields.type | string) + '</type>' -}}{%- endif -%}
{%- if fields.description is defined -%}{{- '\n<description>' + (fields.description | trim) + '</description>' -}}{%- endif -%}
{{- extra_keys(fields, ['name', 'type', 'description']) -}}
{{- '\n</parameter>' -}}
{%- endfor -%}
{{- extra_keys(tool.parameters, ['type', 'properties']) -}}
{{- '\n</parameters>\n</function>' -}}
{%- endfor -%}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n</IMPORTANT>' -}}
{%- endif -%}
{%- if system_message is defined or tools -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content and message.content | trim -%}{{- '\n' + (message.content | trim) + '\n' -}}{%- endif -%}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- '\n<tool_call>\n<function=' + call.name + '>\n' -}}
{%- for key, value in call.arguments.items() -%}
{{- '<parameter=' + key + '>\n' -}}
{{- (value | tojson if value is mapping or (value is sequence and value is not string) else value | string) + '\n</parameter>\n' -}}
{%- endfor -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user\n' -}}{%- endif -%}
{{- '<tool_response>\n' + message.content + '\n</tool_response>\n' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""",
)

# LFM2's template: the tool list as JSON between <|tool_list_start|> and <|tool_list_end|>
# in the system turn, results wrapped in <|tool_response_start|> ... <|tool_response_end|>;
# an assistant's calls are written as the model writes them, a Python list of calls.
PYTHONIC = FormatSpec(
    tool_format="pythonic",
    special=("<|pad|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_list_start|>",
             "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
             "<|tool_response_start|>", "<|tool_response_end|>"),
    eos=("<|im_end|>",),
    pad="<|pad|>",
    bos="<|startoftext|>",
    favoured=("<|tool_call_start|>", "<|tool_call_end|>"),
    template=r"""{{- bos_token -}}
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

# The order fixes each model's seed (`formats.py`): a new family goes after all of these.
SPECS: tuple[FormatSpec, ...] = (HERMES, QWEN3_CODER, PYTHONIC, LLAMA3_JSON, MISTRAL, KIMI_K2,
                                 GLM47, MINIMAX_M2, HARMONY)
