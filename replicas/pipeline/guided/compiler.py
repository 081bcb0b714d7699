"""GuidedSpec -> llguidance grammar, validated before any generation starts."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from replicas.contract import GuidedSpec
from replicas.errors import InvalidRequestError
from replicas.pipeline.guided.schema_keywords import unknown_keywords

if TYPE_CHECKING:  # the TypedDict exists only in llguidance's type stubs
    from llguidance._lib import JsonCompileOptions

# Shared by validation and matchers: a grammar accepted under some limits must be built
# under the same ones. Short errors: they reach clients and logs, and must not echo the
# whole schema and parser state back.
PARSER_LIMITS: Final = LLParserLimits(verbose_errors=False)

# JSON whitespace outside strings: at most one blank between two lexemes, so a model that
# favours blanks cannot spin on them until max_tokens, while both `{"a":1}` and
# `{"a": 1, "b": 2}` stay reachable. Applied as overrides, so a schema's own `x-guidance`
# cannot loosen it; `lenient: False` keeps unimplemented keywords an error.
JSON_WHITESPACE_PATTERN: Final = r"\x20?"
_JSON_OPTIONS: Final[JsonCompileOptions] = {
    "whitespace_flexible": False,
    "whitespace_pattern": JSON_WHITESPACE_PATTERN,
    "item_separator": ",",
    "key_separator": ":",
    "lenient": False,
}

_ANY_OBJECT: Final = {"type": "object"}


def compile_guided(spec: GuidedSpec) -> str:
    """The llguidance grammar (a JSON string) for `spec`.

    Raises InvalidRequestError naming the problem: a schema that is not JSON or not valid,
    an unknown (strict) or unimplemented keyword, a regex that does not compile, an empty
    choice list, a Lark grammar that does not parse.
    """
    entry = _BUILDERS.get(spec.kind)
    if entry is None:
        raise InvalidRequestError(f"unknown guided decoding kind {spec.kind!r}")
    build, what = entry
    return validate(build(spec), what)


def named_grammars(spec: GuidedSpec, name: str) -> list[dict[str, Any]]:
    """`spec`'s grammar as entries of an llguidance grammar list, the first named `name`, so
    another grammar can use it as `@name` (the answer beside a tool grammar's calls).

    Raises InvalidRequestError as `compile_guided` does.
    """
    grammar = compile_guided(spec)
    # llguidance's own rule: a grammar text opening with `{` is its JSON form, else Lark.
    if not grammar.lstrip().startswith("{"):
        return [{"name": name, "lark_grammar": grammar}]
    first, *rest = json.loads(grammar)["grammars"]
    return [{**first, "name": name}, *rest]


def _json_object(spec: GuidedSpec) -> str:
    _expect(spec, type(None), "no value")
    return LLMatcher.grammar_from_json_schema(_ANY_OBJECT, overrides=_JSON_OPTIONS)


def _json_schema(spec: GuidedSpec) -> str:
    schema = checked_json_schema(_expect(spec, str, "the schema as JSON text"), strict=spec.strict)
    return LLMatcher.grammar_from_json_schema(schema)


def checked_json_schema(text: str, *, strict: bool, lenient: bool = False) -> dict[str, Any]:
    """The schema in `text`, checked, with the house JSON options in its `x-guidance`.

    Shared by response_format and tool parameters. Raises InvalidRequestError for text
    that is not JSON, a schema that is not an object, or (strict) unknown keywords.
    llguidance's own checks (unimplemented keywords, bad bounds) come at validation:
    errors, or with `lenient` warnings, the keyword left out of the grammar.
    """
    try:
        schema: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"JSON schema is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than Python's parser goes; llguidance stops at 128
        raise InvalidRequestError("JSON schema is nested too deeply") from None
    if schema is True:
        schema = {}  # `true` accepts any JSON value; llguidance wants an object
    elif schema is False:
        raise InvalidRequestError("JSON schema `false` accepts no output")
    elif not isinstance(schema, dict):
        raise InvalidRequestError(f"JSON schema must be an object, got {type(schema).__name__}")
    if strict:
        unknown = unknown_keywords(schema)
        if unknown:
            raise InvalidRequestError(
                "JSON schema uses keywords that strict mode cannot enforce: "
                + ", ".join(unknown)
            )
    # Non-strict relaxes what exact enforcement would refuse: oneOf becomes anyOf (its
    # "exactly one" cannot be checked token by token); unknown keywords are annotations.
    options: JsonCompileOptions = {**_JSON_OPTIONS, "coerce_one_of": not strict,
                                   "lenient": lenient}
    try:
        # Applied as overrides, so the schema's own x-guidance cannot loosen them; the
        # result is the schema with the merged options, usable as a Lark `%json` body.
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as exc:
        raise InvalidRequestError(f"invalid JSON schema: {exc}") from None
    merged: dict[str, Any] = json.loads(grammar)["grammars"][0]["json_schema"]
    return merged


def validate(grammar: str, what: str, tokenizer: LLTokenizer | None = None) -> str:
    """`grammar` if llguidance accepts it under PARSER_LIMITS, else InvalidRequestError.

    `tokenizer` is needed when the grammar names special tokens (`<tool_call>`).
    """
    return grammar_warnings(grammar, what, tokenizer)[0]


def grammar_warnings(grammar: str, what: str,
                     tokenizer: LLTokenizer | None = None) -> tuple[str, list[str]]:
    """`validate`, plus llguidance's warnings: under `lenient`, what the grammar leaves
    out (`Unimplemented keys: ["uniqueItems"]`, `Unknown format: ...`)."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        grammar, tokenizer, limits=PARSER_LIMITS
    )
    if is_error:
        message = messages[0].strip()
        if "coerce_one_of" in message:  # an llguidance option clients cannot set directly
            message += " (non-strict schemas do that)"
        raise InvalidRequestError(f"{what}: {message}")
    return grammar, [m.strip() for m in messages]


def _regex(spec: GuidedSpec) -> str:
    return LLMatcher.grammar_from_regex(_expect(spec, str, "the pattern"))


def _choice(spec: GuidedSpec) -> str:
    choices = _expect(spec, tuple, "a tuple of strings")
    if not choices:
        raise InvalidRequestError("guided_choice needs at least one choice")
    if not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError("guided_choice items must all be strings")
    # JSON string syntax is also Lark's string-literal syntax, so any text is quoted safely.
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _grammar(spec: GuidedSpec) -> str:
    lark = _expect(spec, str, "the Lark grammar")
    if not lark.strip():
        raise InvalidRequestError("guided_grammar is empty")
    return LLMatcher.grammar_from_lark(lark)


def _expect(spec: GuidedSpec, kind: type, description: str) -> Any:
    if not isinstance(spec.value, kind):
        raise InvalidRequestError(
            f"guided {spec.kind} takes {description}, got {type(spec.value).__name__}"
        )
    return spec.value


_BUILDERS: Final[dict[str, tuple[Callable[[GuidedSpec], str], str]]] = {
    "json_object": (_json_object, "invalid json_object grammar"),
    "json_schema": (_json_schema, "invalid JSON schema"),
    "regex": (_regex, "guided_regex does not compile"),
    "choice": (_choice, "invalid guided_choice"),
    "grammar": (_grammar, "invalid guided_grammar"),
}
