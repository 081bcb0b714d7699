"""Pythonic tool calls (LFM2 and others mlx-lm reads with its `pythonic` parser).

    <|tool_call_start|>[get_weather(city="Paris", days=3), ping()]<|tool_call_end|>

A list of calls with keyword arguments only; a value is a Python literal, or JSON's
(`true`, `false`, `null`, as chat templates render nested values), as mlx-lm reads them.
A call starts as soon as its name is followed by `(`; its arguments become a JSON object
built here one argument at a time (`{"city": "Paris"`, `, "days": 3`, `}`), each as soon
as the top-level `,` or `)` after it arrives.
"""

from __future__ import annotations

import ast
import json
import re

from replicas.families.tool_format import ToolFormat
from replicas.pipeline.channels import CallBoundary
from replicas.pipeline.tool_calls.reader import TAIL, CallReader, Sink

_NAME_LIMIT = 256  # a longer name is not a call
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_OPENERS, _CLOSERS = "([{", ")]}"

_LEAD, _CALL, _ARGS, _AFTER = range(4)


class _JsonLiterals(ast.NodeTransformer):
    """`true`/`false`/`null` as the constants they mean (mlx-lm does the same)."""

    _values = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id not in self._values:
            return node
        return ast.copy_location(ast.Constant(self._values[node.id]), node)


def keyword_argument(text: str) -> tuple[str, str] | None:
    """`key=VALUE` as (key, VALUE as JSON text); None if it is not one."""
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        assert isinstance(call, ast.Call)
        if call.args or len(call.keywords) != 1 or call.keywords[0].arg is None:
            return None
        value = ast.literal_eval(_JsonLiterals().visit(call.keywords[0].value))
        return call.keywords[0].arg, json.dumps(value, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicReader(CallReader):
    """The text of one `<|tool_call_start|>`...`<|tool_call_end|>`: a list of calls."""

    __slots__ = ("_text", "_depth", "_quote", "_escape", "_calls")

    def __init__(self, sink: Sink, fmt: ToolFormat, boundary: CallBoundary) -> None:
        del fmt  # one pythonic syntax: nothing to configure
        super().__init__(sink, boundary.marker, _LEAD)
        self._text = ""  # the name, or the argument, being read
        self._depth = 0  # brackets open in the argument
        self._quote = ""  # the quote of the string the argument is in, if any
        self._escape = False
        self._calls = 0  # calls started in this segment

    def feed(self, text: str) -> None:
        for pos, char in enumerate(text):
            if self._settled(text[pos:]):
                return
            state = self._state
            if state in (_LEAD, _CALL):
                self._raw += char
            if state == _ARGS:
                self._arg_char(char)
            elif char.isspace() and not (state == _CALL and self._text.strip()):
                continue  # layout, except inside a name (kept, so `f g(` is no name)
            elif state == _LEAD:
                if char != "[":
                    self._fail("expected [")
                else:
                    self._state = _CALL
            elif state == _CALL:
                self._call_char(char)
            elif char == ",":  # _AFTER: the next call
                self._state, self._raw = _CALL, ""
            else:
                if char != "]":
                    self._junk("text after a call")
                self._state = TAIL

    def _close(self, marker: str) -> None:
        state = self._state
        if state == _ARGS:  # cut off: the complete arguments are what the call had
            self._sink.warn("tool call cut off inside its arguments")
            self._end_call()
        elif state in (_LEAD, _CALL) and (self._raw.strip() or not self._calls):
            self._fail("an incomplete call", marker)

    def _call_char(self, char: str) -> None:
        if char == "]" and not self._text and self._calls:
            self._state = TAIL  # a trailing comma: `[f(), ]`
        elif char != "(":
            self._text += char
            if len(self._text) > _NAME_LIMIT or not (char.isalnum() or char in "_."):
                self._fail("not a call name")
        elif not _NAME.fullmatch(name := self._text.strip()) or not self._sink.start(name):
            self._fail(f"bad tool name {self._text.strip()!r}")
        else:
            self._calls += 1
            self._state, self._text, self._raw, self._count = _ARGS, "", "", 0
            self._depth, self._quote, self._escape = 0, "", False

    def _arg_char(self, char: str) -> None:
        if self._quote:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == self._quote:
                self._quote = ""
        elif char in "\"'":
            self._quote = char
        elif char in _OPENERS:
            self._depth += 1
        elif char in _CLOSERS and self._depth:
            self._depth -= 1
        elif char in ",)" and not self._depth:  # the argument ends
            if not self._emit(self._text):
                return
            self._text = ""
            if char == ")":
                self._end_call()
                self._state = _AFTER
            return
        self._text += char

    def _emit(self, text: str) -> bool:
        if not text.strip():
            return True  # no arguments, or a trailing comma
        parsed = keyword_argument(text)
        if parsed is None:
            self._junk(f"not a keyword argument: {text.strip()[:40]!r}")
            return False
        key, value = parsed
        lead = "{" if self._count == 0 else ", "
        self._sink.delta(f"{lead}{json.dumps(key, ensure_ascii=False)}: {value}")
        self._count += 1
        return True

    def _junk(self, why: str) -> None:
        """A started call ends with what it had; the rest of the segment is ignored."""
        self._sink.warn(f"{why}; the call ends here")
        if self._state == _ARGS:
            self._end_call()
        self._state, self._warned = TAIL, True
