"""The tool-call parser: TOOL-channel text and call boundaries in, ToolCall* events out.

The router (`channels.py`, with a format from `compose.with_tools`) cuts each call's text
out of the stream and reports where calls open and close; this parser reads that text with
the reader its table names for the tool format's syntax (`READERS`). Like every stage it is
`feed()` plus `finish()`.

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
from replicas.families.tool_format import Syntax, ToolFormat
from replicas.pipeline.channels import CallBoundary
from replicas.pipeline.tool_calls.gemma_reader import GemmaReader
from replicas.pipeline.tool_calls.json_reader import JsonReader
from replicas.pipeline.tool_calls.key_value_reader import KeyValueReader
from replicas.pipeline.tool_calls.pythonic_reader import PythonicReader
from replicas.pipeline.tool_calls.raw_reader import RawReader
from replicas.pipeline.tool_calls.reader import Sink
from replicas.pipeline.tool_calls.xml_reader import XmlReader
from replicas.pipeline.tool_calls.xtml_reader import XtmlReader

__all__ = ["READERS", "ToolCallParser", "ToolParsing", "new_call_id"]

_log = logging.getLogger(__name__)

_Reader = (RawReader | JsonReader | XmlReader | KeyValueReader | PythonicReader | GemmaReader
           | XtmlReader)
# The reader of each syntax; a tool format names its syntax, never its reader.
READERS: Mapping[Syntax, Callable[[Sink, ToolFormat, CallBoundary], _Reader]] = {
    Syntax.JSON: JsonReader,
    Syntax.XML: XmlReader,
    Syntax.KEY_VALUE: KeyValueReader,
    Syntax.PYTHONIC: PythonicReader,
    Syntax.GEMMA: GemmaReader,
    Syntax.XTML: XtmlReader,
    Syntax.RAW: RawReader,
}


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

    __slots__ = ("_parsing", "_names", "_out", "_reader", "_count", "_index", "_args")

    def __init__(self, parsing: ToolParsing) -> None:
        self._parsing = parsing
        self._names: Collection[str] | None = parsing.names
        self._out: list[OutputEvent] = []
        self._reader: _Reader | None = None
        self._count = 0  # calls started
        self._index: int | None = None  # the call in progress
        self._args: list[str] = []

    @property
    def calls(self) -> int:
        """How many calls have started."""
        return self._count

    def feed(self, item: str | CallBoundary) -> list[OutputEvent]:
        if isinstance(item, CallBoundary):
            if self._reader is not None:
                self._reader.close("" if item.opened else item.marker)
                self._reader = None
            if item.opened:
                self._reader = self._open(item)
        elif item:
            if self._reader is None:  # TOOL text without an open: read it as a call
                self._reader = self._open(CallBoundary(True, ""))
            self._reader.feed(item)
        return self._flush()

    def finish(self) -> list[OutputEvent]:
        if self._reader is not None:
            self._reader.close("")
            self._reader = None
        return self._flush()

    def _flush(self) -> list[OutputEvent]:
        out, self._out = self._out, []
        return out

    def _open(self, boundary: CallBoundary) -> _Reader:
        fmt = self._parsing.format
        return READERS[fmt.syntax](self, fmt, boundary)

    # The sink the readers report to (`reader.Sink`); not for the decoder.

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
