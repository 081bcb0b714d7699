"""Incremental readers for JSON tool calls: where a value ends, and one call object.

They never build the arguments value: they track strings, escapes and nesting depth just
well enough to know where it ends, so its text streams out exactly as the model wrote it.
The outer call object is read strictly (a bad structure before the name is known means
the markup was not a call); the arguments value itself is checked once, at the end.
"""

from __future__ import annotations

import json
import re

_WS = re.compile(r"[ \t\r\n]*")
_IN_STRING = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[,}\]\s]")


def skip_ws(text: str, pos: int) -> int:
    found = _WS.match(text, pos)
    return found.end() if found else pos


class ValueScanner:
    """Finds the end of one JSON value in a stream, without parsing it."""

    __slots__ = ("kind", "depth", "in_string", "escape", "done")

    def __init__(self) -> None:
        self.kind = ""  # "container", "string" or "scalar", from the first character
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, text: str, pos: int) -> int:
        """Read from `pos` up to the value's end; returns where reading stopped."""
        end = len(text)
        if not self.kind:
            if pos >= end:
                return pos
            first = text[pos]
            if first in "{[":
                self.kind, self.depth = "container", 1
                pos += 1
            elif first == '"':
                self.kind, self.in_string = "string", True
                pos += 1
            else:
                self.kind = "scalar"
        while pos < end and not self.done:
            if self.escape:
                self.escape = False
                pos += 1
            elif self.in_string:
                found = _IN_STRING.search(text, pos)
                if found is None:
                    return end
                pos = found.end()
                if found.group() == "\\":
                    self.escape = True
                else:
                    self.in_string = False
                    self.done = self.kind == "string"
            elif self.kind == "scalar":
                found = _SCALAR_END.search(text, pos)
                if found is None:
                    return end
                self.done = True
                return found.start()
            else:
                found = _STRUCTURE.search(text, pos)
                if found is None:
                    return end
                pos = found.end()
                char = found.group()
                if char == '"':
                    self.in_string = True
                elif char in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    self.done = self.depth == 0
        return pos


# CallObject states
_OPEN, _KEY_OR_END, _KEY, _COLON, _VALUE, _AFTER, _DONE = range(7)


class CallObject:
    """One call object, `{"name": "...", "<args key>": VALUE, ...}`, read from a stream.

    `name` is set once its string is complete; argument text collects in `pending` until
    the caller takes it (so arguments written before the name wait for it), and all of it
    in `arguments`. `error` says why the object is malformed; reading stops there.
    """

    __slots__ = (
        "_args_keys", "_state", "_key", "_role", "_value", "_raw_name",
        "name", "pending", "arguments", "args_done", "done", "error",
    )

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self._args_keys = args_keys
        self._state = _OPEN
        self._key = ""
        self._role = ""  # of the value being read: "name", "args" or "skip"
        self._value = ValueScanner()
        self._raw_name = ""
        self.name: str | None = None
        self.pending = ""
        self.arguments = ""
        self.args_done = False
        self.done = False
        self.error: str | None = None

    def take(self) -> str:
        """The argument text read since the last take."""
        out, self.pending = self.pending, ""
        return out

    def feed(self, text: str, pos: int) -> int:
        """Read from `pos`; returns where reading stopped (the end, or past the closing
        brace, or at the character in error)."""
        end = len(text)
        while pos < end and not self.done and self.error is None:
            state = self._state
            if state == _VALUE:
                pos = self._read_value(text, pos)
                continue
            if state == _KEY:
                found = _IN_STRING.search(text, pos)
                stop = found.end() if found else end
                self._key += text[pos:stop]
                pos = stop
                if found and found.group() == '"' and not _escaped(self._key[:-1]):
                    self._end_key()
                continue
            pos = skip_ws(text, pos)
            if pos >= end:
                break
            char = text[pos]
            if state == _OPEN:
                self._expect(char == "{", "not a JSON object", _KEY_OR_END)
            elif state == _KEY_OR_END:
                if char == "}":
                    self._state, self.done = _DONE, True
                else:
                    self._expect(char == '"', "expected a key", _KEY)
            elif state == _COLON:
                self._expect(char == ":", "expected ':'", _VALUE)
            else:  # _AFTER
                if char == "}":
                    self._state, self.done = _DONE, True
                else:
                    self._expect(char == ",", "expected ',' or '}'", _KEY_OR_END)
            if self.error is None:
                pos += 1
        return pos

    def _expect(self, ok: bool, error: str, then: int) -> None:
        if ok:
            self._state = then
        else:
            self.error = error

    def _end_key(self) -> None:
        try:
            key = json.loads('"' + self._key)
        except ValueError:
            self.error = "bad key"
            return
        self._key = ""
        if key == "name" and self.name is None:
            self._role = "name"
        elif key in self._args_keys and not self.arguments:
            self._role = "args"
        else:
            self._role = "skip"
        self._value = ValueScanner()
        self._state = _COLON

    def _read_value(self, text: str, pos: int) -> int:
        value = self._value
        if not value.kind:
            pos = skip_ws(text, pos)
            if pos >= len(text):
                return pos
            if self._role == "name" and text[pos] != '"':
                self.error = "the name is not a string"
                return pos
        stop = value.feed(text, pos)
        piece = text[pos:stop]
        if self._role == "args":
            self.pending += piece
            self.arguments += piece
        elif self._role == "name":
            self._raw_name += piece
        if value.done:
            self._state = _AFTER
            if self._role == "args":
                self.args_done = True
            elif self._role == "name":
                self._set_name()
        return stop

    def _set_name(self) -> None:
        try:
            name = json.loads(self._raw_name)
        except ValueError:
            name = None
        if not isinstance(name, str) or not name.strip():
            self.error = "bad name"
        else:
            self.name = name.strip()


def _escaped(text: str) -> bool:
    """An odd run of backslashes ends `text`: the next character is escaped."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1
