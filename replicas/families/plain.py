"""The plain family: a model with no markup Orchard knows. Everything it writes is answer
text (channel format `none`) and it makes no calls (tool format `none`). Both have empty
signatures, which every model matches: the registry puts this family last, so detection
falls back to it.
"""

from __future__ import annotations

from replicas.contract import Channel
from replicas.families.channel_format import ChannelFormat, State
from replicas.families.family import Family
from replicas.families.tool_format import Syntax, ToolFormat

__all__ = ["FAMILY", "NO_CALLS", "NO_REASONING"]

NO_REASONING = ChannelFormat(
    name="none",
    states={"answer": State(Channel.ANSWER)},
    answer_state="answer",
    reasoning_state=None,
    reasoning_end="",
)
NO_CALLS = ToolFormat(name="none", syntax=Syntax.NONE)

FAMILY = Family("plain", reasoning=NO_REASONING, tools=NO_CALLS)
