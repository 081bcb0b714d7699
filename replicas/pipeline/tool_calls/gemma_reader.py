"""Gemma's tool calls (Gemma 4, FunctionGemma), read incrementally.

    <|tool_call>call:NAME{city:<|"|>Paris<|"|>,days:3,opts:{a:[1,<|"|>x<|"|>]}}<tool_call|>
    <start_function_call>call:NAME{city:<escape>Paris<escape>,days:3}<end_function_call>

Keys are bare; a string is raw text between two quotes (`GemmaTags.quote`); anything else
is JSON whose object keys may be bare and whose strings may be quoted the same way. Each
argument is emitted as JSON (`{"K": V`, `, "L": W`, `}`) once the top-level `,` or `}`
after it arrives, so the arguments stream per argument. A value that does not read as JSON
is its text, as mlx-lm's `function_gemma` parser keeps it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from replicas.families.tool_format import ToolFormat
from replicas.pipeline.channels import CallBoundary
from replicas.pipeline.tool_calls.reader import TAIL, BufferedReader, Sink

_NAME_LIMIT = 256  # a name or a key longer than this is junk, not a call
_CALL = "call:"
_NAME = re.compile(r"[\w.-]+")
_BARE_KEY = re.compile(r"\w+:")  # a bare object key, as Gemma writes them

_HEAD, _KEY, _VALUE = range(3)  # _HEAD first: BufferedReader starts there


def gemma_value(text: str, quote: str) -> object:
    """One Gemma value as a JSON value: quoted strings and bare keys become JSON's."""
    stripped = text.strip()
    q = len(quote)
    if (len(stripped) >= 2 * q and stripped.startswith(quote) and stripped.endswith(quote)
            and stripped.find(quote, q) == len(stripped) - q):
        return stripped[q:-q]  # one string: its raw text
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith(quote, i):
            end = text.find(quote, i + q)
            if end < 0:
                return text
            out.append(json.dumps(text[i + q:end], ensure_ascii=False))
            i = end + q
            continue
        char = text[i]
        if char == '"':  # a JSON string: copied as it is, escapes included
            end = _json_string_end(text, i)
            if end < 0:
                return text
            out.append(text[i:end])
            i = end
            continue
        out.append(char)
        i += 1
        if char in "{,":
            key = _BARE_KEY.match(text, i)
            if key is not None:
                out.append(json.dumps(key.group()[:-1]) + ":")
                i = key.end()
    try:
        return json.loads("".join(out))
    except ValueError:
        return text


def _json_string_end(text: str, start: int) -> int:
    """The index after the JSON string opening at `start`; -1 if it does not end."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return -1


class GemmaReader(BufferedReader):
    """The text after one call marker: `call:NAME{...}`, one call."""

    __slots__ = ("_quote", "_key", "_pos", "_depth", "_in")
    _after = "a tool call's arguments"

    def __init__(self, sink: Sink, fmt: ToolFormat, boundary: CallBoundary) -> None:
        super().__init__(sink, boundary.marker)
        self._quote = fmt.gemma.quote
        self._key = ""
        self._pos = 0  # how far the current value has been scanned
        self._depth = 0  # brackets open in the current value
        self._in = ""  # inside a string of the value: its quote ('"' or `quote`), else ""

    def _close(self, marker: str) -> None:
        state = self._state
        if state == _HEAD:
            self._fail("no call:NAME{", marker)
        elif state != TAIL:
            # Cut off: a whole value still counts (the reference reads `{a:1` too).
            if state == _VALUE and self._buf.strip() and not self._in and not self._depth:
                self._emit(self._buf)
            self._end_call()
            self._state = TAIL

    @staticmethod
    def _find(rest: str, char: str, runaway: Callable[[str], object], why: str) -> int:
        """Where `char` is in `rest`, or -1; `runaway(why)` once `rest` is too long to wait
        for it (a name or a key)."""
        at = rest.find(char)
        if at < 0 and len(rest) > _NAME_LIMIT:
            runaway(why)
        return at

    def _step(self) -> bool:
        """One move on the buffer; False when it needs more text."""
        state, buf = self._state, self._buf
        if state == _HEAD:
            rest = buf.lstrip()
            if not rest.startswith(_CALL):
                if not _CALL.startswith(rest):
                    self._fail("not call:NAME{")
                return False
            brace = self._find(rest, "{", self._fail, "runaway tool name")
            if brace < 0:
                return False
            name = rest[len(_CALL):brace].strip()
            if not _NAME.fullmatch(name) or not self._sink.start(name):
                self._fail(f"bad tool name {name!r}")
                return False
            self._raw, self._buf, self._state = "", rest[brace + 1:], _KEY
            return True
        if state == _KEY:
            rest = buf.lstrip()
            if rest.startswith("}"):
                self._end_call()
                self._state = TAIL
                self._ignore(rest[1:])
                return False
            colon = self._find(rest, ":", self._junk, "runaway argument key")
            if colon < 0:
                return False
            key = rest[:colon].strip()
            if not key or any(c in key for c in "{}[],\"'<>"):
                self._junk(f"bad argument key {key!r}")
                return False
            self._key, self._buf, self._state = key, rest[colon + 1:], _VALUE
            self._pos, self._depth, self._in = 0, 0, ""
            return True
        end = self._scan()
        if end < 0:
            return False
        self._emit(buf[:end])
        self._buf = buf[end + 1:]
        if buf[end] == "}":
            self._end_call()
            self._state = TAIL
            self._ignore(self._buf)
            return False
        self._state = _KEY
        return True

    def _scan(self) -> int:
        """The index of the top-level `,` or `}` that ends the value; -1: not yet."""
        buf, quote, i = self._buf, self._quote, self._pos
        n = len(buf)
        while i < n:
            if self._in == '"':
                if buf[i] == "\\":
                    if i + 1 >= n:
                        break
                    i += 2
                    continue
                if buf[i] == '"':
                    self._in = ""
                i += 1
                continue
            if buf.startswith(quote, i):
                self._in = "" if self._in else quote
                i += len(quote)
                continue
            if buf[i] == "<" and quote.startswith(buf[i:]):
                break  # maybe a quote split across pieces: wait for it
            if self._in:
                i += 1
                continue
            char = buf[i]
            if char == '"':
                self._in = '"'
            elif char in "{[":
                self._depth += 1
            elif char in "]}" and self._depth:
                self._depth -= 1
            elif char in ",}" and not self._depth:
                self._pos = i
                return i
            i += 1
        self._pos = i
        return -1

    def _emit(self, value: str) -> None:
        lead = "{" if self._count == 0 else ", "
        converted = json.dumps(gemma_value(value, self._quote), ensure_ascii=False)
        self._sink.delta(f"{lead}{json.dumps(self._key, ensure_ascii=False)}: {converted}")
        self._count += 1

    def _junk(self, why: str) -> None:
        self._sink.warn(f"{why}; the call ends here")
        self._end_call()
        self._state = TAIL
        self._warned = True
