"""The built-in models' chat template: Qwen3-style ChatML, without tool calling.

Kept as Python (not a .jinja file) so it ships with the package without package-data.
With `add_generation_prompt` it opens the assistant turn; when `enable_thinking` is
passed as false it also writes Qwen3's empty think block, so the model answers directly.
"""

CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is not none -%}
        {%- for part in content if part.type == 'text' -%}
            {{- part.text -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content) -%}
    {%- if message.role == 'assistant' -%}
        {#- Like Qwen3, earlier turns keep only their answer, never their reasoning. -#}
        {%- if '</think>' in content -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>user\n<tool_response>\n' + content + '\n</tool_response><|im_end|>\n' -}}
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
