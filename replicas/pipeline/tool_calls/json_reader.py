"""JSON tool calls, read incrementally: call objects after one open marker (`;`-separated
for Llama 3), a list of them (Mistral v3), or `NAME<named>{...}` (newer Mistral's `[ARGS]`,
Kimi K2's and DeepSeek V3.1's), as the tool format's JSON knobs say. The arguments value
streams out exactly as written (`json_values.ValueScanner`).
"""

from __future__ import annotations

import re

from replicas.families.tool_format import ToolFormat
from replicas.pipeline.channels import CallBoundary
from replicas.pipeline.tool_calls.json_values import CallObject, ValueScanner, skip_ws
from replicas.pipeline.tool_calls.reader import Sink

_NAME_LIMIT = 256  # Mistral's `NAME[ARGS]`: a longer name is not a call


# JsonReader states
_LEAD, _OBJECT, _NAMED, _ARGS, _AFTER, _TAIL, _FAILED = range(7)


class JsonReader:
    """The text after one open marker: call objects (`;`-separated for Llama 3), a list
    of them (Mistral v3), or `NAME[ARGS]{...}` (newer Mistral)."""

    __slots__ = ("_sink", "_fmt", "_state", "_raw", "_object", "_value", "_name",
                 "_started", "_in_list", "_warned")

    def __init__(self, sink: Sink, fmt: ToolFormat, boundary: CallBoundary) -> None:
        marker = boundary.marker
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
        if marker and marker == fmt.bare_open:
            self.feed(marker)  # the bare marker is the call's own first text

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
