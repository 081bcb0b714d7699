"""Tagged tool arguments as Lark rules, checked against the parameters schema.

The model writes one block per argument, in the schema's property order, laid out by its
format's `ParamLayout` (Qwen3-Coder's below; GLM's `<arg_key>city</arg_key><arg_value>Paris
</arg_value>`, MiniMax's `<parameter name="city">Paris</parameter>`):

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

import functools
import json
import re
from collections.abc import Mapping
from typing import Any, Final

from replicas.pipeline.guided.schema_keywords import KNOWN_KEYWORDS
from replicas.families.tool_format import ParamLayout

# What raw text enforces of a string schema.
_ENFORCED: Final = frozenset({"type", "enum", "const", "minLength", "maxLength"})
# Keywords that constrain nothing: leaving them out of the grammar loses nothing. Unknown
# keywords (`x-*`, `nullable`, ...) are annotations too, as JSON Schema has it.
_ANNOTATIONS: Final = frozenset({"title", "description", "default", "examples", "deprecated",
                                 "readOnly", "writeOnly", "$comment", "$schema", "$id",
                                 "$anchor"})


def xml_parameters(schema: dict[str, Any], rule: str, layout: ParamLayout,
                   special: Mapping[str, str]) -> list[str]:
    """Rules defining `rule` as the argument blocks of an object `schema`; a plain
    string's keywords other than `_ENFORCED` are left out (`unenforced_string_keywords`).
    `special`: the tags that are one special token of the model, as Lark token references
    (llguidance never matches a special token as text).

    Raises ValueError for a schema raw text cannot write at all (an enum with no string).
    """
    properties: dict[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    context = {k: schema[k] for k in ("$defs", "definitions", "x-guidance") if k in schema}
    lit = functools.partial(_literal, special=special)
    close, after = lit(layout.close), f" {lit(layout.after)}" if layout.after else ""
    rules: list[str] = []
    blocks: list[tuple[str, bool]] = []
    for j, (name, sub) in enumerate(properties.items()):
        value = f"{rule}_{j}"
        opening = lit(layout.open.replace("{key}", name))
        if layout.raw_strings and _is_plain_string(sub) and layout.quote:
            # Gemma: the raw text ends at the closing quote, then the usual close.
            rules.extend(_string_value(value, sub, name, layout.quote, special))
            block = f"{opening} {lit(layout.quote)} {value} {close}{after}"
        elif layout.raw_strings and _is_plain_string(sub):
            rules.extend(_string_value(value, sub, name, layout.close, special))
            block = f"{opening} {value}{after}"
        else:
            rules.append(f"{value}: %json {json.dumps({**context, **_as_schema(sub)})}")
            block = f"{opening} {value} {close}{after}"
        blocks.append((block, name in required))
    free = not properties and schema.get("additionalProperties") is not False
    key_open, _, key_close = layout.open.partition("{key}")
    # Quoted values go with Python keyword names (pythonic); tags take any simple name.
    name_re = "/[a-zA-Z0-9_.-]+/" if layout.raw_strings else "/[a-zA-Z_][a-zA-Z0-9_]*/"
    key = f"{lit(key_open)} {name_re} {lit(key_close)}"
    if layout.sep:
        sep = lit(layout.sep)
        if free:  # a free-form object: any names, any JSON values
            rules.append(f"{rule}: ({key} %json {{}} {close} ({sep} {key} %json {{}} {close})*)?")
        else:
            rules.extend(_separated(rule, blocks, sep))
        return rules
    parts = [block if needed else f"({block})?" for block, needed in blocks]
    if free:  # a free-form object: any names, raw text values
        rules.append(_raw_text(f"{rule}_any", "*", layout.close, special))
        parts.append(f"({key} {rule}_any{after})*")
    rules.insert(0, f"{rule}: " + (" ".join(parts) or '""'))
    return rules


def _separated(rule: str, blocks: list[tuple[str, bool]], sep: str) -> list[str]:
    """`rule` as the blocks in order with `sep` between the ones written: a chain where
    `_h{j}` reads from block j on with none written yet and `_t{j}` after one was."""
    n = len(blocks)
    rules = [f"{rule}: {rule}_h0", f'{rule}_h{n}: ""', f'{rule}_t{n}: ""']
    for j, (block, needed) in enumerate(blocks):
        head, tail = f"{block} {rule}_t{j + 1}", f"{sep} {block} {rule}_t{j + 1}"
        if not needed:
            head, tail = f"{head} | {rule}_h{j + 1}", f"{tail} | {rule}_t{j + 1}"
        rules += [f"{rule}_h{j}: {head}", f"{rule}_t{j}: {tail}"]
    return rules


def _literal(text: str, special: Mapping[str, str]) -> str:
    """Lark for literal text whose tags may be special tokens."""
    if not special:
        return json.dumps(text)
    pieces = re.split("(" + "|".join(map(re.escape, special)) + ")", text)
    return " ".join(special.get(p) or json.dumps(p) for p in pieces if p) or '""'


def _raw_text(rule: str, bounds: str, close: str, special: Mapping[str, str]) -> str:
    """A raw-text value and its close. A text close ends the text at its first match (a
    lazy lexeme); free text cannot hold a special token, so it ends where that one comes."""
    if close in special:
        return f"{rule}: /(?s:.{bounds})/ {special[close]}"
    return f"{rule}[lazy]: /(?s:.{bounds})/ {json.dumps(close)}"


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


def _string_value(rule: str, sub: dict[str, Any], name: str, close: str,
                  special: Mapping[str, str]) -> list[str]:
    if "const" in sub or "enum" in sub:
        options = [sub["const"]] if "const" in sub else list(sub["enum"])
        texts = [o for o in options if isinstance(o, str)]
        if not texts:
            raise ValueError(f"parameter {name!r}: no string among its enum values")
        return [f"{rule}: (" + " | ".join(json.dumps(t) for t in texts)
                + f") {_literal(close, special)}"]
    low, high = int(sub.get("minLength", 0)), sub.get("maxLength")
    return [_raw_text(rule, f"{{{low},{'' if high is None else int(high)}}}", close, special)]
