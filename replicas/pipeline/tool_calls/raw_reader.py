"""Harmony's calls: the message header names the call (the router reads the recipient),
the message body is the arguments, as written."""

from __future__ import annotations

from replicas.families.tool_format import ToolFormat
from replicas.pipeline.channels import CallBoundary
from replicas.pipeline.tool_calls.reader import Sink


class RawReader:
    """Harmony: the header named the call, the message body is the arguments."""

    __slots__ = ("_sink", "_ok")

    def __init__(self, sink: Sink, fmt: ToolFormat, boundary: CallBoundary) -> None:
        del fmt  # the header is the whole syntax
        self._sink = sink
        name = boundary.name
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
