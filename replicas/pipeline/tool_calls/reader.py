"""What every incremental reader of a call's markup shares: the sink it reports to (the
parser), the JSON object of arguments it builds for the sink piece by piece, giving a
malformed call's text back as text, and ignoring text after the calls, said once.

Every reader is built the same way, `Reader(sink, tool_format, boundary)`, so the parser
picks one from its table by the tool format's syntax (`parser.READERS`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Sink(Protocol):
    """What a call reader reports to (the parser)."""

    def start(self, name: str) -> bool: ...  # False: the name is rejected
    def delta(self, text: str) -> None: ...
    def end(self) -> None: ...
    def text(self, raw: str, why: str) -> None: ...  # malformed: give the text back
    def warn(self, why: str) -> None: ...
    def schema(self, name: str) -> Mapping[str, Any] | None: ...
    @property
    def calls(self) -> int: ...  # calls started so far

# States every reader has besides its own (which count up from 0).
TAIL = -1  # after the calls: text is ignored
FAILED = -2  # the markup was not a call: its text goes back to the answer


class CallReader:
    """The base of a reader of one call's text (or one section's); `_after` names what
    ignored text follows."""

    __slots__ = ("_sink", "_state", "_raw", "_count", "_warned")
    _after = "the calls"

    def __init__(self, sink: Sink, marker: str, state: int) -> None:
        self._sink = sink
        self._state = state
        self._raw = marker  # the text of a call not yet started, for a fallback
        self._count = 0  # arguments emitted in the current call
        self._warned = False

    def _settled(self, text: str) -> bool:
        """Whether `text` is dealt with already: after a failure it goes back as text, after
        the calls it is ignored."""
        if self._state == FAILED:
            self._sink.text(text, "")
            return True
        if self._state == TAIL:
            self._ignore(text)
            return True
        return False

    def close(self, marker: str) -> None:
        """The call's close marker, or the end of the stream (""): after a failure the
        marker goes back as text, else the reader's own `_close`."""
        if self._state == FAILED:
            if marker:
                self._sink.text(marker, "")
        else:
            self._close(marker)

    def _close(self, marker: str) -> None:
        raise NotImplementedError

    def _end_call(self) -> None:
        if self._count:
            self._sink.delta("}")
        self._sink.end()  # no arguments: the parser makes it "{}"
        self._count = 0

    def _fail(self, why: str, marker: str = "") -> None:
        self._state = FAILED
        self._sink.text(self._raw + marker, why)
        self._raw = ""

    def _ignore(self, text: str) -> None:
        if text.strip() and not self._warned:
            self._warned = True
            self._sink.warn(f"text after {self._after} is ignored")


class BufferedReader(CallReader):
    """A reader that scans a growing buffer: `_step` until it can go no further. Text read in
    the first state (0: before a call is known) is also kept raw, for the fallback."""

    __slots__ = ("_buf",)

    def __init__(self, sink: Sink, marker: str) -> None:
        super().__init__(sink, marker, 0)
        self._buf = ""  # unread text

    def feed(self, text: str) -> None:
        if self._settled(text):
            return
        if self._state == 0:
            self._raw += text
        self._buf += text
        while self._step():
            pass

    def _step(self) -> bool:
        raise NotImplementedError

    def _fail(self, why: str, marker: str = "") -> None:
        super()._fail(why, marker)
        self._buf = ""
