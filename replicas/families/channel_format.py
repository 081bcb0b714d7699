"""The data model of a channel format: a small state machine over literal markers.

A channel format is a set of named states. A content state sends its text to one channel;
a header state (channel None) swallows its text but remembers the start of it, so a rule
leaving it can pick the next state from the header's first word (Harmony's
`<|channel|>final`). Rules fire on literal marker text, which never reaches any channel.
Each family module fills one in (`reasoning.py` holds the shared `<think>` shape); the
pipeline's router (`replicas/pipeline/channels.py`) runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from replicas.contract import Channel


@dataclass(frozen=True)
class ByHeader:
    """Next state chosen by the first word of the header text read in the current state."""

    routes: Mapping[str, str]
    default: str  # for an empty or unknown header
    # A header naming a function recipient ("to=functions.NAME", anywhere in the headers
    # since the last message) goes to `calls`, a TOOL state: Harmony's tool calls.
    calls: str | None = None
    call_prefix: str = "to=functions."


@dataclass(frozen=True)
class Rule:
    marker: str
    to: str | ByHeader  # a state name; the same state re-enters it (swallow the marker)
    # Fires only while the state's text so far is whitespace (Llama 3's bare `{"name"` call
    # must start the answer); anywhere else the marker is plain content of the state.
    at_start: bool = False


@dataclass(frozen=True)
class State:
    channel: Channel | None  # None: a header, swallowed
    rules: tuple[Rule, ...] = ()
    # Drop every "\n" at the start of this state's text, each time the state is entered:
    # templates put newlines around markers that are layout, not content.
    strip_leading_newlines: bool = False
    # Drop all leading whitespace (between tool calls, where only another call may follow).
    strip_leading_whitespace: bool = False


@dataclass(frozen=True)
class ChannelFormat:
    name: str
    states: Mapping[str, State]
    answer_state: str  # where output starts by default
    reasoning_state: str | None  # where output starts when the prompt opened reasoning
    reasoning_end: str  # text to force when a thinking budget is spent; "" without reasoning
    # (suffix, state): a rendered prompt that ends with `suffix` (trailing whitespace
    # ignored) starts the output in `state`; first hit wins, otherwise `answer_state`.
    prompt_states: tuple[tuple[str, str], ...] = ()
    # Texts that identify the format when all are in a chat template or a vocabulary.
    signature: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "states", MappingProxyType(dict(self.states)))
        self._check()

    @property
    def has_calls(self) -> bool:
        return any(s.channel is Channel.TOOL for s in self.states.values())

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker of the format: none of these may reach a channel."""
        return tuple(dict.fromkeys(r.marker for s in self.states.values() for r in s.rules))

    def _check(self) -> None:
        # Formats are code-reviewed data; a typo should fail at import, not mid-request.
        def content_state(name: str | None, channel: Channel, what: str) -> None:
            state = self.states.get(name) if name is not None else None
            if state is None or state.channel is not channel:
                raise ValueError(f"{self.name}: {what} {name!r} is not a {channel.value} state")

        content_state(self.answer_state, Channel.ANSWER, "answer_state")
        if self.reasoning_state is not None:
            content_state(self.reasoning_state, Channel.REASONING, "reasoning_state")
        for suffix, name in self.prompt_states:
            if not suffix or name not in self.states or self.states[name].channel is None:
                raise ValueError(f"{self.name}: bad prompt state {(suffix, name)!r}")
        for name, state in self.states.items():
            markers = [r.marker for r in state.rules]
            if "" in markers or len(set(markers)) != len(markers):
                raise ValueError(f"{self.name}.{name}: markers must be non-empty and unique")
            for rule in state.rules:
                targets = (
                    [rule.to]
                    if isinstance(rule.to, str)
                    else [*rule.to.routes.values(), rule.to.default]
                )
                if any(t not in self.states for t in targets):
                    raise ValueError(f"{self.name}.{name}: rule {rule.marker!r} -> unknown state")
                if isinstance(rule.to, ByHeader) and rule.to.calls is not None:
                    content_state(rule.to.calls, Channel.TOOL, "header calls state")
