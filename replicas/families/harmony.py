"""Harmony (gpt-oss): its channel format, its tool calls (a message to `functions.NAME`)
and its test model.

gpt-oss writes `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...` and ends on `<|return|>` (or `<|call|>` for a tool call). The marker strings
are the special tokens of the `openai-harmony` encoding; the router sees them as decoded
text, so they are matched as text here. `openai_harmony.load_harmony_encoding()` cannot be
used at run time without network access: it downloads the o200k_base vocab file (pinned by
hash) unless TIKTOKEN_ENCODINGS_BASE or TIKTOKEN_RS_CACHE_DIR points at a local copy. The
unit tests cross-check this format against the package's StreamableParser when it loads.
"""

from __future__ import annotations

from replicas.contract import Channel
from replicas.families.channel_format import ByHeader, ChannelFormat, Rule, State
from replicas.families.family import Family, ModelTemplate
from replicas.families.tool_format import CallGrammar, Syntax, ToolFormat

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
CONSTRAIN = "<|constrain|>"

# Unknown and missing channels go to reasoning: hidden text must never leak into the answer,
# and gpt-oss always writes its answer on `final`. Commentary (preambles) is reasoning;
# composed with the harmony tool format (`compose.with_tools` in the pipeline), a header
# whose recipient is `to=functions.NAME` opens a tool call instead.
_BY_CHANNEL = ByHeader(
    routes={"analysis": "analysis", "commentary": "analysis", "final": "final"},
    default="analysis",
)
# The recipient may also sit in the role part of the header, which the generation prompt
# `<|start|>assistant` leaves open: the encoder renders a call as `<|start|>assistant
# to=functions.NAME<|channel|>commentary ...`, so a completion may begin ` to=functions.NAME`.
# The opening ` to=` is swallowed as a marker, hence the recipient is read without `to=`.
ROLE_RECIPIENT = " to="
_BY_ROLE_RECIPIENT = ByHeader(
    routes=_BY_CHANNEL.routes, default=_BY_CHANNEL.default, call_prefix="functions."
)


def _message_rules(state: str) -> tuple[Rule, ...]:
    """Rules inside a message body: a header or message end leaves; stray markers vanish."""
    return (
        Rule(START, "header"),
        Rule(CHANNEL, "header"),
        Rule(END, "between"),
        Rule(RETURN, "between"),
        Rule(CALL, "between"),
        Rule(MESSAGE, state),
        Rule(CONSTRAIN, state),
    )


# Outside a message: a new header starts, the header's `<|message|>` opens its channel, and
# the end markers return to "between".
_HEADER_RULES = (
    Rule(START, "header"),
    Rule(CHANNEL, "header"),
    Rule(MESSAGE, _BY_CHANNEL),
    Rule(END, "between"),
    Rule(RETURN, "between"),
    Rule(CALL, "between"),
)


# The role-part recipient's header: like `_HEADER_RULES`, but the channel is read after it.
_ROLE_RECIPIENT_RULES = (
    Rule(START, "header"),
    Rule(CHANNEL, "recipient_header"),
    Rule(MESSAGE, _BY_ROLE_RECIPIENT),
    Rule(END, "between"),
    Rule(RETURN, "between"),
    Rule(CALL, "between"),
)

HARMONY = ChannelFormat(
    name="harmony",
    states={
        # Text before any header (a model that skips the protocol) is the answer.
        "answer": State(Channel.ANSWER, _message_rules("answer")),
        # After the generation prompt `<|start|>assistant`: the answer too, unless the very
        # first thing written is a role-part recipient (` to=functions.NAME<|channel|>`).
        "opening": State(
            Channel.ANSWER,
            (*_message_rules("answer"), Rule(ROLE_RECIPIENT, "recipient", at_start=True)),
        ),
        "analysis": State(Channel.REASONING, _message_rules("analysis")),
        "final": State(Channel.ANSWER, _message_rules("final")),
        # Between messages nothing is content. `<|start|>` and `<|channel|>` re-enter the
        # header so the channel name is the first word read after the last of them;
        # `<|constrain|>json` stays inside the swallowed header text.
        "between": State(None, (*_HEADER_RULES, Rule(CONSTRAIN, "between"))),
        "header": State(None, _HEADER_RULES),
        "recipient": State(None, _ROLE_RECIPIENT_RULES),
        "recipient_header": State(None, _ROLE_RECIPIENT_RULES),
    },
    answer_state="answer",
    reasoning_state="analysis",
    reasoning_end=f"{END}{START}assistant{CHANNEL}final{MESSAGE}",
    prompt_states=(
        (f"{CHANNEL}analysis{MESSAGE}", "analysis"),
        (f"{CHANNEL}commentary{MESSAGE}", "analysis"),
        (f"{CHANNEL}final{MESSAGE}", "final"),
        (f"{START}assistant", "opening"),
    ),
    signature=(CHANNEL, MESSAGE),
)

# gpt-oss: the grammar covers the whole completion after the prompt's
# `<|start|>assistant`: an optional analysis message, then the final message or one
# call (`<|call|>` ends the turn). The encoder writes the recipient after the role
# (` to=functions.x<|channel|>commentary ...`); models also write it after the channel.
HARMONY_TOOLS = ToolFormat(
    name="harmony",
    syntax=Syntax.RAW,
    signature=("<|channel|>", "to=functions"),
    channel_format="harmony",
    grammar=CallGrammar(
        trigger="<|channel|>",
        head="<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
        alt_heads=(" to=functions.{name}<|channel|>commentary <|constrain|>json<|message|>",),
        tail="<|call|>",
        markers=("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>",
                 "<|end|>"),
        text_open="<|channel|>final<|message|>",
        preamble=("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant"),
        start="reasoning_end",
        forced_end=END,
    ),
    # Only `<|call|>` is the calls' own: every other Harmony marker also frames plain
    # messages (and the channel format already keeps them all out of the answer).
    reserved=("<|call|>",),
)

_HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
            "<|call|>")
# gpt-oss's template: the tools as a TypeScript namespace in the developer message, a call as
# an assistant message to=functions.NAME on the commentary channel ending in <|call|>, its
# result as a message from functions.NAME back to the assistant.
TEMPLATE = ModelTemplate(
    special=("<|endoftext|>", *_HARMONY),
    eos=("<|return|>", "<|call|>"),
    pad="<|endoftext|>",
    favoured=("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"),
    seed=8,
    chat_template=r"""{%- macro ts_type(s) -%}
{%- if s.enum is defined -%}{%- for v in s.enum -%}{{- (v | tojson) + (' | ' if not loop.last else '') -}}{%- endfor -%}
{%- elif s.type == 'string' -%}{{- 'string' -}}
{%- elif s.type == 'number' or s.type == 'integer' -%}{{- 'number' -}}
{%- elif s.type == 'boolean' -%}{{- 'boolean' -}}
{%- elif s.type == 'array' -%}{{- (ts_type(s['items']) if s['items'] is defined else 'any') + '[]' -}}
{%- else -%}{{- 'any' -}}{%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: ' + (reasoning_effort or 'medium') + '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- '<|end|>' -}}
{%- if messages[0].role == 'system' -%}{%- set instructions = messages[0].content -%}{%- set messages = messages[1:] -%}{%- endif -%}
{%- if tools or instructions is defined -%}
{{- '<|start|>developer<|message|>' -}}
{%- if instructions is defined -%}{{- '# Instructions\n\n' + instructions + ('\n\n' if tools else '') -}}{%- endif -%}
{%- if tools -%}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
{%- for tool in tools -%}
{%- set tool = tool.function if tool.function is defined else tool -%}
{{- '// ' + (tool.description or '') + '\ntype ' + tool.name + ' = (_: {\n' -}}
{%- for name, prop in ((tool.parameters or {}).properties or {}).items() -%}
{%- if prop.description is defined -%}{{- '// ' + prop.description + '\n' -}}{%- endif -%}
{{- name + ('' if name in (tool.parameters.required or []) else '?') + ': ' + ts_type(prop) + ',\n' -}}
{%- endfor -%}
{{- '}) => any;\n\n' -}}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- set last = namespace(name='') -%}
{%- for message in messages -%}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{%- set last.name = call.name -%}
{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' + (call.arguments | tojson) + '<|call|>' -}}
{%- endfor -%}
{%- elif message.role == 'assistant' -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' -}}
{%- elif message.role == 'tool' -%}
{{- '<|start|>functions.' + (message.name or last.name) + ' to=assistant<|channel|>commentary<|message|>' + (message.content | tojson) + '<|end|>' -}}
{%- else -%}
{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}
""",
)

FAMILY = Family("harmony", reasoning=HARMONY, tools=HARMONY_TOOLS, template=TEMPLATE)
