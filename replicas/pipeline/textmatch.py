"""One streaming matching engine for literal patterns (Aho-Corasick), shared by the stop
matcher and the channel router.

Both processors ask the same two questions of a text stream: where does the first pattern
complete, and how much of the tail could still grow into one (that tail must be held back).
An Aho-Corasick node answers both: it is the longest suffix of the text read so far that is
a prefix of some pattern, so its label *is* the text to hold back. Transitions are a full
table (one dict lookup per character), so the cost per character is O(1) however long the
stream gets.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

ROOT = 0
NO_MATCH = -1


# Where a scan stopped: (node, end, pattern). `pattern` is the index of the pattern that
# completed just before `end`, or NO_MATCH when the whole text was read; `node` is the state
# to resume from. A plain tuple: this runs per token and a NamedTuple costs ~3x to build.
Scan = tuple[int, int, int]


class Automaton:
    """Aho-Corasick automaton over a fixed tuple of non-empty patterns; immutable once built.

    Tie rule: when several patterns complete at the same character (e.g. "b" and "ab"), the
    longest one, i.e. the one that starts earliest, is reported.
    """

    __slots__ = ("patterns", "labels", "_delta", "_out", "_next_start")

    def __init__(self, patterns: Sequence[str]) -> None:
        if not patterns:
            raise ValueError("an automaton needs at least one pattern")
        if any(not p for p in patterns):
            raise ValueError("patterns must be non-empty strings")
        self.patterns: tuple[str, ...] = tuple(patterns)
        goto: list[dict[str, int]] = [{}]
        labels: list[str] = [""]
        terminal: list[int] = [NO_MATCH]
        for index, pattern in enumerate(self.patterns):
            node = ROOT
            for ch in pattern:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    labels.append(labels[node] + ch)
                    terminal.append(NO_MATCH)
                node = nxt
            if terminal[node] == NO_MATCH:  # a duplicate pattern keeps its first index
                terminal[node] = index
        # delta[n]: the full transition function restricted to moves that do not fall back
        # to the root, so one dict lookup per character replaces the failure-link walk.
        # A node's moves are its failure node's moves overlaid with its own trie edges;
        # breadth-first order builds the (shallower) failure node first.
        delta: list[dict[str, int]] = [dict(goto[ROOT])]
        delta.extend({} for _ in range(len(goto) - 1))
        fail = [ROOT] * len(goto)
        # out[n]: the longest pattern that is a suffix of labels[n] (the tie rule).
        out = [NO_MATCH] * len(goto)
        queue = list(goto[ROOT].values())
        for child in queue:
            out[child] = terminal[child]
        for node in queue:
            delta[node] = {**delta[fail[node]], **goto[node]}
            for ch, child in goto[node].items():
                fail[child] = delta[fail[node]].get(ch, ROOT)
                out[child] = terminal[child] if terminal[child] != NO_MATCH else out[fail[child]]
                queue.append(child)
        self._delta = delta
        self._out = out
        # labels[n]: the text node n stands for, i.e. the tail that could still become a
        # pattern; by node id, so callers on the per-token path index it directly.
        self.labels: tuple[str, ...] = tuple(labels)
        # At the root only a pattern's first character can move the automaton, so the scan
        # jumps there with one C-level regex search instead of a Python step per character.
        firsts = "".join(re.escape(ch) for ch in sorted(goto[ROOT]))
        self._next_start = re.compile(f"[{firsts}]").search

    def scan(self, text: str, node: int = ROOT, start: int = 0) -> Scan:
        """Read `text[start:]` from `node` until the first pattern completes."""
        delta, out, next_start = self._delta, self._out, self._next_start
        end = len(text)
        i = start
        while i < end:
            if node == ROOT:
                found = next_start(text, i)
                if found is None:
                    return ROOT, end, NO_MATCH
                i = found.start()
            node = delta[node].get(text[i], ROOT)
            i += 1
            if out[node] != NO_MATCH:
                return node, i, out[node]
        return node, end, NO_MATCH


@lru_cache(maxsize=512)
def compile_patterns(patterns: tuple[str, ...]) -> Automaton:
    """A shared automaton per pattern tuple: per-model stop sets and channel markers repeat
    on every request, so building once keeps request setup cheap."""
    return Automaton(patterns)
