"""Random logits through GuidedMatcher: every finished output must satisfy its spec.

Each run samples from seeded random logits (slightly biased toward the stop ids so open-ended
grammars end) masked by the matcher, until the matcher is complete or max tokens. Runs that
hit max tokens are counted and must be a small minority; all others are checked with an
independent validator (json + jsonschema, re.fullmatch, set membership).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from replicas.contract import GuidedSpec
from replicas.pipeline.guided import GuidedMatcher, compile_guided
from tests.unit.test_guided import build_hf_tokenizer, decode, guided_tokenizer

SEEDS = range(200)
MAX_TOKENS = 160
MAX_UNFINISHED = len(SEEDS) // 20  # at most 5% of runs may hit max tokens

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "score": {"type": ["number", "null"]},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SHAPE = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "kind": {"const": "poly"},
        "points": {"type": "array", "items": {"$ref": "#/$defs/point"},
                   "minItems": 1, "maxItems": 3},
        "label": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,6}$"}, {"const": 42}]},
        "day": {"type": "string", "format": "date"},
    },
    "required": ["kind", "points", "label", "day"],
    "additionalProperties": False,
}
EITHER = {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}
REGEX = r"[0-9]{3}-[a-z]+(\.[a-z]{2,3})?"
CHOICES = ("yes", "no", "maybe not", 'a "quoted" one')
GRAMMAR = 'start: item ("," item)*\nitem: NAME | NUM\nNAME: /[a-z]{1,5}/\nNUM: /[0-9]{1,3}/'
GRAMMAR_AS_REGEX = r"(?:[a-z]{1,5}|[0-9]{1,3})(?:,(?:[a-z]{1,5}|[0-9]{1,3}))*"


# --- random schemas (shared with test_guided_tools_random) -----------------------------

Schema = dict[str, Any]
_KEYS = st.from_regex(r"[a-z][a-z_]{0,6}", fullmatch=True)
# Leaves are bounded (string lengths, integer ranges), so random tokens finish a value;
# `number` stays open-ended on purpose and relies on the sampler's bias toward closers.
_LEAVES: st.SearchStrategy[Schema] = st.one_of(
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.from_regex(r"[a-z ]{0,5}", fullmatch=True), min_size=1, max_size=4,
             unique=True).map(lambda xs: {"enum": xs}),
    st.tuples(st.integers(-99, 99), st.integers(0, 99)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.sampled_from([
        {"type": "boolean"},
        {"type": "null"},
        {"type": "number", "minimum": -5, "maximum": 5},
        {"type": "string", "pattern": "^[a-z]{1,4}$"},
        {"type": "string", "format": "date"},
        {"const": "fixed"},
        {"type": ["integer", "null"], "maximum": 9, "minimum": 0},
    ]),
)


@st.composite
def object_schemas(draw: st.DrawFn, values: st.SearchStrategy[Schema] | None = None) -> Schema:
    """An object schema: up to 4 properties, some required, usually closed."""
    props = draw(st.dictionaries(_KEYS, values if values is not None else schema_nodes(),
                                 max_size=4))
    required = [k for k in props if draw(st.booleans())]
    schema: Schema = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    if draw(st.integers(0, 3)):  # open objects (extra keys of any JSON) now and then
        schema["additionalProperties"] = False
    return schema


def schema_nodes() -> st.SearchStrategy[Schema]:
    """Any schema: leaves nested in arrays, objects and anyOf, a few levels deep."""
    return st.recursive(_LEAVES, lambda inner: st.one_of(
        st.tuples(inner, st.integers(0, 3)).map(
            lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
        object_schemas(inner),
        st.lists(inner, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs}),
    ), max_leaves=6)


@dataclass(frozen=True)
class Run:
    text: str
    finished: bool  # the matcher completed before max tokens


def random_run(grammar: str, seed: int, prefer: tuple[int, ...] = ()) -> Run:
    """One sampled output; `prefer` ids get the same small bias as the stop ids."""
    tok, hf_size = guided_tokenizer(), len(build_hf_tokenizer())
    rng = np.random.default_rng(seed)
    matcher = GuidedMatcher(tok, grammar)
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = rng.standard_normal(tok.vocab_size).astype(np.float32) * 2.0
        logits[list(tok.eos_token_ids + prefer)] += 2.0
        masked = np.array(matcher.mask(mx.array(logits[None])))[0]
        assert not np.isfinite(masked[hf_size:]).any(), "a padded id was allowed"
        probs = np.exp(masked - masked.max())
        token = int(rng.choice(tok.vocab_size, p=probs / probs.sum()))
        matcher.consume(token)
        assert matcher.error is None, matcher.error
        if token in tok.eos_token_ids:
            assert matcher.is_complete
            return Run(decode(out), True)
        out.append(token)
        if matcher.is_complete:
            return Run(decode(out), True)
    return Run(decode(out), False)


def check_runs(spec: GuidedSpec, valid: Callable[[str], None],
               prefer: tuple[int, ...] = ()) -> list[Run]:
    grammar = compile_guided(spec)
    runs = [random_run(grammar, seed, prefer) for seed in SEEDS]
    unfinished = sum(not r.finished for r in runs)
    print(f"{spec.kind}: {len(runs) - unfinished} finished, {unfinished} hit max tokens")
    assert unfinished <= MAX_UNFINISHED, f"{unfinished}/{len(runs)} runs hit max tokens"
    for run in runs:
        if run.finished:
            valid(run.text)
    return runs


def schema_validator(schema: dict[str, Any]) -> Callable[[str], None]:
    checker = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    return lambda text: checker.validate(json.loads(text))


@pytest.mark.parametrize("schema", [PERSON, SHAPE, EITHER], ids=["person", "shape", "either"])
def test_json_schema_outputs_validate(schema: dict[str, Any]) -> None:
    check_runs(GuidedSpec("json_schema", json.dumps(schema)), schema_validator(schema))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(schema=object_schemas(), seed=st.integers(0, 2**32 - 1))
def test_random_schemas_outputs_validate(schema: Schema, seed: int) -> None:
    grammar = compile_guided(GuidedSpec("json_schema", json.dumps(schema)))
    run = random_run(grammar, seed, closers())
    # An open object can outgrow MAX_TOKENS on random logits, as check_runs allows for; a
    # grammar that rarely finishes still fails, through hypothesis's filter health check.
    assume(run.finished)
    schema_validator(schema)(run.text)


def test_non_strict_one_of_outputs_validate_as_any_of() -> None:
    overlapping = {"oneOf": [{"type": "integer", "maximum": 99}, {"type": "number"}]}
    as_any_of = {"anyOf": overlapping["oneOf"]}
    spec = GuidedSpec("json_schema", json.dumps(overlapping), strict=False)
    check_runs(spec, schema_validator(as_any_of))


def test_json_object_outputs_are_objects_with_bounded_blanks() -> None:
    def valid(text: str) -> None:
        assert isinstance(json.loads(text), dict), text
        assert longest_blank_run_outside_strings(text) <= 1, repr(text)

    check_runs(GuidedSpec("json_object"), valid, closers())


def test_regex_outputs_fullmatch() -> None:
    check_runs(GuidedSpec("regex", REGEX), fullmatches(REGEX))


def test_choice_outputs_are_exact_members() -> None:
    def is_choice(text: str) -> None:
        assert text in CHOICES, repr(text)

    runs = check_runs(GuidedSpec("choice", CHOICES), is_choice)
    assert {r.text for r in runs} == set(CHOICES), "every choice should be reachable"


def test_lark_grammar_outputs_match_an_equivalent_regex() -> None:
    check_runs(GuidedSpec("grammar", GRAMMAR), fullmatches(GRAMMAR_AS_REGEX))


def test_whitespace_loving_model_emits_at_most_one_blank_in_a_row() -> None:
    """Greedy, with every blank-only token strongly preferred, on a schema whose only
    free text is bounded: the output still finishes, with single blanks only."""
    schema = {**PERSON, "x-guidance": {"whitespace_flexible": True}}  # cannot loosen it
    tok, hf = guided_tokenizer(), build_hf_tokenizer()
    blank_ids = [i for i in range(len(hf)) if decode([i]).strip() == "" and decode([i])]
    assert any(len(decode([i])) > 1 for i in blank_ids), "need multi-blank tokens"
    matcher = GuidedMatcher(tok, compile_guided(GuidedSpec("json_schema", json.dumps(schema))))
    rng = np.random.default_rng(0)
    out: list[int] = []
    while not matcher.is_complete and len(out) < MAX_TOKENS:
        logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
        logits[blank_ids] += 50.0
        token = int(np.argmax(np.array(matcher.mask(mx.array(logits[None])))[0]))
        matcher.consume(token)
        assert matcher.error is None, matcher.error
        out.append(token)
    text = decode(out)
    assert matcher.is_complete, f"did not finish: {text!r}"
    schema_validator(PERSON)(text)
    assert longest_blank_run_outside_strings(text) == 1, repr(text)  # it took every one


def closers() -> tuple[int, ...]:
    """Free-form keys and values are unbounded strings, and uniform logits rarely pick one
    of the few tokens that close a string or an object: favour those, as a model would."""
    return tuple(i for i in range(len(build_hf_tokenizer()))
                 if any(c in decode([i]) for c in '"}]'))


def longest_blank_run_outside_strings(text: str) -> int:
    longest = run = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
            continue
        in_string = ch == '"'
        run = run + 1 if ch in " \t\r\n" else 0
        longest = max(longest, run)
    return longest


def fullmatches(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"

    return check
