"""Find JSON Schema keywords that no JSON Schema draft defines.

llguidance rejects keywords it knows but does not implement (`uniqueItems`, `not`, ...),
but, as JSON Schema allows, it ignores keywords it has never heard of. A strict request
must not lose a constraint that way (`nullable`, a typo such as `maxLenght`), so strict
schemas are checked here first; `x-` extensions are allowed as vendor annotations.
OpenAI's strict function calling adds its own rules for objects (`openai_strict_violations`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords of drafts 7, 2019-09 and 2020-12 (core, applicator, validation, meta-data,
# format, content). Whether llguidance implements them is llguidance's call.
KNOWN_KEYWORDS: frozenset[str] = frozenset({
    "$schema", "$id", "$ref", "$defs", "$anchor", "$dynamicRef", "$dynamicAnchor",
    "$recursiveRef", "$recursiveAnchor", "$vocabulary", "$comment", "definitions",
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas",
    "dependencies", "prefixItems", "items", "additionalItems", "contains", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "unevaluatedItems",
    "unevaluatedProperties",
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties",
    "required", "dependentRequired",
    "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",
    "format", "contentEncoding", "contentMediaType", "contentSchema",
})

# Where subschemas live: one schema, a list of schemas, or a map of name -> schema.
_ONE = ("additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
        "dependencies")


def unknown_keywords(schema: Any) -> list[str]:
    """Each unknown keyword as `"<JSON pointer>/<keyword>"`, in document order."""
    return [
        f"{pointer}/{_escape(key)}"
        for pointer, node in walk(schema)
        for key in node
        if key not in KNOWN_KEYWORDS and not key.startswith("x-")
    ]


def openai_strict_violations(schema: Any) -> list[str]:
    """Where `schema` breaks OpenAI's strict function-calling rules, as JSON pointers.

    Every object schema must set `additionalProperties: false` and list all of its
    properties in `required` (optional fields are written as `"type": [T, "null"]`).
    """
    found: list[str] = []
    for pointer, node in walk(schema):
        kind = node.get("type")
        is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
        if not is_object and "properties" not in node:
            continue
        if node.get("additionalProperties") is not False:
            found.append(f"{pointer} needs additionalProperties: false")
        properties = node.get("properties") or {}
        required = node.get("required") or []
        missing = [name for name in properties if name not in required]
        if missing:
            found.append(f"{pointer} must list {', '.join(missing)} in required")
    return found


def walk(schema: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (sub)schema that is an object, with its JSON pointer, in document order."""
    stack: list[tuple[str, Any]] = [("#", schema)]
    while stack:  # iterative: a deeply nested schema must not hit the recursion limit
        pointer, node = stack.pop()
        if not isinstance(node, dict):
            continue  # boolean schemas, or malformed values llguidance will reject
        yield pointer, node
        stack.extend(reversed(list(_subschemas(pointer, node))))


def _subschemas(pointer: str, node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        here = f"{pointer}/{_escape(key)}"
        if key in _ONE or (key == "items" and isinstance(value, dict)):
            yield here, value
        elif key in _LIST or (key == "items" and isinstance(value, list)):
            if isinstance(value, list):
                yield from ((f"{here}/{i}", item) for i, item in enumerate(value))
        elif key in _MAP and isinstance(value, dict):
            # `dependencies` values may also be lists of names; those are skipped above.
            yield from ((f"{here}/{_escape(name)}", sub) for name, sub in value.items())


def _escape(token: str) -> str:
    """JSON pointer escaping (RFC 6901), so a reported path can be followed."""
    return token.replace("~", "~0").replace("/", "~1")
