"""Kimi K3's XTML tool calls, read incrementally.

    <|open|>tools<|sep|>
    <|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>
    <|close|>call<|sep|>
    <|close|>tools<|sep|>

The router cuts each call out at `<|open|>call` and `<|close|>call<|sep|>` (the section
markers around them are dropped), so this reader sees the header's attributes, then the
argument blocks. A typed argument is emitted as JSON once its block closes (`type="string"`,
or no type, keeps the raw text; any other type is JSON when it parses, else the text, as
mlx-lm's `kimi_k3` parser reads it). The other body form, one
`<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>` block, streams as written.
"""

from __future__ import annotations

import json
import re

from replicas.families.tool_format import ToolFormat
from replicas.pipeline.channels import CallBoundary
from replicas.pipeline.tool_calls.reader import TAIL, BufferedReader, Sink

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
_ARGUMENT = OPEN + "argument"
_ARGUMENT_END = CLOSE + "argument" + SEP
_JSON = OPEN + "json"
_JSON_END = CLOSE + "json" + SEP
_HEADER_LIMIT = 512  # a header longer than this is junk, not a call
_ATTR = re.compile(r'(\w+)="([^"]*)"')

_HEAD, _BODY, _ARG, _OBJECT = range(4)  # _HEAD first: BufferedReader starts there


def attributes(header: str) -> dict[str, str]:
    """A header's `key="value"` attributes, XML's two escapes undone."""
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(header)}


def typed_value(text: str, kind: str) -> object:
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class XtmlReader(BufferedReader):
    """The text of one `<|open|>call ...<|close|>call<|sep|>`: one call."""

    __slots__ = ("_key", "_type", "_json")
    _after = "a tool call's arguments"

    def __init__(self, sink: Sink, fmt: ToolFormat, boundary: CallBoundary) -> None:
        del fmt  # Kimi K3's XTML is the one XTML syntax: nothing to configure
        super().__init__(sink, boundary.marker)
        self._key = ""
        self._type = "string"
        self._json = False  # the arguments came as one JSON block, streamed as written

    def _close(self, marker: str) -> None:
        state = self._state
        if state == _HEAD:
            self._fail("incomplete call header", marker)
        elif state != TAIL:
            if state == _OBJECT:  # cut off in the JSON block: what it had
                self._sink.delta(self._buf.rstrip())
            elif state == _ARG:
                self._emit(self._buf)
            self._finish()

    def _step(self) -> bool:
        """One move on the buffer; False when it needs more text."""
        state, buf = self._state, self._buf
        if state == _HEAD:
            sep = buf.find(SEP)
            if sep < 0:
                if len(buf) > _HEADER_LIMIT:
                    self._fail("runaway call header")
                return False
            name = attributes(buf[:sep]).get("tool", "")
            if not name or not self._sink.start(name):
                self._fail(f"bad tool name {name!r}")
                return False
            self._raw, self._buf, self._state = "", buf[sep + len(SEP):], _BODY
            return True
        if state == _ARG:
            found = buf.find(_ARGUMENT_END)
            if found < 0:
                return False
            self._emit(buf[:found])
            self._buf, self._state = buf[found + len(_ARGUMENT_END):], _BODY
            return True
        if state == _OBJECT:
            return self._stream_object()
        rest = buf.lstrip()
        block = _ARGUMENT if rest.startswith(_ARGUMENT) else _JSON if rest.startswith(_JSON) \
            else None
        if block is None:
            if rest and not (_ARGUMENT.startswith(rest) or _JSON.startswith(rest)):
                self._junk("unexpected text in a call")
            return False
        sep = rest.find(SEP)
        if sep < 0:
            if len(rest) > _HEADER_LIMIT:
                self._junk("runaway argument header")
            return False
        attrs = attributes(rest[len(block):sep])
        self._buf = rest[sep + len(SEP):]
        if block == _JSON:
            if self._count:
                self._junk("a JSON block after typed arguments")
                return False
            self._json, self._state = True, _OBJECT
            return True
        if self._json or "key" not in attrs:
            self._junk("an argument after the JSON block" if self._json else "no argument key")
            return False
        self._key, self._type, self._state = attrs["key"], attrs.get("type", "string"), _ARG
        return True

    def _stream_object(self) -> bool:
        """The JSON block's text as deltas, holding back what may begin its end tag."""
        buf = self._buf.lstrip() if not self._count else self._buf
        found = buf.find(_JSON_END)
        if found >= 0:
            self._delta(buf[:found].rstrip())
            self._buf, self._state = buf[found + len(_JSON_END):], _BODY
            return True
        keep = next((k for k in range(min(len(buf), len(_JSON_END) - 1), 0, -1)
                     if _JSON_END.startswith(buf[-k:])), 0)
        # Trailing whitespace may be layout before the end tag: held back too.
        cut = len(buf[:len(buf) - keep].rstrip())
        self._delta(buf[:cut])
        self._buf = buf[cut:]
        return False

    def _delta(self, text: str) -> None:
        if text:
            self._sink.delta(text)
            self._count += 1

    def _emit(self, value: str) -> None:
        lead = "{" if self._count == 0 else ", "
        converted = json.dumps(typed_value(value, self._type), ensure_ascii=False)
        self._sink.delta(f"{lead}{json.dumps(self._key, ensure_ascii=False)}: {converted}")
        self._count += 1

    def _finish(self) -> None:
        if self._json:  # the block's own braces close it
            self._sink.end()
            self._count = 0
        else:
            self._end_call()
        self._state = TAIL

    def _junk(self, why: str) -> None:
        self._sink.warn(f"{why}; the call ends here")
        self._finish()
        self._warned = True
