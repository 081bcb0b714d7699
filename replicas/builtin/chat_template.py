"""The built-in models' chat template: Qwen3-style ChatML with Qwen3's tool calling.

Kept as Python (not a .jinja file) so it ships with the package without package-data.
With `add_generation_prompt` it opens the assistant turn; when `enable_thinking` is
passed as false it also writes Qwen3's empty think block, so the model answers directly.

Tools follow Qwen3's layout (as transformers passes them: `tools=[{"type": "function",
"function": {...}}]`, call arguments as dicts): the tool list goes into the system turn,
an assistant's calls follow its text as `<tool_call>` blocks, and consecutive tool
results share one user turn of `<tool_response>` blocks.
"""

# Shared with the tokenizer's training corpus, so the BPE learns the words of the block.
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _jinja_string(text: str) -> str:
    # A Python string as a jinja string literal (single-quoted, backslash escapes).
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"'{escaped}'"


def _render_content(image_token: str | None) -> str:
    # Content as a string, or as parts: text parts' text, and (a vision model) the image
    # token where each image part stands, which the processor expands into the image grid.
    if image_token is None:
        parts = "{%- for part in content if part.type == 'text' -%}\n" \
                "            {{- part.text -}}\n"
    else:
        parts = "{%- for part in content -%}\n" \
                "            {{- part.text if part.type == 'text' else (" \
                + _jinja_string(image_token) + " if part.type == 'image' else '') -}}\n"
    return r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is not none -%}
        """ + parts + r"""        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""


def chat_template(image_token: str | None = None) -> str:
    """The template; with `image_token`, image parts render as that token."""
    return _render_content(image_token) + _BODY


_BODY = r"""{%- set system_first = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {#- The tool list extends the system turn, or is one when there is none. -#}
    {{- '<|im_start|>system\n' -}}
    {%- if system_first -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- """ + _jinja_string(TOOLS_HEADER) + r""" -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- """ + _jinja_string(TOOLS_FOOTER) + r""" + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content) -%}
    {%- if loop.first and system_first and tools -%}
        {#- Already written into the tools' system turn. -#}
    {%- elif message.role == 'assistant' -%}
        {#- Like Qwen3, earlier turns keep only their answer, never their reasoning. -#}
        {%- if '</think>' in content -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' + content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set call = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {%- set arguments = call.arguments if call.arguments is string
                                else call.arguments | tojson -%}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + arguments
                + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {#- A run of tool results is one user turn. -#}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""


CHAT_TEMPLATE = chat_template()
