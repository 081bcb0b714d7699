"""Tagged XML tool calls (Qwen3-Coder, MiniMax-M2), read incrementally.

    <function=NAME>                   <invoke name="NAME">
    <parameter=P>                     <parameter name="P">VALUE</parameter>
    VALUE                             </invoke>
    </parameter>
    </function>

The tags are the format's `XmlTags` (Qwen3-Coder's on the left, MiniMax-M2's on the right).

VALUE is raw text; the arguments become a JSON object built here, one parameter at a time
(`{"P": VALUE` then `, "Q": ...` then `}`), so they stream per parameter. A value converts
by the parameter's schema type when the tool's schema is known (as vLLM's parser does),
otherwise: a value that parses as JSON other than a string is that value, anything else
is a string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from replicas.families.tool_format import ToolFormat
from replicas.pipeline.channels import CallBoundary
from replicas.pipeline.tool_calls.reader import TAIL, BufferedReader, Sink

_HEADER_LIMIT = 256  # a `<function=...>` or `<parameter=...>` header longer than this is junk
_CDATA = re.compile(r"\s*<!\[CDATA\[(.*?)\]\]>\s*", re.DOTALL)


def convert(value: str, schema_type: object) -> object:
    """A parameter's raw text as a JSON value."""
    kind = schema_type
    if isinstance(kind, list):  # ["integer", "null"]: the first real type decides
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return value
    if kind in ("integer", "number", "boolean", "object", "array", "null"):
        if kind == "boolean" and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        parsed = _json(value)
        if kind == "integer" and isinstance(parsed, float) and parsed.is_integer():
            return int(parsed)
        return value if parsed is _BAD else parsed
    parsed = _json(value)
    return value if parsed is _BAD or isinstance(parsed, str) else parsed


_BAD = object()


def _json(value: str) -> object:
    try:
        return json.loads(value)
    except ValueError:
        return _BAD


_FUNC, _PARAMS, _VALUE = range(3)  # _FUNC first: BufferedReader starts there


class XmlReader(BufferedReader):
    """The text of one `<tool_call>`...`</tool_call>`: one or more functions."""

    __slots__ = ("_tags", "_from", "_name", "_param", "_calls")
    _after = "a tool call's function"

    def __init__(self, sink: Sink, fmt: ToolFormat, boundary: CallBoundary) -> None:
        super().__init__(sink, boundary.marker)
        self._tags = fmt.xml
        self._from = 0  # where to resume looking for `</parameter>` in the buffer
        self._name = ""
        self._param = ""
        self._calls = 0  # calls started in this segment

    def _close(self, marker: str) -> None:
        state = self._state
        if state == _FUNC:
            if self._buf.strip() or not self._calls:
                self._fail("incomplete <function=...> header", marker)
        elif state == _VALUE:  # cut off inside a value: it is what the call had
            self._emit_param(self._buf)
            self._end_call()
        elif state == _PARAMS:
            self._end_call()

    def _step(self) -> bool:
        """One move on the buffer; False when it needs more text."""
        state, tags = self._state, self._tags
        if state == _VALUE:
            found = self._buf.find(tags.parameter_end, self._from)
            if found < 0:
                self._from = max(0, len(self._buf) - len(tags.parameter_end) + 1)
                return False
            self._emit_param(self._buf[:found])
            self._buf = self._buf[found + len(tags.parameter_end):]
            self._state = _PARAMS
            return True
        buf = self._buf.lstrip()
        if not buf:
            return False
        if state == _FUNC:
            if not buf.startswith(tags.function):
                if not tags.function.startswith(buf):
                    self._fail(f"expected {tags.function}NAME>", "")
                return False
            header = self._header(buf, len(tags.function))
            if header is None:
                return False
            name = self._name_of(header)
            if not name or not self._sink.start(name):
                self._fail(f"bad function name {name!r}", "")
                return False
            self._name, self._count, self._raw = name, 0, ""
            self._calls += 1
            self._state = _PARAMS
            return True
        # _PARAMS
        if buf.startswith(tags.function_end):
            self._buf = buf[len(tags.function_end):]
            self._end_call()
            self._state = _FUNC
            return True
        if buf.startswith(tags.parameter):
            header = self._header(buf, len(tags.parameter))
            if header is None:
                return False
            self._param = self._name_of(header)
            self._state, self._from = _VALUE, 0
            return True
        if tags.parameter.startswith(buf) or tags.function_end.startswith(buf):
            return False
        self._sink.warn("unexpected text in a function call; the call ends here")
        self._end_call()
        self._state = TAIL
        self._ignore(buf)
        return False

    def _header(self, buf: str, start: int) -> str | None:
        """The text up to `>` of a `<function=` / `<parameter=` header; None: not yet."""
        close = buf.find(">", start)
        if close < 0:
            if len(buf) <= _HEADER_LIMIT:
                self._buf = buf
            elif self._state == _FUNC:
                self._fail("runaway <function=...> header", "")
            else:
                self._sink.warn("runaway <parameter=...> header; the call ends here")
                self._end_call()
                self._state = TAIL
            return None
        self._buf = buf[close + 1:]
        return buf[start:close]

    def _name_of(self, header: str) -> str:
        if self._tags.name_attr is not None:  # `<atem:invoke name="f">`: other attributes too
            found = re.search(rf'(?:^|\s){re.escape(self._tags.name_attr)}="([^"]+)"', header)
            return found.group(1) if found else ""
        name = header.strip()
        if self._tags.quoted and len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
            name = name[1:-1]
        return name

    def _emit_param(self, value: str) -> None:
        tags = self._tags
        cdata = _CDATA.fullmatch(value) if tags.cdata else None
        if cdata is not None or tags.json_values:
            self._emit_value(self._as_json(value) if cdata is None else cdata.group(1))
            return
        if tags.strip_values:
            value = value.strip()
        # Templates write the value on its own lines: one newline each side is layout.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        schema = self._sink.schema(self._name) or {}
        props = schema.get("properties")
        spec = props.get(self._param) if isinstance(props, Mapping) else None
        kind = spec.get("type") if isinstance(spec, Mapping) else None
        self._emit_value(convert(value, kind))

    @staticmethod
    def _as_json(value: str) -> object:
        parsed = _json(value)
        return value.strip() if parsed is _BAD else parsed

    def _emit_value(self, value: object) -> None:
        converted = json.dumps(value, ensure_ascii=False)
        lead = "{" if self._count == 0 else ", "
        self._sink.delta(f"{lead}{json.dumps(self._param, ensure_ascii=False)}: {converted}")
        self._count += 1

