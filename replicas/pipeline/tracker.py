"""One request's channel tracking: each token detokenized and routed once, for two readers.

A request under a grammar or a thinking budget has two readers of its tokens: the
`RequestController`, which runs inside the batch step as a logits processor and sees each
token one step early, and the `RequestDecoder`, which sees it after the step. Both need the
same answer (which channel the token's text went to, and the text itself), so the first
reader to reach a token feeds it through the detokenizer and the channel router, and the
other reads what it found. Each reader is a `Cursor` with its own position.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from replicas.contract import Channel
from replicas.families.channel_format import ChannelFormat
from replicas.pipeline.channels import ChannelRouter, Routed
from replicas.pipeline.detokenizer import Decode, Detokenizer


@dataclass(frozen=True, slots=True)
class Routing:
    """What one token became: its text's pieces in stream order (markers removed, call
    boundaries included) and the channel before and after it."""

    token: int
    pieces: tuple[Routed, ...]
    before: Channel
    after: Channel
    reasoning_ended: bool  # a reasoning block has closed, up to and including this token


class ChannelTracker:
    def __init__(self, decode: Decode, fmt: ChannelFormat, initial: Channel,
                 state: str | None) -> None:
        self.detokenizer = Detokenizer(decode)
        self.router = ChannelRouter(fmt, initial, state=state)
        self._log: deque[Routing] = deque()  # tokens not yet read by every cursor
        self._base = 0  # the position of `_log[0]`
        self._cursors: list[Cursor] = []

    def cursor(self) -> Cursor:
        """A new reader, from the first token on."""
        if self._base or self._log:
            raise RuntimeError("a cursor must be made before the first token")
        cursor = Cursor(self)
        self._cursors.append(cursor)
        return cursor

    def _at(self, position: int, token: int) -> Routing:
        end = self._base + len(self._log)
        if position == end:
            routing = self._feed(token)
            self._log.append(routing)
        elif self._base <= position < end:
            routing = self._log[position - self._base]
            if routing.token != token:
                raise RuntimeError(f"token {token} at {position}, where {routing.token} was "
                                   "routed: the readers disagree")
        else:
            raise RuntimeError(f"token position {position} outside {self._base}..{end}")
        return routing

    def _trim(self) -> None:
        # What every reader has passed is never read again.
        low = min(c.position for c in self._cursors)
        while self._log and self._base < low:
            self._log.popleft()
            self._base += 1

    def _feed(self, token: int) -> Routing:
        router = self.router
        before = router.channel
        pieces = router.feed_with_calls(self.detokenizer.feed(token))
        return Routing(token, tuple(pieces), before, router.channel, router.reasoning_ended)


class Cursor:
    """One reader's place in the tracker's token stream."""

    __slots__ = ("_tracker", "position")

    def __init__(self, tracker: ChannelTracker) -> None:
        self._tracker = tracker
        self.position = 0  # the next token this reader will read

    def read(self, token: int) -> Routing:
        tracker = self._tracker
        if len(tracker._cursors) == 1:  # the decoder alone (most requests): nothing to keep
            return tracker._feed(token)
        routing = tracker._at(self.position, token)
        self.position += 1
        tracker._trim()
        return routing
