"""The Harmony channel format (gpt-oss), as text-level markers.

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
from replicas.pipeline.channel_formats import ByHeader, ChannelFormat, Rule, State

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
CONSTRAIN = "<|constrain|>"

# Unknown and missing channels go to reasoning: hidden text must never leak into the answer,
# and gpt-oss always writes its answer on `final`. Commentary (preambles) is reasoning;
# composed with the harmony tool format (`tool_formats.with_tools`), a header whose
# recipient is `to=functions.NAME` opens a tool call instead.
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
