"""Qwen3-Coder's XML tool arguments as Lark rules, checked against the parameters schema.

The model writes one block per argument, in the schema's property order:

    <parameter=city>
    Paris
    </parameter>

A plain string value is raw text up to the closing tag (a lazy lexeme), bounded by the
schema's `minLength`/`maxLength` or limited to its `enum`/`const`; any other value is JSON
checked by its subschema (`%json`, with the root's `$defs` and JSON options, so `$ref`s
and the house whitespace rules still hold). Raw text cannot carry a string's other
constraints (`pattern`, `format`, ...): the grammar leaves them out, and
`unenforced_string_keywords` names them for the response's warnings. The model still sees
them, in the schema its prompt shows.
"""

from __future__ import annotations

import json
from typing import Any, Final

from replicas.guided.schema_keywords import KNOWN_KEYWORDS

CLOSE = "\n</parameter>"
# What raw text enforces of a string schema.
_ENFORCED: Final = frozenset({"type", "enum", "const", "minLength", "maxLength"})
# Keywords that constrain nothing: leaving them out of the grammar loses nothing. Unknown
# keywords (`x-*`, `nullable`, ...) are annotations too, as JSON Schema has it.
_ANNOTATIONS: Final = frozenset({"title", "description", "default", "examples", "deprecated",
                                 "readOnly", "writeOnly", "$comment", "$schema", "$id",
                                 "$anchor"})


def xml_parameters(schema: dict[str, Any], rule: str) -> list[str]:
    """Rules defining `rule` as the argument blocks of an object `schema`; a plain
    string's keywords other than `_ENFORCED` are left out (`unenforced_string_keywords`).

    Raises ValueError for a schema raw text cannot write at all (an enum with no string).
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


def unenforced_string_keywords(schema: dict[str, Any]) -> list[str]:
    """The constraints of `schema`'s plain string parameters that the grammar leaves out,
    as "parameter 'url': format", in property order; annotations are not listed."""
    found: list[str] = []
    for name, sub in (schema.get("properties") or {}).items():
        if not _is_plain_string(sub):
            continue
        dropped = sorted(key for key in sub if key in KNOWN_KEYWORDS
                         and key not in _ENFORCED and key not in _ANNOTATIONS)
        if dropped:
            found.append(f"parameter {name!r}: {', '.join(dropped)}")
    return found


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
    if "const" in sub or "enum" in sub:
        options = [sub["const"]] if "const" in sub else list(sub["enum"])
        texts = [o for o in options if isinstance(o, str)]
        if not texts:
            raise ValueError(f"parameter {name!r}: no string among its enum values")
        return [f"{rule}: " + " | ".join(json.dumps(t + CLOSE) for t in texts)]
    low, high = int(sub.get("minLength", 0)), sub.get("maxLength")
    bounds = f"{{{low},{'' if high is None else int(high)}}}"
    return [f"{rule}[lazy]: /(?s:.{bounds})/ {json.dumps(CLOSE)}"]
