"""The channel router: splits a reasoning model's decoded text into reasoning and answer.

Channel formats are data, one per model family (`replicas/families/`, their registry in
`replicas.families.registry`); this module runs one: the prompt-based start state and the
streaming router. Markers never reach a channel, however they are split across tokens:
like the stop matcher, the router holds back only a tail that could still become a
marker, using the same matching engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from replicas.contract import Channel, TextDelta
from replicas.families.channel_format import ByHeader, ChannelFormat
from replicas.pipeline.textmatch import NO_MATCH, ROOT, Automaton, compile_patterns

__all__ = [
    "CallBoundary",
    "ChannelRouter",
    "Routed",
    "initial_channel",
    "initial_state",
]


@dataclass(frozen=True, slots=True)
class CallBoundary:
    """Router output, between text pieces: a tool call opens or closes.

    `marker` is the marker text that fired ("" when a new call implicitly closes the last),
    so a malformed call can be given back as the text the model wrote. `name` is the
    recipient read from the header (Harmony) on an open, else None.
    """

    opened: bool
    marker: str
    name: str | None = None


# Only a header's first word is used, so a runaway header costs bounded memory.
_HEADER_LIMIT = 64
_FIRST_WORD = re.compile(r"[^\s<]*")
# All header text since the last message, for a recipient that may precede `<|channel|>`.
_HEADERS_LIMIT = 256

# What a router with tool states reports: text pieces and call boundaries, in stream order.
Routed = TextDelta | CallBoundary


def initial_state(fmt: ChannelFormat, rendered_prompt: str) -> str:
    """The state the output starts in, from how the rendered prompt ends.

    A prompt ending in an opened reasoning block (DeepSeek-R1's "<think>\\n") starts in
    reasoning; one ending in a closed block (Qwen3's "<think>\\n\\n</think>\\n\\n" when thinking
    is off) starts in the answer, where "<think>" is then plain text.
    """
    tail = rendered_prompt.rstrip()
    for suffix, state in fmt.prompt_states:
        if tail.endswith(suffix):
            return state
    return fmt.answer_state


def initial_channel(fmt: ChannelFormat, rendered_prompt: str) -> Channel:
    channel = fmt.states[initial_state(fmt, rendered_prompt)].channel
    assert channel is not None  # ChannelFormat checks that start states are content states
    return channel


_Target = str | ByHeader


def _recipient(headers: str, prefix: str) -> str | None:
    found = re.search(re.escape(prefix) + r"([^\s<]+)", headers)
    return found.group(1) if found else None


class ChannelRouter:
    """Streaming router for one request: `feed()` decoded text, then `finish()`.

    Start it with `state=initial_state(fmt, rendered_prompt)` to honour what the prompt
    opened, or with `initial` for the format's default answer or reasoning state.
    `feed()` returns text pieces only; with a format that has tool states,
    `feed_with_calls()` also reports where each call opens and closes.
    """

    __slots__ = (
        "_fmt",
        "_calls",
        "_tables",
        "_starts",
        "_automaton",
        "_targets",
        "_node",
        "_content",
        "_channel",
        "_strip",
        "_header",
        "_headers",
        "_blank",
        "_reasoning_ended",
        "_finished",
    )

    def __init__(
        self,
        fmt: ChannelFormat,
        initial: Channel = Channel.ANSWER,
        *,
        state: str | None = None,
    ) -> None:
        if state is None:
            state = fmt.answer_state if initial is Channel.ANSWER else fmt.reasoning_state
            if state is None:
                raise ValueError(f"channel format {fmt.name!r} has no reasoning channel")
        elif state not in fmt.states or fmt.states[state].channel is None:
            raise ValueError(f"{state!r} is not a content state of format {fmt.name!r}")
        self._fmt = fmt
        self._calls = fmt.has_calls
        # Per state: the automaton over its markers, each marker's target and whether it
        # fires only at the start of the state, by pattern index.
        self._tables: dict[
            str, tuple[Automaton | None, tuple[_Target, ...], tuple[bool, ...]]
        ] = {}
        for name, spec in fmt.states.items():
            markers = tuple(rule.marker for rule in spec.rules)
            automaton = compile_patterns(markers) if markers else None
            self._tables[name] = (
                automaton,
                tuple(rule.to for rule in spec.rules),
                tuple(rule.at_start for rule in spec.rules),
            )
        # The current state, as _enter() sets it up:
        self._automaton: Automaton | None = None
        self._targets: tuple[_Target, ...] = ()
        self._starts: tuple[bool, ...] = ()
        self._node = ROOT
        self._content: Channel | None = None  # its channel; None in a header
        self._strip = ""  # leading text still to drop: "nl" newlines, "all" whitespace
        self._header = ""  # the header text read so far (bounded)
        self._headers = ""  # all header text since the last content state (bounded)
        self._blank = True  # the current state's content so far is whitespace only
        self._channel = Channel.ANSWER  # the last content channel
        self._reasoning_ended = False
        self._finished = False
        self._enter(state)

    @property
    def channel(self) -> Channel:
        """The current channel; inside a header, the channel of the message before it."""
        return self._channel

    @property
    def reasoning_ended(self) -> bool:
        """A reasoning block has closed at least once."""
        return self._reasoning_ended

    def feed(self, text: str) -> list[TextDelta]:
        """Pieces in stream order, markers removed, same-channel neighbours merged."""
        pieces = self.feed_with_calls(text)
        if not self._calls:
            return [p for p in pieces if isinstance(p, TextDelta)]  # there are no others
        merged: list[TextDelta] = []
        for piece in pieces:
            if not isinstance(piece, TextDelta):
                continue
            if merged and merged[-1].channel is piece.channel:
                merged[-1] = TextDelta(piece.channel, merged[-1].text + piece.text)
            else:
                merged.append(piece)
        return merged

    def finish(self) -> list[TextDelta]:
        """End of stream: the held tail is content of the current state after all."""
        return [p for p in self.finish_with_calls() if isinstance(p, TextDelta)]

    def feed_with_calls(self, text: str) -> list[Routed]:
        """`feed()` plus a `CallBoundary` wherever a tool call opens or closes; text
        pieces of one channel are merged only within one call."""
        if self._finished:
            raise RuntimeError("ChannelRouter.feed() after finish()")
        pieces: list[Routed] = []
        start, end = 0, len(text)
        while start < end:
            automaton = self._automaton
            if automaton is None:
                self._emit(text[start:], pieces)
                break
            held = automaton.labels[self._node]
            node, stop, pattern = automaton.scan(text, self._node, start)
            if pattern == NO_MATCH:
                self._node = node
                keep = len(held) + end - start - len(automaton.labels[node])
                self._emit((held + text[start:])[:keep], pieces)
                break
            # The marker is a suffix of held + text[start:stop]; what precedes it is content.
            before = len(held) + stop - start - len(automaton.patterns[pattern])
            self._emit((held + text[start:stop])[:before], pieces)
            marker = automaton.patterns[pattern]
            if self._starts[pattern] and not self._blank:
                self._emit(marker, pieces)  # a start-only marker after content is content
                self._node = ROOT
            else:
                self._fire(self._targets[pattern], marker, pieces)
            start = stop
        return pieces

    def finish_with_calls(self) -> list[Routed]:
        """`finish()`; an open call is left for the consumer to end (no boundary here)."""
        pieces: list[Routed] = []
        if not self._finished and self._automaton is not None:
            self._emit(self._automaton.labels[self._node], pieces)
        self._node = ROOT
        self._finished = True
        return pieces

    def _emit(self, text: str, pieces: list[Routed]) -> None:
        if self._strip and text:
            text = text.lstrip() if self._strip == "all" else text.lstrip("\n")
            if text:
                self._strip = ""
        if not text:
            return
        channel = self._content
        if channel is None:
            room = _HEADER_LIMIT - len(self._header)
            if room > 0:
                self._header += text[:room]
            room = _HEADERS_LIMIT - len(self._headers)
            if room > 0:
                self._headers += text[:room]
            return
        if self._blank and not text.isspace():
            self._blank = False
        last = pieces[-1] if pieces else None
        if isinstance(last, TextDelta) and last.channel is channel:
            pieces[-1] = TextDelta(channel, last.text + text)
        else:
            pieces.append(TextDelta(channel, text))

    def _fire(self, target: _Target, marker: str, pieces: list[Routed]) -> None:
        call: str | None = None
        if isinstance(target, ByHeader):
            calls = target.calls
            if calls is not None:
                call = _recipient(self._headers, target.call_prefix)
            if calls is not None and call is not None:
                target = calls
            else:
                word = _FIRST_WORD.match(self._header.lstrip())
                target = target.routes.get(word.group() if word else "", target.default)
        self._enter(target, marker, call, pieces)

    def _enter(
        self, name: str, marker: str = "", call: str | None = None,
        pieces: list[Routed] | None = None,
    ) -> None:
        spec = self._fmt.states[name]
        if self._calls and pieces is not None:
            # Every entry into a TOOL state, re-entry included, is a new call.
            entering = spec.channel is Channel.TOOL
            if self._content is Channel.TOOL:
                pieces.append(CallBoundary(False, "" if entering else marker))
            if entering:
                pieces.append(CallBoundary(True, marker, call))
        if self._content is Channel.REASONING and spec.channel is not Channel.REASONING:
            self._reasoning_ended = True
        self._content = spec.channel
        if spec.channel is not None:
            self._channel = spec.channel
            self._headers = ""
        elif self._headers and len(self._headers) < _HEADERS_LIMIT:
            self._headers += " "  # a marker separates words: "to=functions.x<|channel|>"
        self._automaton, self._targets, self._starts = self._tables[name]
        self._node = ROOT
        self._strip = (
            "all" if spec.strip_leading_whitespace
            else "nl" if spec.strip_leading_newlines else ""
        )
        self._blank = True
        self._header = ""
