"""The stop matcher: cuts the answer text at the first completed stop string.

Stops are matched on decoded text, so any tokenization of a stop string stops generation.
Only text that could still grow into a stop (a proper prefix of one) is held back; the rest
is emitted at once and never retracted. Matching runs on the shared Aho-Corasick engine, so
the cost per character does not grow with the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replicas.contract import FinishReason
from replicas.pipeline.textmatch import NO_MATCH, ROOT, Automaton, compile_patterns


@dataclass(frozen=True, slots=True)  # slots: half the construction cost, once per token
class StopOutput:
    text: str  # safe to emit now; never retracted later
    matched: str | None = None  # the stop string, as the user gave it, once a match completed


class StopMatcher:
    """Streaming stop-string matcher over answer text: `feed()` chunks, then `finish()`.

    The earliest-completing match wins; when several stops complete at the same character
    (e.g. "b" and "ab" on "ab"), the longest one, which starts earliest, is the match, so the
    most text is cut and the report names the stop that was actually written out in full.
    """

    __slots__ = ("_automaton", "_labels", "_include", "_node", "_matched", "_ended")

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        unique = tuple(dict.fromkeys(stops))
        self._automaton: Automaton | None = compile_patterns(unique) if unique else None
        self._labels: tuple[str, ...] = self._automaton.labels if self._automaton else ("",)
        self._include = include_in_output
        self._node = ROOT
        self._matched: str | None = None
        self._ended = False  # matched or finished: feeding more is a caller bug

    @property
    def matched(self) -> str | None:
        return self._matched

    @property
    def held(self) -> str:
        """Text read but not yet emitted: the longest tail that is a proper prefix of a stop."""
        return self._labels[self._node]

    def feed(self, text: str) -> StopOutput:
        if self._ended:
            raise RuntimeError("StopMatcher.feed() after the stream ended")
        automaton = self._automaton
        if automaton is None:
            return StopOutput(text)
        labels = self._labels
        held = labels[self._node]
        node, end, pattern = automaton.scan(text, self._node)
        if pattern == NO_MATCH:
            self._node = node
            # The new held text is the new node's label, a suffix of held + text.
            keep = len(held) + len(text) - len(labels[node])
            return StopOutput((held + text)[:keep] if held else text[:keep])
        stop = automaton.patterns[pattern]
        self._matched = stop
        self._ended = True
        self._node = ROOT
        # The match ends at `end` and is at most as long as held + text[:end] (it is a suffix
        # of the node's label), so its start lies inside the text we still have.
        before = (held + text[:end])[: len(held) + end - len(stop)]
        return StopOutput(before + stop if self._include else before, stop)

    def finish(self, reason: FinishReason) -> str:
        """End of stream: the held text to flush, or "" when the request was cancelled."""
        if reason is FinishReason.STOP_SEQUENCE and self._matched is None:
            raise ValueError("finish(STOP_SEQUENCE) without a matched stop string")
        held = self.held
        self._node = ROOT
        self._ended = True
        return "" if reason is FinishReason.CANCELLED else held


def merge_stops(defaults: Sequence[str], requested: Sequence[str]) -> tuple[str, ...]:
    """Per-model default stops plus request stops: union, defaults first, duplicates dropped."""
    return tuple(dict.fromkeys([*defaults, *requested]))
