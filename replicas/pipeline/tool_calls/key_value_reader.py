"""GLM-4.5/4.7's key/value tool calls, read incrementally.

    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>

(GLM-4.5 puts newlines between the parts; whitespace between tags is layout.) The name is
the bare text before the first tag, as mlx-lm's `glm47` parser reads it. The arguments
become a JSON object built here one pair at a time (`{"K": V`, `, "L": W`, `}`), so they
stream per argument. A value is stripped and converts as Qwen3-Coder's do
(`xml_reader.convert`): by the tool's schema type when known, else JSON other than a string
is that value and anything else a string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from replicas.families.tool_format import ToolFormat
from replicas.pipeline.channels import CallBoundary
from replicas.pipeline.tool_calls.reader import TAIL, BufferedReader, Sink
from replicas.pipeline.tool_calls.xml_reader import convert

_NAME_LIMIT = 256  # a name or a key longer than this is junk, not a call

_NAME, _KEY_OPEN, _KEY, _VALUE_OPEN, _VALUE = range(5)  # _NAME first: BufferedReader starts there


class KeyValueReader(BufferedReader):
    """The text of one `<tool_call>`...`</tool_call>`: one call."""

    __slots__ = ("_name", "_key", "_tags")
    _after = "a tool call's arguments"

    def __init__(self, sink: Sink, fmt: ToolFormat, boundary: CallBoundary) -> None:
        super().__init__(sink, boundary.marker)
        self._tags = fmt.kv
        self._name = ""
        self._key = ""

    def _close(self, marker: str) -> None:
        state = self._state
        if state == _NAME:
            # A call without arguments: `<tool_call>NAME</tool_call>`.
            if not self._start(self._buf.strip(), marker):
                return
            self._end_call()
        elif state == _VALUE:  # cut off inside a value: it is what the call had
            self._emit(self._buf)
            self._end_call()
        elif state != TAIL:
            self._end_call()

    def _step(self) -> bool:
        """One move on the buffer; False when it needs more text."""
        state, buf = self._state, self._buf
        if state == _NAME:
            # The name ends at the first tag or line break; an argument-less call's name
            # ends at the close marker instead (`close`).
            lead = len(buf) - len(buf.lstrip())
            if buf[lead:].startswith("<"):
                self._fail("no tool name", "")
                return False
            cut = min((i for i in (buf.find("<", lead), buf.find("\n", lead)) if i >= 0),
                      default=-1)
            if cut < 0:
                if len(buf) > _NAME_LIMIT:
                    self._fail("runaway tool name", "")
                return False
            if not self._start(buf[:cut].strip(), ""):
                return False
            self._buf, self._state = buf[cut:], _KEY_OPEN
            return True
        if state in (_KEY, _VALUE):
            end = self._tags.key_end if state == _KEY else self._tags.value_end
            found = buf.find(end)
            if found < 0:
                if state == _KEY and len(buf) > _NAME_LIMIT:
                    self._junk("runaway argument key")
                return False
            if state == _KEY:
                self._key, self._state = buf[:found].strip(), _VALUE_OPEN
            else:
                self._emit(buf[:found])
                self._state = _KEY_OPEN
            self._buf = buf[found + len(end):]
            return True
        # _KEY_OPEN or _VALUE_OPEN: whitespace, then the tag
        tag = self._tags.key if state == _KEY_OPEN else self._tags.value
        rest = _layout(buf)
        if not rest or rest == "\\" or (tag.startswith(rest) and rest != tag):
            return False
        if not rest.startswith(tag):
            self._junk(f"expected {tag}")
            return False
        self._buf = rest[len(tag):]
        self._state = _KEY if state == _KEY_OPEN else _VALUE
        return True

    def _start(self, name: str, marker: str) -> bool:
        if not name or any(c.isspace() or c in "<>{}\"'" for c in name) \
                or not self._sink.start(name):
            self._fail(f"bad tool name {name!r}", marker)
            return False
        self._name, self._raw = name, ""
        return True

    def _emit(self, value: str) -> None:
        schema = self._sink.schema(self._name) or {}
        props = schema.get("properties")
        spec = props.get(self._key) if isinstance(props, Mapping) else None
        kind = spec.get("type") if isinstance(spec, Mapping) else None
        converted = json.dumps(convert(value.strip(), kind), ensure_ascii=False)
        lead = "{" if self._count == 0 else ", "
        self._sink.delta(f"{lead}{json.dumps(self._key, ensure_ascii=False)}: {converted}")
        self._count += 1

    def _end_call(self) -> None:
        super()._end_call()
        self._state = TAIL  # one call per segment

    def _junk(self, why: str) -> None:
        self._sink.warn(f"{why}; the call ends here")
        self._end_call()
        self._warned = True



def _layout(text: str) -> str:
    """`text` without the layout before a tag: whitespace, and the literal `\\n` some
    templates write between a key and its value (the references skip both)."""
    while True:
        rest = text.lstrip()
        if rest.startswith("\\n"):
            rest = rest[2:]
        if rest == text:
            return rest
        text = rest
