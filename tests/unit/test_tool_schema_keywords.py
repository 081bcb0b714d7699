"""Schema keywords a tool grammar cannot enforce never refuse a non-strict request: they
are left out of the grammar and named in its warnings; an explicit `strict` still refuses
them. What the grammar does enforce still holds."""

from __future__ import annotations

import pytest

from replicas.contract import ToolChoice, ToolSpec
from replicas.errors import InvalidRequestError
from replicas.pipeline.guided.tool_params import unenforced_string_keywords
from replicas.pipeline.guided.tools import ToolGrammar, compile_tool_grammar
from tests.unit.test_guided_tools import accepts, builtin_guided_tokenizer, call_text, tool

# What real tools carry on a string parameter (Claude Code's and Codex's tools among them).
ANNOTATED_URL = {"type": "string", "format": "uri", "title": "URL", "deprecated": False,
                 "examples": ["https://example.com"], "x-order": 1,
                 "$schema": "http://json-schema.org/draft-07/schema#", "maxLength": 40}
FETCH = tool("fetch", {"type": "object", "required": ["url", "when"], "properties": {
    "url": ANNOTATED_URL, "when": {"type": "string", "format": "date-time"}}})


def compiled(fmt: str, *tools: ToolSpec) -> ToolGrammar:
    result = compile_tool_grammar(fmt, tools, ToolChoice("required"),
                                  tokenizer=builtin_guided_tokenizer())
    assert result is not None
    return result


def test_only_the_constraints_raw_text_cannot_carry_are_named() -> None:
    # Annotations (title, examples, x-*, $schema, ...) constrain nothing: not named.
    schema = {"properties": {"url": ANNOTATED_URL, "n": {"type": "integer", "format": "int32"},
                             "d": {"type": "string", "pattern": "^a", "contentEncoding": "x"}}}
    assert unenforced_string_keywords(schema) == [
        "parameter 'url': format", "parameter 'd': contentEncoding, pattern"]


def test_qwen3_coder_compiles_annotated_strings_and_warns_for_what_it_leaves_out() -> None:
    result = compiled("qwen3_coder", FETCH)
    assert len(result.warnings) == 2
    url, when = result.warnings
    assert url.startswith("tool 'fetch': ") and "parameter 'url': format" in url
    assert "parameter 'when': format" in when and "the model still sees" in when
    # What raw text can carry still holds: maxLength.
    ok = call_text("qwen3_coder", "fetch", {"url": "not a uri", "when": "soon"})
    assert accepts(result.grammar, ok)
    too_long = call_text("qwen3_coder", "fetch", {"url": "x" * 41, "when": "soon"})
    assert not accepts(result.grammar, too_long)


def test_json_formats_leave_out_unimplemented_keywords_and_name_them() -> None:
    unique = tool("tag", {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "kind": {"type": "string", "format": "no-such-format"}}, "required": ["tags"]})
    result = compiled("hermes", unique)
    assert any("tool 'tag'" in w and "uniqueItems" in w for w in result.warnings)
    assert any("no-such-format" in w for w in result.warnings)
    assert accepts(result.grammar, call_text("hermes", "tag", {"tags": [1, 1]}))
    assert not accepts(result.grammar, call_text("hermes", "tag", {"tags": ["a"]}))


def test_formats_llguidance_enforces_are_no_warning_in_json_formats() -> None:
    assert compiled("hermes", FETCH).warnings == ()


def test_an_explicit_strict_still_refuses_what_the_grammar_cannot_enforce() -> None:
    strict = tool("tag", {"type": "object", "additionalProperties": False, "required": ["t"],
                          "properties": {"t": {"type": "array", "uniqueItems": True}}},
                  strict=True)
    with pytest.raises(InvalidRequestError, match="uniqueItems") as info:
        compiled("hermes", strict)
    assert info.value.param == "tools"
