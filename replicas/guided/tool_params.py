"""Qwen3-Coder's XML tool arguments as Lark rules, checked against the parameters schema.

The model writes one block per argument, in the schema's property order:

    <parameter=city>
    Paris
    </parameter>

A plain string value is raw text up to the closing tag (a lazy lexeme), bounded by the
schema's `minLength`/`maxLength` or limited to its `enum`/`const`; any other value is JSON
checked by its subschema (`%json`, with the root's `$defs` and JSON options, so `$ref`s
and the house whitespace rules still hold).
"""

from __future__ import annotations

import json
from typing import Any

CLOSE = "\n</parameter>"
_STRING_KEYWORDS = {"type", "enum", "const", "minLength", "maxLength", "title",
                    "description", "default", "examples"}


def xml_parameters(schema: dict[str, Any], rule: str) -> list[str]:
    """Rules defining `rule` as the argument blocks of an object `schema`.

    Raises ValueError for a string constraint that raw text cannot carry (`pattern`,
    `format`): those need the JSON formats.
    """
    properties: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    context = {k: schema[k] for k in ("$defs", "definitions", "x-guidance") if k in schema}
    rules: list[str] = []
    parts: list[str] = []
    for j, (name, sub) in enumerate(properties.items()):
        value = f"{rule}_{j}"
        opening = json.dumps(f"<parameter={name}>\n")
        if _is_plain_string(sub):
            rules.extend(_string_value(value, sub, name))
            block = f"{opening} {value} \"\\n\""
        else:
            rules.append(f"{value}: %json {json.dumps({**context, **_as_schema(sub)})}")
            block = f"{opening} {value} {json.dumps(CLOSE + chr(10))}"
        parts.append(block if name in required else f"({block})?")
    if not properties and schema.get("additionalProperties") is not False:
        # A free-form object: any names, raw text values.
        rules.append(f'{rule}_any[lazy]: /(?s:.*)/ {json.dumps(CLOSE)}')
        parts.append(f'("<parameter=" /[a-zA-Z0-9_.-]+/ ">\\n" {rule}_any "\\n")*')
    rules.insert(0, f"{rule}: " + (" ".join(parts) or '""'))
    return rules


def _as_schema(sub: Any) -> dict[str, Any]:
    if sub is True:
        return {}
    if not isinstance(sub, dict):
        raise ValueError(f"property schema must be an object, got {sub!r}")
    return sub


def _is_plain_string(sub: Any) -> bool:
    """A string schema, or an untyped enum/const of strings only."""
    if not isinstance(sub, dict):
        return False
    if "type" in sub:
        return bool(sub["type"] == "string")
    options = [sub["const"]] if "const" in sub else sub.get("enum")
    return isinstance(options, list) and bool(options) and all(
        isinstance(o, str) for o in options)


def _string_value(rule: str, sub: dict[str, Any], name: str) -> list[str]:
    unsupported = sorted(set(sub) - _STRING_KEYWORDS)
    if unsupported:
        raise ValueError(f"parameter {name!r}: qwen3_coder writes strings as raw text and "
                         f"cannot enforce {', '.join(unsupported)}")
    if "const" in sub or "enum" in sub:
        options = [sub["const"]] if "const" in sub else list(sub["enum"])
        texts = [o for o in options if isinstance(o, str)]
        if not texts:
            raise ValueError(f"parameter {name!r}: no string among its enum values")
        return [f"{rule}: " + " | ".join(json.dumps(t + CLOSE) for t in texts)]
    low, high = int(sub.get("minLength", 0)), sub.get("maxLength")
    bounds = f"{{{low},{'' if high is None else int(high)}}}"
    return [f"{rule}[lazy]: /(?s:.{bounds})/ {json.dumps(CLOSE)}"]
