"""The tool-call parser: TOOL-channel text and call boundaries in, ToolCall* events out.

The router (`channels.py`, with a format from `tool_formats.with_tools`) cuts each call's
text out of the stream and reports where calls open and close; this parser reads that text
by the tool format's syntax. Like every stage it is `feed()` plus `finish()`.

- A call starts (`ToolCallStart`) as soon as its name is known and the markup is
  well-formed so far; JSON arguments then stream as the model writes them, cut exactly at
  the end of the arguments value (`ToolCallDelta`s add up to `ToolCallEnd.arguments`).
- Markup that is not a call before its name is known (no grammar forced it) comes back as
  answer text, markers included, and is logged at WARNING; nothing here raises.
- Once started, a call always ends: a later problem (bad JSON arguments, junk after the
  value, a cut by max_tokens) ends it with the text it had, because the client already has
  the start and clients handle bad arguments better than a retracted call.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from replicas.contract import (
    Channel,
    OutputEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from replicas.pipeline.channel_formats import CallBoundary
from replicas.pipeline.tool_formats import Syntax, ToolFormat
from replicas.pipeline.tool_gemma import GemmaSegment
from replicas.pipeline.tool_glm import KeyValueSegment
from replicas.pipeline.tool_json import CallObject, ValueScanner, skip_ws
from replicas.pipeline.tool_pythonic import PythonicSegment
from replicas.pipeline.tool_xml import XmlSegment
from replicas.pipeline.tool_xtml import XtmlSegment

_log = logging.getLogger(__name__)
_NAME_LIMIT = 256  # Mistral's `NAME[ARGS]`: a longer name is not a call


def new_call_id() -> str:
    return uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolParsing:
    """How one request's calls are read.

    `names`: the offered tool names; a call to another name is malformed (text). None:
    any name. `schemas`: tool name -> its parameters JSON schema (Qwen3-Coder's values
    convert by it). `new_id` makes the ids of `ToolCallStart`.
    """

    format: ToolFormat
    names: frozenset[str] | None = None
    schemas: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    new_id: Callable[[], str] = new_call_id

    @classmethod
    def from_specs(
        cls, fmt: ToolFormat, tools: Sequence[ToolSpec], *,
        new_id: Callable[[], str] = new_call_id,
    ) -> ToolParsing:
        """From a request's tools; an empty tuple accepts any name."""
        schemas: dict[str, Mapping[str, Any]] = {}
        for tool in tools:
            try:
                schema = json.loads(tool.parameters)
            except ValueError:
                schema = None
            if isinstance(schema, dict):
                schemas[tool.name] = schema
        names = frozenset(t.name for t in tools) if tools else None
        return cls(fmt, names, schemas, new_id)


class ToolCallParser:
    """Streaming parser of one response's tool calls.

    `feed()` takes the router's TOOL-channel text and `CallBoundary` items in stream order
    and returns events: ToolCallStart/Delta/End, or TextDelta(ANSWER) for malformed markup.
    `finish()` ends a call cut off by the end of the stream.
    """

    __slots__ = ("_parsing", "_names", "_out", "_segment", "_count", "_index", "_args")

    def __init__(self, parsing: ToolParsing) -> None:
        self._parsing = parsing
        self._names: Collection[str] | None = parsing.names
        self._out: list[OutputEvent] = []
        self._segment: _Segment | None = None
        self._count = 0  # calls started
        self._index: int | None = None  # the call in progress
        self._args: list[str] = []

    @property
    def calls(self) -> int:
        """How many calls have started."""
        return self._count

    def feed(self, item: str | CallBoundary) -> list[OutputEvent]:
        if isinstance(item, CallBoundary):
            if self._segment is not None:
                self._segment.close("" if item.opened else item.marker)
                self._segment = None
            if item.opened:
                self._segment = self._open(item)
        elif item:
            if self._segment is None:  # TOOL text without an open: read it as a call
                self._segment = self._open(CallBoundary(True, ""))
            self._segment.feed(item)
        return self._flush()

    def finish(self) -> list[OutputEvent]:
        if self._segment is not None:
            self._segment.close("")
            self._segment = None
        return self._flush()

    def _flush(self) -> list[OutputEvent]:
        out, self._out = self._out, []
        return out

    def _open(self, boundary: CallBoundary) -> _Segment:
        fmt = self._parsing.format
        if fmt.syntax is Syntax.XML:
            return XmlSegment(self, boundary.marker, fmt.xml)
        if fmt.syntax is Syntax.KEY_VALUE:
            return KeyValueSegment(self, boundary.marker, fmt.kv)
        if fmt.syntax is Syntax.GEMMA:
            return GemmaSegment(self, boundary.marker, fmt.gemma.quote)
        if fmt.syntax is Syntax.XTML:
            return XtmlSegment(self, boundary.marker)
        if fmt.syntax is Syntax.PYTHONIC:
            return PythonicSegment(self, boundary.marker)
        if fmt.syntax is Syntax.RAW:
            return _RawSegment(self, boundary.name)
        segment = _JsonSegment(self, fmt, boundary.marker)
        if boundary.marker and boundary.marker == fmt.bare_open:
            segment.feed(boundary.marker)  # the bare marker is the call's own first text
        return segment

    # The sink the segment readers report to (tool_xml.Sink); not for the decoder.

    def start(self, name: str) -> bool:
        if self._names is not None and name not in self._names:
            return False
        self._index = self._count
        self._count += 1
        self._args = []
        self._out.append(ToolCallStart(self._index, self._parsing.new_id(), name))
        return True

    def delta(self, text: str) -> None:
        if text and self._index is not None:
            self._args.append(text)
            self._out.append(ToolCallDelta(self._index, text))

    def end(self) -> None:
        if self._index is None:
            return
        if not self._args:
            self.delta("{}")  # a call without arguments takes none
        arguments = "".join(self._args)
        try:
            json.loads(arguments)
        except ValueError:
            # Still the call's arguments: the start is out, and the text is what it wrote.
            _log.warning("tool call %d ended with arguments that are not valid JSON", self._index)
        self._out.append(ToolCallEnd(self._index, arguments))
        self._index = None
        self._args = []

    def text(self, raw: str, why: str) -> None:
        if why:
            _log.warning("malformed tool call markup (%s); returned as text", why)
        if raw:
            self._out.append(TextDelta(Channel.ANSWER, raw))

    def warn(self, why: str) -> None:
        _log.warning("tool call %s: %s", self._index, why)

    def schema(self, name: str) -> Mapping[str, Any] | None:
        return self._parsing.schemas.get(name)


class _RawSegment:
    """Harmony: the header named the call, the message body is the arguments."""

    __slots__ = ("_sink", "_ok")

    def __init__(self, sink: ToolCallParser, name: str | None) -> None:
        self._sink = sink
        self._ok = name is not None and sink.start(name)
        if not self._ok:
            sink.text("", f"unknown recipient {name!r}")

    def feed(self, text: str) -> None:
        if self._ok:
            self._sink.delta(text)
        else:
            self._sink.text(text, "")

    def close(self, marker: str) -> None:
        del marker  # Harmony's message end is the call's end, never call text
        if self._ok:
            self._sink.end()


# _JsonSegment states
_LEAD, _OBJECT, _NAMED, _ARGS, _AFTER, _TAIL, _FAILED = range(7)


class _JsonSegment:
    """The text after one open marker: call objects (`;`-separated for Llama 3), a list
    of them (Mistral v3), or `NAME[ARGS]{...}` (newer Mistral)."""

    __slots__ = ("_sink", "_fmt", "_state", "_raw", "_object", "_value", "_name",
                 "_started", "_in_list", "_warned")

    def __init__(self, sink: ToolCallParser, fmt: ToolFormat, marker: str) -> None:
        self._sink = sink
        self._fmt = fmt
        self._state = _LEAD
        # The text of the call not yet started, for a fallback; the bare marker is fed.
        self._raw = "" if marker == fmt.bare_open else marker
        self._object = CallObject(fmt.args_keys)
        self._value = ValueScanner()
        self._name = ""
        self._started = False
        self._in_list = False
        self._warned = False

    def feed(self, text: str) -> None:
        pos, end = 0, len(text)
        while pos < end:
            state = self._state
            if state == _FAILED:
                self._sink.text(text[pos:], "")
                return
            if state == _TAIL:
                if text[pos:].strip() and not self._warned:
                    self._warned = True
                    self._sink.warn("text after the call is ignored")
                return
            if state == _OBJECT:
                pos = self._read_object(text, pos)
            elif state == _NAMED:
                pos = self._read_name(text, pos)
            elif state == _ARGS:
                if not self._value.kind:  # whitespace after the marker is layout (Kimi)
                    pos = skip_ws(text, pos)
                    if pos >= end:
                        return
                stop = self._value.feed(text, pos)
                self._sink.delta(text[pos:stop])
                pos = stop
                if self._value.done:
                    self._end(_AFTER)
            else:
                pos = self._between(text, pos)

    def close(self, marker: str) -> None:
        state = self._state
        if state == _FAILED:
            self._sink.text(marker, "")
        elif self._started:
            self._end(_TAIL)  # cut off: the call ends with what it had
        elif state in (_LEAD, _OBJECT, _NAMED) and (self._raw.strip() or state != _LEAD
                                                     or not self._sink.calls):
            self._fail("", "an incomplete call", marker)

    def _between(self, text: str, pos: int) -> int:
        """Leading whitespace, then what the next character opens."""
        stop = skip_ws(text, pos)
        if not self._started:
            self._raw += text[pos:stop]
        if stop >= len(text):
            return stop
        char, fmt = text[stop], self._fmt
        if self._state == _AFTER:
            if self._in_list and char in ",]":
                self._in_list = char == ","
                self._state = _LEAD if char == "," else _TAIL
                return stop + 1
            if fmt.separator is not None and char == fmt.separator:
                self._state = _LEAD
                return stop + 1
            self._state = _TAIL
            return stop
        if char == "{":
            self._object = CallObject(fmt.args_keys)
            self._state = _OBJECT
        elif char == "[" and fmt.lists and not self._in_list:
            self._in_list = True
            self._raw += char
            return stop + 1
        elif fmt.named is not None and not self._in_list:
            self._name, self._state = "", _NAMED
        else:
            self._fail(text[stop:], "not a call object", "")
            return len(text)
        return stop

    def _read_object(self, text: str, pos: int) -> int:
        obj = self._object
        stop = obj.feed(text, pos)
        if not self._started:
            self._raw += text[pos:stop]
            # A name read in this piece counts even if an error follows it in the same
            # piece: streaming would have started the call before it saw the error.
            if obj.name is not None:
                if not self._sink.start(obj.name):
                    self._fail(text[stop:], f"unknown tool {obj.name!r}", "")
                    return len(text)
                self._started = True
            elif obj.error is not None or obj.done:
                self._fail(text[stop:], obj.error or "no name", "")
                return len(text)
        if self._started:
            self._sink.delta(obj.take())
            if obj.error is not None:
                self._sink.warn(f"{obj.error}; the call ends here")
                self._end(_TAIL)
                self._warned = True
            elif obj.done:
                self._end(_AFTER)
        return stop

    def _read_name(self, text: str, pos: int) -> int:
        marker = self._fmt.named
        assert marker is not None
        self._name += text[pos:]
        self._raw += text[pos:]
        found = self._name.find(marker)
        if found < 0:
            if len(self._name) > _NAME_LIMIT:
                self._fail("", "no [ARGS] after a name", "")
            return len(text)
        name = self._name[:found].strip()
        rest = self._name[found + len(marker):]
        if self._fmt.name_pattern is not None:  # Kimi's `functions.NAME:IDX`
            match = re.fullmatch(self._fmt.name_pattern, self._name[:found], re.DOTALL)
            name = match.group("name") if match else ""
        if not name or any(c in name for c in '{}[]"') or not self._sink.start(name):
            self._fail("", f"bad tool name {name!r}", "")  # the raw text has the rest
            return len(text)
        self._raw = self._raw[: len(self._raw) - len(rest)]
        self._started, self._value, self._state = True, ValueScanner(), _ARGS
        return len(text) - len(rest)

    def _end(self, then: int) -> None:
        self._sink.end()
        self._started, self._raw, self._state = False, "", then

    def _fail(self, rest: str, why: str, marker: str) -> None:
        """Not a call after all: its text so far, and the rest, is answer text."""
        self._sink.text(self._raw + rest + marker, why)
        self._raw = ""
        self._state = _FAILED


_Segment = (_RawSegment | _JsonSegment | XmlSegment | KeyValueSegment | PythonicSegment
            | GemmaSegment | XtmlSegment)
